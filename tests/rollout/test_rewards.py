"""RewardScorer: argument routing by signature, weights, abstention, async concurrency,
error messages, reward models (object and built-in string)."""

import asyncio
import functools
import math
import time

import pytest
import torch

from posttrain.rollout.rewards import RewardError, RewardScorer, resolve_reward_func
from posttrain.tasks.builtin import digit_match_reward, exact_match_reward

PROMPTS = ["reverse 12 =", "reverse 345 =", "add 1 2 ="]
COMPLETIONS = [" 21", " 543x", " 4"]
IDS = [[1, 2], [3, 4, 5], [6]]
COLUMNS = {"answer": ["21", "543", "3"], "level": [1, 2, 3]}


def score(funcs, weights=None, completions=COMPLETIONS, columns=COLUMNS, **kw):
    return RewardScorer(funcs, weights, **kw)(PROMPTS, completions, IDS, columns)


def reward_len(prompts, completions):
    return [float(len(c)) for c in completions]


def level_reward(completions, **kwargs):
    return [float(x) for x in kwargs["level"]]


def test_arguments_follow_the_signature():
    seen = {}

    def only_ids(completion_ids):
        seen["ids"] = completion_ids
        return [float(len(i)) for i in completion_ids]

    def keyword_only(*, completions, answer, prompts=None):
        seen["kw"] = (completions, answer, prompts)
        return [0.0] * len(completions)

    def scaled(texts, level=None, scale=2.0):  # one required positional, unknown name: the completions
        return [scale * len(t) + lv for t, lv in zip(texts, level)]

    def positional_only(completions, /):
        return [1.0] * len(completions)

    per, total = score([reward_len, level_reward, only_ids, keyword_only, lambda texts: [1.0] * len(texts),
                        scaled, positional_only], weights=[1, 1, 1, 1, 1, 0, 0])
    assert per[:, 5].tolist() == [7.0, 12.0, 7.0] and per[:, 6].tolist() == [1.0] * 3
    assert per.dtype == torch.float32 and per.shape == (3, 7)
    assert per[:, 0].tolist() == [3.0, 5.0, 2.0]  # reward_len(prompts, completions)
    assert per[:, 1].tolist() == [1.0, 2.0, 3.0]  # **kwargs receives every column
    assert per[:, 2].tolist() == [2.0, 3.0, 1.0] and seen["ids"] is IDS
    assert seen["kw"] == (COMPLETIONS, COLUMNS["answer"], PROMPTS)
    assert per[:, 4].tolist() == [1.0, 1.0, 1.0]  # one positional parameter: called with the completions
    assert total.tolist() == pytest.approx([7.0, 11.0, 7.0])


def test_builtin_and_module_strings():
    per, _ = score(["exact_match", "digit_match", "posttrain.tasks.builtin:exact_match_reward"])
    assert per[:, 0].tolist() == exact_match_reward(COMPLETIONS, COLUMNS["answer"])
    assert per[:, 1].tolist() == pytest.approx(digit_match_reward(COMPLETIONS, COLUMNS["answer"]))
    assert per[:, 0].tolist() == per[:, 2].tolist() == [1.0, 0.0, 0.0]
    assert resolve_reward_func("exact_match") is exact_match_reward
    assert RewardScorer(["exact_match", functools.partial(level_reward)]).names == ["exact_match_reward",
                                                                                    "level_reward"]
    with pytest.raises(ValueError, match="no attribute"):
        resolve_reward_func("posttrain.tasks.builtin:nope")


def test_weights_and_abstention():
    def sometimes(completions, **kw):
        return [None, 2.0, None]

    def never(completions, **kw):
        return [None, None, None]

    per, total = score([reward_len, sometimes, never], weights=[0.5, -2.0, 10.0])
    assert per[:, 1].isnan().tolist() == [True, False, True] and per[:, 2].isnan().all()
    # total = nansum(weight * value): abstentions are skipped, not counted as 0 * weight
    assert total.tolist() == pytest.approx([1.5, 2.5 - 4.0, 1.0])
    _, total = score([never])
    assert total.tolist() == [0.0, 0.0, 0.0]  # every function abstained: total 0
    with pytest.raises(ValueError, match="reward_weights has 1 values but there are 2"):
        RewardScorer([reward_len, never], [1.0])


def test_outputs_of_other_types():
    per, _ = score([lambda completions, **k: torch.tensor([1, 2, 3]), lambda completions, **k: (True, False, 1)])
    assert per.tolist() == [[1.0, 1.0], [2.0, 0.0], [3.0, 1.0]]


def test_async_functions_run_concurrently_with_each_other_and_the_sync_ones():
    async def slow_a(completions, **kwargs):
        await asyncio.sleep(0.2)
        return [1.0] * len(completions)

    async def slow_b(prompts, completions):
        await asyncio.sleep(0.2)
        return [2.0] * len(completions)

    def slow_sync(completions):
        time.sleep(0.2)
        return [3.0] * len(completions)

    scorer = RewardScorer([slow_a, slow_b])
    start = time.perf_counter()
    per, total = scorer(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert time.perf_counter() - start < 0.35
    assert per.tolist() == [[1.0, 2.0]] * 3 and total.tolist() == [3.0] * 3
    scorer = RewardScorer([slow_a, slow_b, slow_sync])
    start = time.perf_counter()
    per, _ = scorer(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert time.perf_counter() - start < 0.35
    assert per[:, 2].tolist() == [3.0] * 3


def test_async_works_inside_a_running_event_loop():
    async def a(completions):
        await asyncio.sleep(0)
        return [1.0] * len(completions)

    async def main():  # e.g. a notebook: the scorer must not call asyncio.run on this thread
        return score([a, reward_len])

    per, _ = asyncio.run(main())
    assert per[:, 0].tolist() == [1.0] * 3


def test_error_names_the_function_and_chains_the_cause():
    def broken(completions, **kw):
        raise KeyError("boom")

    async def broken_async(completions, **kw):
        raise ZeroDivisionError("zero")

    with pytest.raises(RewardError, match="'broken' raised KeyError") as info:
        score([reward_len, broken])
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(RewardError, match="'broken_async' raised ZeroDivisionError") as info:
        score([broken_async])
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_bad_outputs_name_the_function_and_sample():
    def nan_reward(completions, **kw):
        return [0.0, math.nan, 1.0]

    def short_reward(completions, **kw):
        return [0.0, 1.0]

    def text_reward(completions, **kw):
        return [0.0, 1.0, "high"]

    def scalar_reward(completions, **kw):
        return 1.0

    with pytest.raises(RewardError, match="'nan_reward' returned NaN for sample 1"):
        score([nan_reward])
    with pytest.raises(RewardError, match="'short_reward' returned 2 values, expected 3"):
        score([short_reward])
    with pytest.raises(RewardError, match="'text_reward' returned a non-number value 'high' .* sample 2"):
        score([text_reward])
    with pytest.raises(RewardError, match="'scalar_reward' returned a float"):
        score([scalar_reward])


def test_missing_argument_and_bad_columns():
    def needs_solution(completions, solution):
        return [0.0] * len(completions)

    def two_unknown(texts, solution):
        return [0.0] * len(texts)

    with pytest.raises(RewardError, match=r"'needs_solution' needs argument\(s\) \['solution'\]"):
        score([needs_solution])
    with pytest.raises(RewardError, match=r"'two_unknown' needs argument\(s\) \['texts', 'solution'\]"):
        score([two_unknown])
    with pytest.raises(ValueError, match="'answer' has 2 values but there are 3 completions"):
        score([reward_len], columns={"answer": ["1", "2"]})


def test_conversational_completions_pass_through():
    chat_prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    chat = [[{"role": "assistant", "content": c.strip()}] for c in COMPLETIONS]
    seen = {}

    def f(prompts, completions, answer):
        seen["args"] = (prompts, completions)
        return exact_match_reward(completions, answer)

    per, _ = RewardScorer(f)(chat_prompts, chat, IDS, {"answer": COLUMNS["answer"]})
    assert seen["args"] == (chat_prompts, chat) and per[:, 0].tolist() == [1.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def reward_model():
    from posttrain.models.loading import load_sequence_classifier

    return load_sequence_classifier("posttrain/tiny-qwen2-seqcls")


def test_reward_model_object_and_string(reward_model):
    from posttrain.models.loading import load_tokenizer

    tok = load_tokenizer("posttrain/tiny-qwen2-seqcls")
    reward_model.train()
    scorer = RewardScorer([reward_model, "posttrain/tiny-qwen2-seqcls", reward_len], reward_weights=[1.0, 1.0, 0.0],
                          reward_processing_classes=[tok, None, None])
    assert scorer.names == ["tiny-qwen2-seqcls", "tiny-qwen2-seqcls", "reward_len"]
    per, total = scorer(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert reward_model.training  # eval during scoring, mode restored
    # independent reference: one text at a time, no padding
    with torch.no_grad():
        reward_model.eval()
        ref = [reward_model(**tok(p + c, return_tensors="pt")).logits[0, 0].item() for p, c in zip(PROMPTS, COMPLETIONS)]
    assert per[:, 0].tolist() == pytest.approx(ref, abs=1e-5)
    assert per[:, 1].tolist() == pytest.approx(ref, abs=1e-5)  # same weights loaded from the string
    assert total.tolist() == pytest.approx([2 * r for r in ref], abs=1e-5)


def test_reward_model_renders_conversations_with_the_chat_template(reward_model):
    from posttrain.models.loading import load_tokenizer

    tok = load_tokenizer("posttrain/tiny-qwen2-seqcls")
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    chats = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    per, _ = RewardScorer(reward_model, reward_processing_classes=tok)(prompts, chats, IDS, {})
    with torch.no_grad():
        ref = []
        for p, c in zip(prompts, chats):
            text = tok.apply_chat_template(p + c, tokenize=False)
            ref.append(reward_model(**tok(text, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item())
    assert per[:, 0].tolist() == pytest.approx(ref, abs=1e-5)
