"""Reward numbers stopped at the door: non-finite weights, rewards too large for float32 statistics,
user-given scores (`check_scores`), functions that abstain on a whole batch."""

import math
import warnings

import numpy as np
import pytest
import torch

from posttrain.rollout.rewards import REWARD_LIMIT, RewardError, RewardScorer, check_scores

PROMPTS = ["a", "b", "c"]
COMPLETIONS = [" x", " yy", " z"]
IDS = [[1], [2, 3], [4]]


def score(funcs, weights=None):
    return RewardScorer(funcs, weights)(PROMPTS, COMPLETIONS, IDS, {})


def length_reward(completions, **kw):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("weight", [math.nan, math.inf, -math.inf, "1"])
def test_non_finite_weight_is_refused(weight):
    with pytest.raises(ValueError, match=r"reward_weights\[1\] \(for 'length_reward'\) .* finite number"):
        RewardScorer([length_reward, length_reward], [1.0, weight])


@pytest.mark.parametrize("value", [1e30, -1e30, 2 * REWARD_LIMIT])
def test_reward_too_large_for_float32_statistics_is_refused(value):
    def huge(completions, **kw):
        return [0.0, value, 1.0]

    with pytest.raises(RewardError, match=r"'huge' returned .* for sample 1; rewards must lie within"):
        score([huge])


def test_weight_times_reward_overflow_is_refused():
    with pytest.raises(RewardError, match="weighted sum of the rewards returned"):
        score([length_reward], [1e15])


def test_largest_allowed_reward_gives_nonzero_advantages():
    def big(completions, **kw):
        return [REWARD_LIMIT, -REWARD_LIMIT, 0.0]

    _, total = score([big])
    centred = total - total.mean()
    std = total.std()
    assert torch.isfinite(std) and (centred / std).abs().max() > 0.5  # float32 stats still work


def test_check_scores_accepts_the_usual_forms():
    want = [1.0, -2.0, 0.5]
    for given in ([1.0, -2, 0.5], [torch.tensor(1.0), torch.tensor([-2.0]), torch.tensor(0.5)],
                  torch.tensor(want), np.array(want)):
        out = check_scores(given)
        assert out.dtype == torch.float32 and out.tolist() == want


@pytest.mark.parametrize("bad, what", [(math.nan, "NaN"), (math.inf, "inf"), (None, "a non-number value None"),
                                       ("high", "a non-number value 'high'"), (1e20, "1e\\+20")])
def test_check_scores_names_source_and_sample(bad, what):
    with pytest.raises(RewardError, match=f"step scores returned {what}.* for sample 2"):
        check_scores([0.0, torch.tensor(1.0), bad], source="step scores")
    if bad is not None and not isinstance(bad, str):
        with pytest.raises(RewardError, match=f"returned {what}.* for sample 1"):
            check_scores(torch.tensor([0.0, bad]))


def test_check_scores_refuses_a_string():
    with pytest.raises(RewardError, match="a str; it must be a list"):
        check_scores("0.5")


def test_abstaining_on_a_whole_batch_warns_once_per_function():
    calls = []

    def not_applicable(completions, **kw):
        calls.append(1)
        return [None] * len(completions)

    scorer = RewardScorer([length_reward, not_applicable])
    with pytest.warns(UserWarning, match="'not_applicable' returned None for every sample of a batch of 3"):
        _, total = scorer(PROMPTS, COMPLETIONS, IDS, {})
    assert total.tolist() == [2.0, 3.0, 2.0]  # the abstaining function adds nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second batch does not warn again
        scorer(PROMPTS, COMPLETIONS, IDS, {})
    assert len(calls) == 2


def test_sample_no_function_scores_warns():
    def first_only(completions, **kw):
        return [1.0] + [None] * (len(completions) - 1)

    def second_only(completions, **kw):
        return [None, 1.0, None]

    with pytest.warns(UserWarning, match=r"every reward function .* returned None for sample\(s\) \[2\]"):
        _, total = score([first_only, second_only])
    assert total.tolist() == [1.0, 1.0, 0.0]
