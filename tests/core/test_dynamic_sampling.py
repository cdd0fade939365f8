"""DAPO's dynamic sampling (core/dynamic_sampling.py) and overlong reward shaping (the registered `overlong` step of
core/shaping.py), against numbers worked by hand, in float64."""

import pytest
import torch

from posttrain.core.dynamic_sampling import informative_groups, kept_rows
from posttrain.core.shaping import SHAPING_STEPS, RewardShaping, overlong_penalty, shape_rewards

D = torch.float64


# ---------------------------------------------------------------- dynamic sampling

def test_informative_groups_by_hand():
    scores = torch.tensor([1.0, 1.0, 1.0,  # all equal: dropped
                           0.0, 1.0, 0.0,
                           0.0, 0.0, 0.0,  # all equal: dropped
                           2.0, 2.0, 2.0 + 1e-12], dtype=D)  # a tiny real difference still orders the samples
    assert informative_groups(scores, 3).tolist() == [False, True, False, True]
    assert informative_groups(torch.tensor([0.5, float("nan")]), 2).tolist() == [True]
    with pytest.raises(ValueError, match=r"whole groups of num_generations=4"):
        informative_groups(torch.zeros(6), 4)


def test_kept_rows_takes_the_first_informative_groups_in_order():
    informative = torch.tensor([False, True, False, True, True])  # groups of 2 rows
    assert kept_rows(informative, 2, 2).tolist() == [2, 3, 6, 7]
    assert kept_rows(informative, 2, 3).tolist() == [2, 3, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="3 informative groups of 5; 4 are needed"):
        kept_rows(informative, 2, 4)


# ---------------------------------------------------------------- overlong reward shaping

def test_overlong_penalty_by_hand():
    # L = 10, buffer 4: no penalty up to 6 tokens, then -1/4 per token, -factor at 10
    lengths = torch.tensor([3, 6, 7, 8, 10])
    penalty = overlong_penalty(torch.zeros(5, dtype=D), lengths, overlong_buffer_len=4, max_completion_length=10)
    assert penalty.dtype == D
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])
    half = overlong_penalty(torch.zeros(5, dtype=D), lengths, overlong_buffer_len=4, max_completion_length=10,
                            overlong_penalty_factor=0.5)
    assert half.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5])


def test_overlong_is_registered_with_its_switch_and_options():
    step = SHAPING_STEPS["overlong"]
    assert step.switch == "overlong_buffer_len"
    assert set(step.options) == {"overlong_buffer_len", "max_completion_length", "overlong_penalty_factor"}
    assert SHAPING_STEPS.options["overlong_buffer_len"].default is None  # off unless asked for


def test_overlong_comes_after_the_missing_eos_penalty_and_before_normalising():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=D)
    lengths = torch.tensor([2, 5, 8, 8])
    truncated = torch.tensor([False, False, False, True])
    mask = torch.ones(4, 8)
    steps = (("overlong", {"overlong_buffer_len": 4, "max_completion_length": 8, "overlong_penalty_factor": 1.0}),)
    shaping = RewardShaping(missing_eos_penalty=0.5, normalize=True, steps=steps)
    out = shape_rewards(scores, mask, shaping, truncated=truncated, lengths=lengths)
    # penalties by hand: 0, -0.25, -1, -1; the missing EOS: -0.5 on the last
    penalized = [1.0, -0.25, 0.0, -1.5]
    assert out.penalized_scores.tolist() == pytest.approx(penalized)
    assert out.terms["overlong"].tolist() == pytest.approx([0.0, -0.25, -1.0, -1.0])
    mean = sum(penalized) / 4
    std = (sum((v - mean) ** 2 for v in penalized) / 3) ** 0.5
    assert out.scores.tolist() == pytest.approx([(v - mean) / (std + 1e-8) for v in penalized])


def test_a_step_needs_the_lengths():
    steps = (("overlong", {"overlong_buffer_len": 2, "max_completion_length": 4}),)
    with pytest.raises(ValueError, match=r"'overlong' reward shaping step needs lengths of shape \(2,\)"):
        shape_rewards(torch.zeros(2), torch.ones(2, 4), RewardShaping(steps=steps))
    # without steps, nothing changes and no term is reported
    out = shape_rewards(torch.tensor([1.0, 2.0]), torch.ones(2, 4), RewardShaping())
    assert out.terms == {} and out.scores.tolist() == [1.0, 2.0]


def test_overlong_agrees_with_trls_reward_function_form():
    """The reward function TRL ships (`get_soft_overlong_punishment`, here in tasks/rewards.py) is the same
    penalty at factor 1 for completions within max_completion_length."""
    from posttrain.tasks.rewards import get_soft_overlong_punishment

    lengths = list(range(1, 13))
    trl_form = get_soft_overlong_punishment(max_completion_len=12, soft_punish_cache=5)([[7] * n for n in lengths])
    ours = overlong_penalty(torch.zeros(12, dtype=D), torch.tensor(lengths), overlong_buffer_len=5,
                            max_completion_length=12)
    assert ours.tolist() == pytest.approx(trl_form)
