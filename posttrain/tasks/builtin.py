"""Datasets that ship with posttrain, built offline in memory.

* ``zen(layout, conversational=False)``: the Zen of Python in every dataset layout posttrain
  accepts, the familiar toy data for smoke tests.
* ``task_dataset(task, split)``: verifiable tasks with an exact-match checker and reward
  functions, small enough for a tiny model to learn on CPU in minutes. Every trainer's learning
  test and the demo use them.

``load_builtin(name)`` resolves the names the CLI accepts ("zen/preference", "reverse", ...).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import random
import re

from posttrain.core.registry import Registry
from posttrain.tasks import rewards as trl_rewards

ZEN_LAYOUTS = ("language_modeling", "prompt_only", "prompt_completion", "preference",
               "implicit_prompt_preference", "unpaired_preference")


def zen_lines() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[2:] if line.strip()]


def _split(line: str) -> tuple[str, str]:
    """Cut an aphorism into a prompt and a completion at a word boundary near its middle."""
    words = line.split(" ")
    cut = max(1, len(words) // 2)
    return " ".join(words[:cut]), " " + " ".join(words[cut:])


def zen(layout: str = "language_modeling", conversational: bool = False):
    """The Zen of Python in `layout` (one of ZEN_LAYOUTS); rejected completions come from the next line."""
    from datasets import Dataset

    if layout not in ZEN_LAYOUTS:
        raise ValueError(f"unknown zen layout {layout!r}; choose one of {ZEN_LAYOUTS}")
    lines = zen_lines()
    halves = [_split(line) for line in lines]
    rows = []
    for i, (prompt, completion) in enumerate(halves):
        wrong = halves[(i + 7) % len(halves)][1]
        if conversational:
            user = [{"role": "user", "content": prompt}]
            good = [{"role": "assistant", "content": completion.strip()}]
            bad = [{"role": "assistant", "content": wrong.strip()}]
            row = {
                "language_modeling": {"messages": user + good},
                "prompt_only": {"prompt": user},
                "prompt_completion": {"prompt": user, "completion": good},
                "preference": {"prompt": user, "chosen": good, "rejected": bad},
                "implicit_prompt_preference": {"chosen": user + good, "rejected": user + bad},
                "unpaired_preference": {"prompt": user, "completion": good if i % 2 == 0 else bad,
                                        "label": i % 2 == 0},
            }[layout]
        else:
            row = {
                "language_modeling": {"text": prompt + completion},
                "prompt_only": {"prompt": prompt},
                "prompt_completion": {"prompt": prompt, "completion": completion},
                "preference": {"prompt": prompt, "chosen": completion, "rejected": wrong},
                "implicit_prompt_preference": {"chosen": prompt + completion, "rejected": prompt + wrong},
                "unpaired_preference": {"prompt": prompt, "completion": completion if i % 2 == 0 else wrong,
                                        "label": i % 2 == 0},
            }[layout]
        rows.append(row)
    return Dataset.from_list(rows)


# ---------------------------------------------------------------- verifiable tasks

def _reverse_example(rng: random.Random, min_len: int, max_len: int):
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
    return f"reverse {digits} =", digits[::-1]


def _add_example(rng: random.Random, min_len: int, max_len: int):
    a, b = rng.randint(0, 10 ** max_len - 1), rng.randint(0, 10 ** min_len - 1)
    return f"add {a} {b} =", str(a + b)


def _quick_add_example(rng: random.Random, min_len: int, max_len: int):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"What is {a} + {b}?", str(a + b)


TASKS = {
    # digit-string reversal: positional copying, which small transformers pick up fast
    "reverse": (_reverse_example, 4, 4),
    # addition of two numbers below 100: digit sums plus a carry
    "add": (_add_example, 2, 2),
    # single-digit sums asked in words, for real chat models, checked by `final_answer_check`
    # within a short budget: SmolLM2-135M-Instruct knows the sums ("8 + 7 = 15") but mostly starts
    # a long explanation ("To add 8 and 7, you simply...") that the budget cuts off
    "quick-add": (_quick_add_example, 1, 1),
}
# (train, test) sizes by default; quick-add has only 100 distinct prompts
DEFAULT_SIZES = {"reverse": (2000, 200), "add": (2000, 200), "quick-add": (70, 30)}


def task_dataset(task: str = "reverse", split: str = "train", size: int | None = None,
                 conversational: bool = False, seed: int = 0):
    """Rows with `prompt`, `completion` (leading space, no EOS) and the bare `answer`.

    Train and test are drawn from disjoint sets of prompts with a fixed seed, so held-out
    accuracy measures generalisation, not recall.
    """
    from datasets import Dataset

    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASKS)}")
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    make, lo, hi = TASKS[task]
    default_train, default_test = DEFAULT_SIZES[task]
    size = size or (default_train if split == "train" else default_test)
    rng = random.Random(f"{task}-{seed}")
    seen: dict[str, str] = {}
    test_size = default_test if split == "train" else size
    wanted = test_size + (size if split == "train" else 0)  # test prompts first, then train
    for _ in range(50 * wanted):
        if len(seen) == wanted:
            break
        prompt, answer = make(rng, lo, hi)
        seen.setdefault(prompt, answer)
    else:
        raise ValueError(f"task {task!r} has fewer than {wanted} distinct prompts; ask for a smaller size")
    items = list(seen.items())
    items = items[:test_size] if split == "test" else items[test_size:]
    rows = []
    for prompt, answer in items:
        if conversational:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "completion": [{"role": "assistant", "content": answer}], "answer": answer})
        else:
            rows.append({"prompt": prompt, "completion": " " + answer, "answer": answer})
    return Dataset.from_list(rows)


def task_preference_dataset(task: str = "reverse", split: str = "train", size: int | None = None,
                            corruption: str = "letter", unpaired: bool = False, seed: int = 0, reference: bool = False):
    """Preference data for a task: `prompt`, `chosen` (the right answer), `rejected` (a corrupted one), `answer`.

    corruption "letter": one digit becomes a lowercase letter, a malformed answer (never the
    first digit: " a274" would merge " a" into one token, and a shorter rejected answer is
    favoured by its length alone); "digit": one digit becomes another digit, a wrong answer of
    the right form (much harder to learn). With `unpaired`: `prompt`, `completion`, `label`,
    one row per prompt, alternately the right (True) and the corrupted (False) answer. With `reference`
    (pairs only): a `reference` column, the gold answer, for TPO's triples.
    """
    from datasets import Dataset

    if corruption not in ("letter", "digit"):
        raise ValueError(f"unknown corruption {corruption!r}; choose 'letter' or 'digit'")
    rng = random.Random(f"{task}-{split}-{corruption}-{seed}")
    rows = []
    for i, row in enumerate(task_dataset(task, split, size, seed=seed)):
        answer = row["answer"]
        k = rng.randrange(1, len(answer)) if len(answer) > 1 else 0
        pool = "abcdefghijklmnopqrstuvwxyz" if corruption == "letter" else "0123456789".replace(answer[k], "")
        good, bad = " " + answer, " " + answer[:k] + rng.choice(pool) + answer[k + 1:]
        if unpaired:
            rows.append({"prompt": row["prompt"], "completion": good if i % 2 == 0 else bad, "label": i % 2 == 0,
                         "answer": answer})
        else:
            rows.append({"prompt": row["prompt"], "chosen": good, "rejected": bad, "answer": answer,
                         **({"reference": " " + answer} if reference else {})})
    return Dataset.from_list(rows)


def _steps(task: str, prompt: str, answer: str) -> list[str]:
    """A task's worked solution as steps: `reverse`, one answer digit a step ("digit 1 is 4"); `add`, one column
    a step from the right ("7+5+0=12", "3+4+0=07": the sum always two digits, carry first), then the answer
    ("answer 132")."""
    if task == "reverse":
        return [f"digit {i + 1} is {d}" for i, d in enumerate(answer)]
    a, b = (s[::-1] for s in prompt.split()[1:3])
    steps, carry = [], 0
    for i in range(max(len(a), len(b))):
        x, y = int(a[i]) if i < len(a) else 0, int(b[i]) if i < len(b) else 0
        steps.append(f"{x}+{y}+{carry}={x + y + carry:02d}")
        carry = (x + y + carry) // 10
    return steps + [f"answer {answer}"]


def _corrupt_step(step: str, rng: random.Random, corruption: str) -> str:
    """The step with one digit of its last number replaced: by a lowercase letter ("letter", a malformed step)
    or by another digit ("digit", a wrong result of the right form; in an arithmetic step "x+y+c=s" the carry
    digit of s flips between 0 and 1, a digit 2-9 there would be wrong by its form alone)."""
    last = list(re.finditer(r"\d+", step))[-1]
    k = rng.randrange(last.start(), last.end())
    pool = "abcdefghijklmnopqrstuvwxyz" if corruption == "letter" else "0123456789".replace(step[k], "")
    if corruption == "digit" and "=" in step and k == last.start():
        pool = "10".replace(step[k], "")  # a wrong carry digit stays 0 or 1: wrong by the arithmetic, not the form
    return step[:k] + rng.choice(pool) + step[k + 1:]


def _corruptible_steps(task: str, steps: list[str], corruption: str) -> int:
    """How many leading steps may be the wrong one. A wrong digit in `add`'s answer step ("answer 132") is a
    copying error that only the column steps before it reveal, so "digit" errors go into the column steps
    ("7+5+0=12"), whose correctness is in their own tokens."""
    return len(steps) - 1 if task == "add" and corruption == "digit" else len(steps)


def task_stepwise_dataset(task: str = "reverse", split: str = "train", size: int | None = None, seed: int = 0,
                          corrupted_fraction: float = 0.5, corruption: str = "letter"):
    """Stepwise supervision for process reward models: `prompt`, `completions` (the solution's steps, see
    `_steps`), `labels` (one bool per step: is it correct), `answer`.

    A `corrupted_fraction` of the rows has one wrong step at a random position, a digit of its result
    replaced by a letter (`corruption="letter"`, a malformed step) or by another digit ("digit", a wrong
    result of the right form: much harder to learn, as for `task_preference_dataset`): the steps before
    it are labelled True, it is labelled False and the row ends there (the first error, as PRM800K labels
    solutions); the other rows are the whole correct solution, every step True. Prompts are the task's
    (train and test disjoint)."""
    from datasets import Dataset

    if task not in ("reverse", "add"):
        raise ValueError(f"stepwise data exists for the tasks 'reverse' and 'add', got {task!r}")
    if corruption not in ("letter", "digit"):
        raise ValueError(f"unknown corruption {corruption!r}; choose 'letter' or 'digit'")
    rng = random.Random(f"{task}-{split}-stepwise-{corruption}-{seed}")
    rows = []
    for row in task_dataset(task, split, size, seed=seed):
        steps = _steps(task, row["prompt"], row["answer"])
        labels = [True] * len(steps)
        if rng.random() < corrupted_fraction:
            k = rng.randrange(_corruptible_steps(task, steps, corruption))
            steps, labels = steps[:k] + [_corrupt_step(steps[k], rng, corruption)], labels[:k] + [False]
        rows.append({"prompt": row["prompt"], "completions": steps, "labels": labels, "answer": row["answer"]})
    return Dataset.from_list(rows)


def completion_text(completion) -> str:
    """The text of a completion, whether a string or a list of chat messages."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return completion


def extract_answer(completion) -> str:
    """The first run of digits in the completion (what the checker compares)."""
    match = re.search(r"-?\d+", completion_text(completion))
    return match.group(0) if match else ""


def check(completion, answer: str) -> bool:
    """Exact match: the completion, stripped, is the answer and nothing more."""
    return completion_text(completion).strip() == str(answer).strip()


def exact_match_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion is exactly the answer, else 0.0."""
    return [float(check(c, a)) for c, a in zip(completions, answer)]


def digit_match_reward(completions, answer, **kwargs) -> list[float]:
    """Partial credit: fraction of answer positions right, minus extra length; 1.0 only when exact.

    A smoother signal than exact match for small policies that are often nearly right.
    """
    rewards = []
    for completion, target in zip(completions, answer):
        text = completion_text(completion).strip()
        if text == target:
            rewards.append(1.0)
            continue
        hits = sum(a == b for a, b in zip(text, target))
        extra = max(0, len(text) - len(target))
        rewards.append(max(0.0, 0.8 * hits / len(target) - 0.1 * extra))
    return rewards


def final_answer(completion) -> str:
    """The last run of digits in the completion: its stated final answer ("" when there is none)."""
    numbers = re.findall(r"-?\d+", completion_text(completion))
    return numbers[-1] if numbers else ""


def final_answer_check(completion, answer: str) -> bool:
    """The completion's final number is the answer: "8 + 7 = 15", "The answer is 15." pass;
    an explanation cut off before it states the answer does not."""
    return final_answer(completion) == str(answer).strip()


def final_answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final number is the answer (`final_answer_check`), else 0.0."""
    return [float(final_answer_check(c, a)) for c, a in zip(completions, answer)]


REWARD_FUNCTIONS = Registry("built-in reward function", entries={
    "exact_match": exact_match_reward, "digit_match": digit_match_reward, "final_answer": final_answer_reward,
    # TRL's reward functions, by the names (and the overlong-punishment settings) TRL's grpo.py script accepts
    **{f.__name__: f for f in (trl_rewards.accuracy_reward, trl_rewards.reasoning_accuracy_reward,
                               trl_rewards.think_format_reward)},
    "get_soft_overlong_punishment": trl_rewards.get_soft_overlong_punishment(max_completion_len=1280,
                                                                             soft_punish_cache=256)})
# how each task's held-out accuracy is judged; exact match unless named here
TASK_CHECKERS = Registry("task checker", entries={"quick-add": final_answer_check})


def load_builtin(name: str, split: str = "train"):
    """Datasets by CLI name: "zen", "zen/<layout>", "zen-chat/<layout>", "<task>", "<task>-chat",
    "<task>/preference", "<task>/unpaired_preference", "<task>/triple_preference" (`task_preference_dataset`),
    "reverse/stepwise_supervision",
    "add/stepwise_supervision" (`task_stepwise_dataset`), "vision", "vision/preference", "vision/unpaired_preference"
    (the visual task of `posttrain.tasks.vision`, images in an `images` column)."""
    base, _, layout = name.partition("/")
    if base == "vision":  # the visual task (tasks/vision.py): images and questions for vision-language models
        from posttrain.tasks import vision

        if layout in ("preference", "unpaired_preference"):
            return vision.vision_preference_dataset(split, unpaired=layout == "unpaired_preference")
        if layout:
            raise KeyError(name)
        return vision.vision_dataset(split)
    if base in ("zen", "zen-chat"):
        return zen(layout or "language_modeling", conversational=base == "zen-chat")
    conversational = base.endswith("-chat")
    task = base[: -len("-chat")] if conversational else base
    if task in TASKS:
        if layout in ("preference", "unpaired_preference") and not conversational:
            return task_preference_dataset(task, split=split, unpaired=layout == "unpaired_preference")
        if layout == "triple_preference" and not conversational:
            return task_preference_dataset(task, split=split, reference=True)
        if layout == "stepwise_supervision" and not conversational:
            return task_stepwise_dataset(task, split=split)
        return task_dataset(task, split=split, conversational=conversational)
    raise KeyError(name)


def builtin_names() -> list[str]:
    names = ["zen", "zen-chat"] + [f"zen/{l}" for l in ZEN_LAYOUTS] + [f"zen-chat/{l}" for l in ZEN_LAYOUTS]
    return (names + list(TASKS) + [f"{t}-chat" for t in TASKS]
            + [f"{t}/{layout}" for t in TASKS for layout in ("preference", "unpaired_preference")]
            + [f"{t}/triple_preference" for t in TASKS]
            + [f"{t}/stepwise_supervision" for t in ("reverse", "add")]
            + ["vision", "vision/preference", "vision/unpaired_preference"])
