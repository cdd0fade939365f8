"""Built-in tool environments for multi-turn RL, usable offline, in TRL's `environment_factory` form.

An environment is a class whose public methods are its tools (type hints and a docstring that
describes every argument: `transformers.utils.get_json_schema` turns them into the schemas the
chat template shows). A fresh instance serves one rollout: `reset(**row)` is called first with
the dataset row's columns and may return a string to append to the last user message;
`get_reward()`, when the class has it, scores the finished rollout from the instance's state.

* `CalculatorEnv`: multiply two 2-digit numbers (32-99, so every product has 4 digits), which a
  tiny model cannot do in its head but can with `calculate`; `calculator_dataset` gives the
  prompts and answers and `calculator_reward` checks the final answer (the answer is in the text,
  not in the state). `CalculatorEnv(show_results=False)` withholds the results: the no-tool baseline.
* `GuessNumberEnv`: find a secret number with `guess`, answered "higher" / "lower" /
  "correct"; `get_reward` pays success, less for more guesses than binary search needs.

`calculator_traces` / `guess_number_traces` are conversations in which the assistant calls the
tool and then answers, with the `tools` column the environment would give: a short SFT on them
teaches a small model the call format before RL. `calculator_traces(list_tools=False)` leaves the
tools out of the rows (about 70 tokens instead of 300: the template's tool listing is most of a
row), where the tiny model learns to copy digits several times faster (its attention is spread
over fewer positions); a few steps on the full rows then carry the skill over to the prompt RL uses.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
from typing import Any

from posttrain.core.registry import Registry
from posttrain.data.chat import TOOL_CALL_END
from posttrain.data.tools import environment_tools, tool_schemas
from posttrain.tasks.builtin import final_answer

__all__ = ["ENVIRONMENTS", "CalculatorEnv", "GuessNumberEnv", "calculator_dataset", "calculator_reward",
           "calculator_traces", "environment_tools", "evaluate_arithmetic", "guess_number_dataset",
           "guess_number_traces"]

# --------------------------------------------------------------------------- safe arithmetic

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_CHARS = 200
_MAX_MAGNITUDE = 10 ** 60  # every intermediate value; keeps 9**9**9-style inputs from eating the machine
_MAX_EXPONENT = 200


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, unary signs, parentheses.

    Parsed with `ast` and walked node by node (never `eval`): names, calls, attributes and every
    other construct are refused, as are exponents above 200 and values above 1e60 in magnitude.
    Raises ValueError saying what is wrong (ZeroDivisionError for a division by zero).
    """
    if not isinstance(expression, str):
        raise ValueError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"the expression is longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def walk(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            value = node.value
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            value = _UNARY[type(node.op)](walk(node.operand))
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"the exponent {right} is above {_MAX_EXPONENT}")
            value = _BINARY[type(node.op)](left, right)
        else:
            raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")
        if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
            raise ValueError("the value is out of range")
        return value

    return walk(tree.body)


def _number_text(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


# --------------------------------------------------------------------------- calculator task


class CalculatorEnv:
    """Multiplication of two 2-digit numbers with a calculator tool.

    The episode the model should write: call `calculate` with the product, read the result, and
    answer with the number. The answer lives in the text, so `calculator_reward` (a reward
    function) scores it; `calls` and `results` record what the tool did. With
    `show_results=False` the tool answers "unavailable" (it still evaluates and records): the
    same episodes without the tool's help, to show the task is not solved without it.
    """

    def __init__(self, show_results: bool = True):
        self.show_results = show_results
        self.calls = 0
        self.results: list[str] = []

    def reset(self, **row: Any) -> None:
        self.calls = 0
        self.results = []

    def calculate(self, expression: str) -> str:
        """Evaluate arithmetic.

        Args:
            expression: For example 2 * 3.
        """
        # the schema's texts are short on purpose: they are in every prompt, and digits in them
        # would be more places for a tiny model's attention to land when it copies the operands
        self.calls += 1
        result = _number_text(evaluate_arithmetic(expression))
        self.results.append(result)
        return result if self.show_results else "unavailable"


def _splits(make, split: str, size: int | None, defaults: tuple[int, int], seed: int, name: str) -> list:
    """Distinct items from `make(rng)`, the test ones drawn first: the two splits never share one."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    train_size, test_size = defaults
    size = size or (train_size if split == "train" else test_size)
    test_size = size if split == "test" else test_size
    wanted = test_size + (size if split == "train" else 0)
    rng = random.Random(f"{name}-{seed}")
    seen: dict = {}
    for _ in range(50 * wanted):
        if len(seen) == wanted:
            break
        item = make(rng)
        seen.setdefault(item, None)
    else:
        raise ValueError(f"{name} has fewer than {wanted} distinct items; ask for a smaller size")
    items = list(seen)
    return items[:test_size] if split == "test" else items[test_size:]


FACTORS = (32, 99)  # 32 * 32 = 1024: every product has 4 digits, so the answer's layout never shifts


def _factors(rng: random.Random) -> tuple[int, int]:
    return rng.randint(*FACTORS), rng.randint(*FACTORS)


def calculator_dataset(split: str = "train", size: int | None = None, seed: int = 0):
    """Rows `prompt` (one user message "What is A * B?") and `answer` (the product, a string).

    A and B are in 32..99 (4624 ordered pairs). Deterministic; train (1000 rows by default) and
    test (200) never share a pair of factors, so held-out products cannot be memorised.
    """
    from datasets import Dataset

    pairs = _splits(_factors, split, size, (1000, 200), seed, "calculator")
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}], "answer": str(a * b)}
                              for a, b in pairs])


def last_answer_text(completion) -> str:
    """What the assistant says last: the content of its last message (a message list), or the text
    after the last tool call (a string)."""
    if isinstance(completion, str):
        return completion.rpartition(TOOL_CALL_END)[2]
    said = [m.get("content") or "" for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
    return said[-1] if said else ""


def calculator_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the final number of the assistant's last message is the answer, else 0.0.

    completions: the episodes, each a message list (assistant turns, tool calls, tool results)
    or a string; a tool result that holds the answer earns nothing until the assistant says it.
    """
    return [float(final_answer(last_answer_text(c)) == str(a).strip()) for c, a in zip(completions, answer)]


def _call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def calculator_traces(split: str = "train", size: int | None = None, seed: int = 0, list_tools: bool = True):
    """SFT conversations for the calculator task: `messages` (user, a `calculate` call, its result,
    the answer) and `tools` (the environment's schemas as a JSON string; no `tools` column when
    `list_tools` is False, so the template leaves the tool listing out), one per
    `calculator_dataset` row of the same split and seed."""
    from datasets import Dataset

    tools = {"tools": json.dumps(tool_schemas(environment_tools(CalculatorEnv())))} if list_tools else {}
    rows = []
    for row in calculator_dataset(split, size, seed):
        expression = row["prompt"][0]["content"].removeprefix("What is ").removesuffix("?")
        rows.append({"messages": [
            *row["prompt"],
            {"role": "assistant", "content": "", "tool_calls": [_call("calculate", expression=expression)]},
            {"role": "tool", "name": "calculate", "content": _number_text(evaluate_arithmetic(expression))},
            {"role": "assistant", "content": row["answer"]},
        ], **tools})
    return Dataset.from_list(rows)


# --------------------------------------------------------------------------- guess the number


class GuessNumberEnv:
    """Find a secret integer in [low, high] with `guess`, answered "higher", "lower" or "correct".

    `reset(secret=..., low=..., high=...)` takes the row's columns; without a `secret` one is
    drawn, and without a `prompt` column (training without a dataset) reset returns the task
    statement. `get_reward()`: 0 unless found; found in at most the guesses binary search needs
    in the worst case (floor(log2(n)) + 1 for n numbers) gives 1, more guesses give that number
    over the guesses used. Guesses past `max_guesses` are refused.
    """

    def __init__(self, seed: int | None = None):
        self.rng = random.Random(seed)
        self.low, self.high, self.secret, self.max_guesses = 1, 16, 1, 10
        self.guesses = 0
        self.found = False

    def reset(self, secret: int | None = None, low: int = 1, high: int = 16, max_guesses: int | None = None,
              **row: Any) -> str | None:
        if low > high:
            raise ValueError(f"low ({low}) must not exceed high ({high})")
        self.low, self.high = int(low), int(high)
        self.secret = int(secret) if secret is not None else self.rng.randint(self.low, self.high)
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"the secret {self.secret} is outside [{self.low}, {self.high}]")
        self.max_guesses = int(max_guesses) if max_guesses is not None else 2 * self._optimal_guesses()
        self.guesses, self.found = 0, False
        return None if "prompt" in row else guess_number_prompt(self.low, self.high)

    def _optimal_guesses(self) -> int:
        """Guesses binary search needs in the worst case over the range."""
        return int(math.log2(self.high - self.low + 1)) + 1

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: The guess.
        """
        n = int(n)
        if self.found:
            return f"correct: you already found {self.secret}"
        if self.guesses >= self.max_guesses:
            return "no guesses left"
        self.guesses += 1
        if n < self.secret:
            return "higher"
        if n > self.secret:
            return "lower"
        self.found = True
        return "correct"

    def get_reward(self) -> float:
        """1 when found within the worst-case binary-search count, fewer over more guesses, 0 if not found."""
        if not self.found:
            return 0.0
        return min(1.0, self._optimal_guesses() / self.guesses)


def guess_number_prompt(low: int, high: int) -> str:
    return f"Find my number from {low} to {high}."


def guess_number_dataset(split: str = "train", size: int | None = None, low: int = 1, high: int = 16,
                         seed: int = 0):
    """Rows `prompt` (one user message stating the range), `secret`, `low`, `high`.

    Every prompt reads the same: the secret is found only through the tool's feedback. Secrets
    are drawn per split (train 500, test 100 rows by default) from a fixed seed.
    """
    from datasets import Dataset

    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    size = size or (500 if split == "train" else 100)
    rng = random.Random(f"guess-number-{split}-{seed}")
    prompt = [{"role": "user", "content": guess_number_prompt(low, high)}]
    return Dataset.from_list([{"prompt": prompt, "secret": rng.randint(low, high), "low": low, "high": high}
                              for _ in range(size)])


def guess_number_traces(split: str = "train", size: int | None = None, low: int = 1, high: int = 16, seed: int = 0):
    """SFT conversations for the guessing game: binary search, one `guess` call per turn with the
    environment's answer after it, then the number; `tools` as in `calculator_traces`."""
    from datasets import Dataset

    tools = json.dumps(tool_schemas(environment_tools(GuessNumberEnv())))
    rows = []
    for row in guess_number_dataset(split, size, low, high, seed):
        env = GuessNumberEnv()
        env.reset(**row)
        messages = list(row["prompt"])
        lo, hi = low, high
        while not env.found:
            n = (lo + hi) // 2
            feedback = env.guess(n)
            messages += [{"role": "assistant", "content": "", "tool_calls": [_call("guess", n=n)]},
                         {"role": "tool", "name": "guess", "content": feedback}]
            lo, hi = (n + 1, hi) if feedback == "higher" else (lo, n - 1) if feedback == "lower" else (n, n)
        messages.append({"role": "assistant", "content": str(row["secret"])})
        rows.append({"messages": messages, "tools": tools})
    return Dataset.from_list(rows)


# Names for configuration files and the CLI: a factory per environment.
ENVIRONMENTS = Registry("environment", entries={"calculator": CalculatorEnv, "guess_number": GuessNumberEnv})
