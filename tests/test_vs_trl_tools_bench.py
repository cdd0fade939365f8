"""The multi-turn workload of the TRL comparison (benchmarks/vs_trl_tools_worker.py, `grpo_tools`): its tool,
its chat template's tool rendering, the prefill counts and the same-work check. Runs no benchmark, needs no TRL."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from posttrain.data.chat import CHATML_TEMPLATE
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.rollout import generate as generate_module
from posttrain.rollout.generate import SamplingConfig, generate
from posttrain.rollout.tools import parse_tool_calls

BENCH = Path(__file__).parents[1] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def worker():
    sys.path.insert(0, str(BENCH))  # the worker imports vs_trl_worker as its neighbour, as when run as a script
    try:
        yield _load("vs_trl_tools_worker")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def vs_trl():
    return _load("vs_trl")


def test_calculate_evaluates_integer_products_and_refuses_the_rest(worker):
    assert worker.calculate("123 * 456") == "56088"
    assert worker.calculate(" 7 - 2 * 3 ") == "1"
    for bad in ["__import__('os')", "2 ** 10", "1.5 * 2", "x * 2"]:
        with pytest.raises(ValueError, match="not an integer expression"):
            worker.calculate(bad)
    assert worker.rows(4)[1]["answers"] == ["7448", "11403", "59630"]  # 98 * 76, 543 * 21, 67 * 890


def test_the_shared_template_renders_the_episode_and_trains_only_the_assistant(worker):
    """The episode the model is fitted on, under the template both sides load: each call a `<tool_call>` block
    that parses back to the call, each result a `tool` turn; the assistant mask covers the calls and the
    answer, never a tool result."""
    tok = load_tokenizer("posttrain/tiny-qwen2")
    tok.chat_template = CHATML_TEMPLATE
    text, expressions = worker.TASKS[0]
    messages = worker.episode(text, expressions)
    assert [m["role"] for m in messages] == ["user"] + ["assistant", "tool"] * 3 + ["assistant"]
    rendered = tok.apply_chat_template(messages, tools=[worker.calculate], tokenize=False)
    assert '"name": "calculate"' in rendered.split("<|im_start|>user")[0]  # the schema in the system turn
    turns = rendered.split("<|im_start|>assistant\n")[1:]
    assert len(turns) == 4
    for turn, expression in zip(turns, expressions):
        calls, errors = parse_tool_calls(turn)
        assert errors == [] and calls == [{"type": "function", "function": {"name": "calculate",
                                                                              "arguments": {"expression": expression}}}]
        assert f"<|im_start|>tool\n{worker.calculate(expression)}<|im_end|>" in turn
    assert turns[-1] == "The results: 123 * 456 = 56088, 789 * 12 = 9468, 345 * 67 = 23115.<|im_end|>\n"
    out = tok.apply_chat_template(messages, tools=[worker.calculate], return_dict=True,
                                  return_assistant_tokens_mask=True)
    trained = tok.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    assert trained.count("<tool_call>") == 3 and "The results:" in trained
    assert "<|im_start|>" not in trained  # no turn header, so no tool turn
    assert trained.count("56088") == 1  # the first result: in the answer, not from its tool turn


def test_steps_sum_their_counts(worker):
    assert worker.per_step([(0, 8), (0, 3), (2, 5), (7, 1)], 3) == [11, 0, 5]


def test_trl_prefill_counts_every_id_passed_to_generate(worker):
    """TRL re-prefills on every turn: each call's ids count, in the step it happens."""
    passed = []
    fake = SimpleNamespace(state=SimpleNamespace(global_step=0),
                           _generate_single_turn=lambda ids, *a, **k: passed.append(ids) or "out")
    record = []
    worker.count_trl_prefill(fake, record)
    assert fake._generate_single_turn([[1, 2, 3], [4, 5]], None, {}, num_generations=1) == "out"
    fake.state.global_step = 1
    fake._generate_single_turn([[1] * 7], None, {}, num_generations=1)
    assert passed == [[[1, 2, 3], [4, 5]], [[1] * 7]]
    assert worker.per_step(record, 2) == [5, 7]


def test_posttrain_prefill_counts_each_prompt_once_whatever_the_tool_turns(worker, monkeypatch):
    """posttrain's count: the prompt tokens its sampler prefills, once per prompt (not per completion), and
    nothing more for the tool turns fed into the rows' KV caches."""
    monkeypatch.setattr(generate_module, "default_backend", generate_module.default_backend)  # restored after
    tok = load_tokenizer("posttrain/tiny-qwen2")
    model = load_causal_lm("posttrain/tiny-qwen2")
    record = []
    worker.count_posttrain_prefill(SimpleNamespace(state=SimpleNamespace(global_step=0)), record)
    prompts = [tok("add 12 7 =")["input_ids"], tok("a b")["input_ids"]]
    fed, seen = [5, 6, 7, 8], set()

    def continue_turn(rows, tokens):  # one fed turn after each row's first turn, then the row ends
        out = [None if i in seen else fed for i in rows]
        seen.update(rows)
        return out

    stops = tuple(range(10, tok.vocab_size, 4))  # a quarter of the vocabulary ends a turn: turns end early
    rollout = generate(model, prompts, SamplingConfig(max_new_tokens=40, num_generations=4, stop_token_ids=stops),
                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                       generator=torch.Generator().manual_seed(0), continue_turn=continue_turn)
    assert rollout.tool_mask.sum() >= len(fed)  # some row had a tool turn fed
    assert record == [(0, sum(len(p) for p in prompts))]  # one prefill of the 2 prompts, not of the 8 rows


def _summary(tool_calls, prefill, samples=(8, 8)):
    return {"precision": "torch.float32", "samples_per_step": 8, "items_per_step": 8, "completion_len": 40.0,
            "tool_calls": list(tool_calls), "prefill": list(prefill), "samples": list(samples)}


def test_same_work_needs_the_same_tool_calls_in_every_step_and_shows_the_prefill(vs_trl):
    trl, ours = _summary([24, 24], [3800, 3810]), _summary([24, 24], [300, 300])
    ok, note = vs_trl.same_work("grpo_tools", trl, ours)
    assert ok
    assert "tool calls per step [24, 24] / [24, 24]" in note and "prefilled per step [3800, 3810] / [300, 300]" in note
    assert not vs_trl.same_work("grpo_tools", trl, _summary([24, 23], [300, 300]))[0]
    raw = {"train_begin": 0.0, "step_end": [2.0, 3.0], "train_seconds": 3.0, "batch_size": 8, "sft_tokens": [],
           "samples": [8, 8], "logs": [{"loss": 0.1}], "peak_rss_mib": 1.0, "versions": {}, "dtype": "torch.float32",
           "threads": 2, "tool_calls": [24, 22], "prefill_tokens": [3800, 3700]}
    s = vs_trl.summarise(raw, "samples")
    assert (s["tool_calls"], s["prefill"]) == ([24, 22], [3800, 3700])


def test_grpo_tools_flops_take_the_tool_prompt_length(vs_trl):
    model = (1000, 100, 2, 8)
    plain = vs_trl.flops_per_item("grpo", {"prompt/tokens": 10.0}, model, 5.0)
    tools = vs_trl.flops_per_item("grpo_tools", {"prompt/tokens": 10.0, "tool-prompts/tokens": 10.0}, model, 5.0)
    longer = vs_trl.flops_per_item("grpo_tools", {"prompt/tokens": 10.0, "tool-prompts/tokens": 20.0}, model, 5.0)
    assert tools == plain and longer > tools
