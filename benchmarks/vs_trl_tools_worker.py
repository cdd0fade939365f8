"""The multi-turn GRPO workload of vs_trl.py (`grpo_tools`): one run by TRL or by posttrain. Started by vs_trl.py.

    python benchmarks/vs_trl_tools_worker.py SPEC.json      # writes the result JSON to SPEC["out"]

Both sides train SmolLM2-135M-Instruct with GRPO and one tool, `calculate`, given as `tools=[calculate]`:
2 prompts x 4 episodes per step, each prompt asking for three products, one tool call per turn, then the
three results (up to 3 tool-calling turns, `max_tool_calling_iterations=3`). The same reward function
scores both (the share of the three results in the episode's last assistant message) and counts, per
step, the episodes and the tool calls (one `tool` message per call, in the episode both libraries pass).

The chat template is posttrain's built-in ChatML one (it renders tools, `<tool_call>{json}</tool_call>`
calls and `tool` turns; SmolLM2's own template drops all three), written into the model folder both
sides load, so both render the same prompt ids. TRL 1.16 parses tool calls out of the sampled text with
the tokenizer's `response_template` (transformers' response parser); it sets one itself only for chat
templates it knows, so the TRL side sets TRL's own Qwen3 one, which reads this `<tool_call>` format.

SmolLM2-135M-Instruct does not call tools by itself: `prepare_model` (run once by vs_trl.py, in the main
environment) fits it on the two episodes first (assistant tokens only) and caches the folder. Both sides
sample at temperature 0.3 (vs_trl.py's config), where the fitted model writes the three calls in every
episode, so both libraries run the same multi-turn work (at temperature 1, a malformed call now and then
ends TRL's episode, whose parser reads it as text, but gets posttrain's an error `tool` turn, and the
tool calls per step differ).

Prefill is counted per step where each library feeds prompt tokens to the model: TRL, the token ids it
passes to `generate` on every turn (`_generate_single_turn`: the first turn's prompts, then each row's
prompt + completion + tool result again); posttrain, the prompt tokens its sampler's `prefill` takes
(once per prompt; the tool turns are fed one token per step into each row's KV cache).
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import sys
from pathlib import Path

from vs_trl_worker import common_args, start, train_and_measure, trainer_classes, write_result

# (prompt, the three expressions): one tool call per expression, then the three results
TASKS = [("Use the calculator, one call at a time, for 123 * 456, then 789 * 12, then 345 * 67. "
          "Then list the three results.", ["123 * 456", "789 * 12", "345 * 67"]),
         ("Use the calculator, one call at a time, for 98 * 76, then 543 * 21, then 67 * 890. "
          "Then list the three results.", ["98 * 76", "543 * 21", "67 * 890"])]
MAX_TOOL_TURNS = 3
# the fit on the two episodes: AdamW, both episodes per step, until the loss is below FIT_LOSS
FIT_STEPS, FIT_LR, FIT_LOSS = 30, 1e-4, 0.01

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """Evaluate an integer arithmetic expression with +, - and *.

    Args:
        expression: The expression, e.g. "12 * 34".
    """
    def walk(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"not an integer expression with + - *: {expression!r}")

    return str(walk(ast.parse(expression.strip(), mode="eval").body))


def answers(expressions: list[str]) -> list[str]:
    return [calculate(e) for e in expressions]


def rows(n: int = 64) -> list[dict]:
    """The training rows: the two prompts, alternating, with their `answers` column."""
    return [{"prompt": [{"role": "user", "content": text}], "answers": answers(exprs)}
            for text, exprs in TASKS] * (n // len(TASKS))


def episode(text: str, expressions: list[str]) -> list[dict]:
    """The conversation the fitted model writes: a call per expression, each followed by its result, then the list."""
    messages = [{"role": "user", "content": text}]
    for expression in expressions:
        call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "calculate", "content": calculate(expression)}]
    results = ", ".join(f"{e} = {r}" for e, r in zip(expressions, answers(expressions)))
    return messages + [{"role": "assistant", "content": f"The results: {results}."}]


def prepare_model(cache: Path, base: str, template: str, lr: float = FIT_LR, steps: int = FIT_STEPS) -> str:
    """A folder with `base` fitted on the two episodes under `template` (cached by their hash): the loss on
    the assistant tokens ({% generation %} spans), AdamW at `lr` until it is below FIT_LOSS (at most `steps`
    steps), seed 0."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = hashlib.sha256(json.dumps([template, TASKS, steps, lr, FIT_LOSS, base]).encode()).hexdigest()[:12]
    folder = cache / f"smollm2-135m-instruct-tools-{key}"
    if (folder / "config.json").exists():
        return str(folder)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = template
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    batch = []
    for text, expressions in TASKS:
        out = tokenizer.apply_chat_template(episode(text, expressions), tools=[calculate], return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids = torch.tensor([out["input_ids"]])
        batch.append((ids, torch.where(torch.tensor([out["assistant_masks"]]).bool(), ids, -100)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        loss = sum(model(input_ids=ids, labels=labels).loss for ids, labels in batch) / len(batch)
        print(f"grpo_tools: fitting the tool caller, step {step + 1}/{steps}: loss {loss.item():.4f}",
              file=sys.stderr, flush=True)
        if loss.item() < FIT_LOSS:
            break
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    tmp = Path(tempfile.mkdtemp(dir=cache))
    model.eval()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(folder)
    return str(folder)


def prepare(cache: Path, base: str) -> tuple[str, str, float]:
    """For vs_trl.py (main environment): (the fitted model folder, the rows' JSON file, mean prompt tokens:
    the two prompts rendered with the tool's schema and the assistant header)."""
    from transformers import AutoTokenizer

    from posttrain.data.chat import CHATML_TEMPLATE

    model = prepare_model(cache, base, CHATML_TEMPLATE)
    data = cache / "tool-prompts.json"
    data.write_text(json.dumps(rows()))
    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = [len(tokenizer.apply_chat_template([{"role": "user", "content": text}], tools=[calculate],
                                                 add_generation_prompt=True, return_dict=True)["input_ids"])
               for text, _ in TASKS]
    return model, str(data), sum(lengths) / len(lengths)


def per_step(calls: list[tuple[int, int]], steps: int) -> list[int]:
    """[(0-based step, count), ...] -> the count of each step, summed."""
    out = [0] * steps
    for step, n in calls:
        if step < steps:
            out[step] += n
    return out


def count_trl_prefill(trainer, record: list) -> None:
    """TRL: every call of `_generate_single_turn` prefills the ids it is given (first turn: the prompts, one row
    per completion; after a tool turn: each continuing row's prompt + completion + tool result)."""
    inner = trainer._generate_single_turn

    def counted(prompt_ids, *args, **kwargs):
        record.append((trainer.state.global_step, sum(len(ids) for ids in prompt_ids)))
        return inner(prompt_ids, *args, **kwargs)

    trainer._generate_single_turn = counted


def count_posttrain_prefill(trainer, record: list) -> None:
    """posttrain: the prompt tokens (mask 1) of each sampler backend's `prefill`; tool turns never reach it."""
    from posttrain.rollout import generate as generate_module

    make = generate_module.default_backend

    def counted_backend(*args, **kwargs):
        backend = make(*args, **kwargs)
        prefill = backend.prefill

        def counted(prompt_ids, prompt_mask, positions):
            record.append((trainer.state.global_step, int(prompt_mask.sum())))
            return prefill(prompt_ids, prompt_mask, positions)

        backend.prefill = counted
        return backend

    generate_module.default_backend = counted_backend


def main():
    spec = start()
    from datasets import Dataset
    from transformers import AutoTokenizer

    side, cfg = spec["side"], spec["config"]
    Config, Trainer = trainer_classes(side, "grpo")
    args = Config(**common_args(spec), **cfg)
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])  # its chat template: the shared one (prepare_model)
    if side == "trl":
        from trl.chat_template_utils import qwen3_template

        tokenizer.response_template = qwen3_template

    samples, tool_calls = [], []  # per reward call: (step, episodes), (step, tool calls)

    def answer_reward(completions, answers, **kwargs):
        """The share of the three results in the episode's last assistant message, plus 0.01 x the episode's
        place in the batch (both libraries pass them prompt-major): episodes of one prompt that agree still get
        advantages that are not all 0, the same on both sides, so every step trains on something."""
        step = trainer.state.global_step
        samples.append((step, len(completions)))
        tool_calls.append((step, sum(m["role"] == "tool" for c in completions for m in c)))
        last = [next((m.get("content") or "" for m in reversed(c) if m["role"] == "assistant"), "")
                for c in completions]
        return [sum(a in text for a in expected) / len(expected) + 0.01 * i
                for i, (text, expected) in enumerate(zip(last, answers))]

    trainer = Trainer(model=spec["model"], reward_funcs=answer_reward, args=args,
                      train_dataset=Dataset.from_list(json.load(open(spec["data"]))), processing_class=tokenizer,
                      tools=[calculate])
    prefill: list[tuple[int, int]] = []
    (count_trl_prefill if side == "trl" else count_posttrain_prefill)(trainer, prefill)
    result = train_and_measure(trainer, spec)
    steps = len(result["step_end"])
    write_result(spec, {**result, "samples": per_step(samples, steps), "tool_calls": per_step(tool_calls, steps),
                        "prefill_tokens": per_step(prefill, steps)})


if __name__ == "__main__":
    main()
