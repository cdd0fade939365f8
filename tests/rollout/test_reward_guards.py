"""A reward function that hangs stops training with an error naming it; one that changes its arguments changes
nothing the next function sees."""

import asyncio
import threading
import time

import pytest

from posttrain.rollout.rewards import RewardError, RewardScorer

PROMPTS = ["reverse 12 =", "reverse 345 ="]
COMPLETIONS = [" 21", " 543"]
IDS = [[1, 2], [3, 4, 5]]
COLUMNS = {"answer": ["21", "543"], "meta": [{"k": [1]}, {"k": [2]}]}


def test_a_hanging_reward_function_is_named_after_the_timeout():
    release = threading.Event()

    def stuck(completions, **kwargs):
        release.wait(30)
        return [1.0] * len(completions)

    start = time.monotonic()
    with pytest.raises(RewardError, match=r"reward function 'stuck' did not return within 0.5 s \(reward_timeout\)"):
        RewardScorer([stuck], timeout=0.5)(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert time.monotonic() - start < 10
    release.set()


def test_a_hanging_async_reward_function_is_named_too():
    async def slow(completions, **kwargs):
        await asyncio.sleep(30)
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match="reward function 'slow' did not return within 0.5 s"):
        RewardScorer([slow], timeout=0.5)(PROMPTS, COMPLETIONS, IDS, COLUMNS)


def test_errors_still_name_the_function_under_a_timeout():
    def broken(completions, **kwargs):
        raise KeyError("answer")

    with pytest.raises(RewardError, match="reward function 'broken' raised KeyError"):
        RewardScorer([broken], timeout=5)(PROMPTS, COMPLETIONS, IDS, COLUMNS)


def test_each_function_gets_its_own_copies_of_prompts_completions_and_columns():
    seen = []

    def vandal(prompts, completions, completion_ids, meta, **kwargs):
        completions[0] = "changed"
        prompts.clear()
        meta[0]["k"].append(7)
        return [0.0] * 2

    def reader(prompts, completions, completion_ids, meta, **kwargs):
        seen.append((list(prompts), list(completions), [list(c) for c in completion_ids], meta))
        return [1.0] * 2

    completions = list(COMPLETIONS)
    RewardScorer([vandal, reader], timeout=5)(PROMPTS, completions, IDS, COLUMNS)
    assert seen == [(PROMPTS, COMPLETIONS, IDS, [{"k": [1]}, {"k": [2]}])]
    assert completions == COMPLETIONS and IDS == [[1, 2], [3, 4, 5]] and COLUMNS["meta"][0] == {"k": [1]}


def test_a_function_that_needs_the_main_thread_still_runs():
    import signal

    def with_alarm(completions, **kwargs):  # what math_verify's signal-based timeouts do
        signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))
        return [2.0] * len(completions)

    scorer = RewardScorer([with_alarm], timeout=5)
    with pytest.warns(UserWarning, match="needs the main thread"):
        per, _ = scorer(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert per[:, 0].tolist() == [2.0, 2.0]
    assert scorer(PROMPTS, COMPLETIONS, IDS, COLUMNS)[0][:, 0].tolist() == [2.0, 2.0]  # once said, called directly


def test_async_and_sync_functions_and_reward_models_score_at_the_same_time():
    """Four scorers each wait at a barrier for the others (an async function, two sync ones, a reward model):
    run one after the other, the barrier breaks and the scorer raises instead."""
    import torch

    barrier = threading.Barrier(4, timeout=10)

    async def judge_async(completions, **kwargs):  # awaited in the scorer's event-loop thread
        barrier.wait()
        return [1.0] * len(completions)

    def judge_a(completions, **kwargs):
        barrier.wait()
        return [2.0] * len(completions)

    def judge_b(completions, **kwargs):
        barrier.wait()
        return [4.0] * len(completions)

    from posttrain.models.loading import load_sequence_classifier

    model = load_sequence_classifier("posttrain/tiny-qwen2-seqcls")  # scored in the calling thread, meanwhile
    forward = model.forward

    def waiting_forward(*args, **kwargs):
        barrier.wait()
        out = forward(*args, **kwargs)
        out.logits = torch.full_like(out.logits, 8.0)
        return out

    model.forward = waiting_forward
    scorer = RewardScorer([judge_async, judge_a, judge_b, model], timeout=20)
    per, total = scorer(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert per.tolist() == [[1.0, 2.0, 4.0, 8.0]] * 2 and total.tolist() == [15.0, 15.0]
