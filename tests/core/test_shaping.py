import dataclasses
import itertools
import math

import pytest
import torch

from posttrain.core.shaping import RewardShaping, clip_scores, shape_rewards

# --- the float64 reference, written as plain Python loops over lists -------------------------


def ref_kl(lp, rl, kind):
    if kind == "k1":
        return lp - rl
    if kind == "k2":
        return 0.5 * (lp - rl) ** 2
    if kind == "abs":
        return abs(lp - rl)
    log_r = min(max(rl - lp, -20.0), 20.0)  # k3
    return math.exp(log_r) - log_r - 1


def ref_unit_scale(values):
    """values / std keeping the mean: (v - m) / sqrt(var + 1e-8) + m, var with n - 1"""
    n = len(values)
    m = sum(values) / n
    var = sum((v - m) ** 2 for v in values) / max(n - 1, 1)
    return [(v - m) / math.sqrt(var + 1e-8) + m for v in values]


def ref_shape(scores, mask, truncated, logp, ref_logp, s: RewardShaping):
    """(scores, token_rewards or None, penalized scores), each step on its own, in the documented order."""
    B, T = len(scores), len(mask[0])
    x = list(scores)
    if s.missing_eos_penalty is not None:
        x = [v - s.missing_eos_penalty * (1.0 if t else 0.0) for v, t in zip(x, truncated)]
    penalized = list(x)
    if s.normalize:
        m = sum(x) / B
        std = math.sqrt(sum((v - m) ** 2 for v in x) / (B - 1))
        x = [(v - m) / (std + 1e-8) for v in x]
    if s.clip_range is not None:
        low, high = (-s.clip_range, s.clip_range) if isinstance(s.clip_range, (int, float)) else s.clip_range
        x = [min(max(v, low), high) for v in x]
    tokens = None
    if s.kl_in_reward and s.kl_coef > 0:
        tokens = [[-s.kl_coef * ref_kl(logp[b][t], ref_logp[b][t], s.kl_estimator) if mask[b][t] else 0.0
                   for t in range(T)] for b in range(B)]
        if not (s.per_token and s.token_level_kl):
            x, tokens = [x[b] + sum(tokens[b]) for b in range(B)], None
    if s.whiten and s.per_token:
        rewards = [[tokens[b][t] if tokens else 0.0 for t in range(T)] for b in range(B)]
        for b in range(B):
            on = [t for t in range(T) if mask[b][t]]
            if on:
                rewards[b][on[-1]] += x[b]
        cells = [(b, t) for b in range(B) for t in range(T) if mask[b][t]]
        scaled = ref_unit_scale([rewards[b][t] for b, t in cells])
        tokens = [[0.0] * T for _ in range(B)]
        for (b, t), v in zip(cells, scaled):
            tokens[b][t] = v
        x = [0.0] * B
    elif s.whiten:
        x = ref_unit_scale(x)
    return x, tokens, penalized


# --- a batch with holes in the mask, an all-masked row, truncated rows and NaN off the mask ----

B, T = 6, 5


def batch(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(B, generator=g) * 3).to(dtype)
    mask = torch.tensor([[1, 1, 1, 0, 0],
                         [1, 1, 1, 1, 1],
                         [1, 0, 1, 1, 0],  # a hole: a tool result inside the completion
                         [0, 0, 0, 0, 0],  # a row left out entirely (mask_truncated_completions)
                         [1, 1, 0, 0, 0],
                         [1, 1, 1, 1, 0]])
    truncated = torch.tensor([False, True, False, True, False, True])
    logp = (-torch.rand(B, T, generator=g) * 3).to(dtype)
    ref_logp = (-torch.rand(B, T, generator=g) * 3).to(dtype)
    logp[~mask.bool()] = float("nan")  # padding may hold anything; it must not leak in
    return scores, mask, truncated, logp, ref_logp


def as_lists(scores, mask, truncated, logp, ref_logp):
    return scores.tolist(), mask.tolist(), truncated.tolist(), logp.tolist(), ref_logp.tolist()


def check_against_reference(shaping, dtype=torch.float64, atol=1e-10):
    scores, mask, truncated, logp, ref_logp = batch(dtype)
    out = shape_rewards(scores, mask, shaping, truncated=truncated, logp=logp, ref_logp=ref_logp)
    want_scores, want_tokens, want_penalized = ref_shape(*as_lists(scores, mask, truncated, logp, ref_logp), shaping)
    torch.testing.assert_close(out.scores, torch.tensor(want_scores, dtype=dtype), atol=atol, rtol=0)
    torch.testing.assert_close(out.penalized_scores, torch.tensor(want_penalized, dtype=dtype), atol=atol, rtol=0)
    if want_tokens is None:
        assert out.token_rewards is None
    else:
        torch.testing.assert_close(out.token_rewards, torch.tensor(want_tokens, dtype=dtype), atol=atol, rtol=0)
    return out


# --- every switch, alone and in every combination ------------------------------------------

ALONE = {
    "missing_eos_penalty": dict(missing_eos_penalty=1.5),
    "normalize": dict(normalize=True),
    "clip_bound": dict(clip_range=1.0),
    "clip_pair": dict(clip_range=(-0.5, 2.0)),
    "sequence_kl": dict(kl_in_reward=True, kl_coef=0.3),
    "token_level_kl_without_per_token_estimator": dict(kl_in_reward=True, kl_coef=0.3, token_level_kl=True),
    "per_token_estimator_sequence_kl": dict(kl_in_reward=True, kl_coef=0.3, per_token=True),
    "per_token_kl": dict(kl_in_reward=True, kl_coef=0.3, per_token=True, token_level_kl=True),
    "whiten_sequence": dict(whiten=True),
    "whiten_per_token": dict(whiten=True, per_token=True),
}


@pytest.mark.parametrize("switches", ALONE.values(), ids=ALONE.keys())
def test_each_switch_matches_loop(switches):
    check_against_reference(RewardShaping(**switches))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_each_kl_estimator_matches_loop(kind):
    check_against_reference(RewardShaping(kl_in_reward=True, kl_coef=0.2, kl_estimator=kind, per_token=True,
                                          token_level_kl=True))


COMBINATIONS = list(itertools.product([None, 1.5], [False, True], [None, 0.8, (-0.5, 2.0)], [False, True],
                                      [False, True], [False, True], [False, True]))


@pytest.mark.parametrize("penalty,normalize,clip,kl,per_token,token_level_kl,whiten", COMBINATIONS)
def test_every_combination_matches_loop(penalty, normalize, clip, kl, per_token, token_level_kl, whiten):
    check_against_reference(RewardShaping(missing_eos_penalty=penalty, normalize=normalize, clip_range=clip,
                                          kl_in_reward=kl, kl_coef=0.25, per_token=per_token,
                                          token_level_kl=token_level_kl, whiten=whiten))


def test_float32_as_the_trainer_calls_it():
    """The trainer's scores and log-probs are float32: the same numbers to float32 precision."""
    out = check_against_reference(RewardShaping(missing_eos_penalty=1.0, normalize=True, clip_range=1.2,
                                                kl_in_reward=True, kl_coef=0.1, per_token=True, token_level_kl=True,
                                                whiten=True), dtype=torch.float32, atol=1e-5)
    assert out.scores.dtype == out.token_rewards.dtype == torch.float32


# --- the order, by hand: each would give other numbers in another order -----------------------


def test_defaults_change_nothing():
    scores, mask, truncated, logp, ref_logp = batch()
    out = shape_rewards(scores, mask, RewardShaping(), truncated=truncated, logp=logp, ref_logp=ref_logp)
    assert torch.equal(out.scores, scores) and torch.equal(out.penalized_scores, scores)
    assert out.token_rewards is None
    # no log-probs needed when the KL is not in the reward, nor when its coefficient is 0
    assert torch.equal(shape_rewards(scores, mask, RewardShaping(kl_in_reward=True, kl_coef=0.0)).scores, scores)


def test_penalty_comes_before_normalising():
    # the penalty evens out the one high score: all equal, so every normalised score is 0
    out = shape_rewards(torch.tensor([1.0, 1.0, 1.0, 3.0]), torch.ones(4, 2),
                        RewardShaping(missing_eos_penalty=2.0, normalize=True),
                        truncated=torch.tensor([False, False, False, True]))
    assert out.scores.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert out.penalized_scores.tolist() == [1.0, 1.0, 1.0, 1.0]  # what the reward metrics report


def test_clipping_comes_after_normalising():
    # [0, 10] normalises to -+1/sqrt(2) (sample std 5 sqrt(2)), then clips to -+0.5;
    # clipping first would give [0, 0.5] and normalise to -+1/sqrt(2)
    out = shape_rewards(torch.tensor([0.0, 10.0], dtype=torch.float64), torch.ones(2, 1),
                        RewardShaping(normalize=True, clip_range=0.5))
    assert out.scores.tolist() == [-0.5, 0.5]
    assert out.penalized_scores.tolist() == [0.0, 10.0]


def test_kl_penalty_comes_after_clipping():
    # score 5 clips to 1, then the k1 penalty 0.5 + 0.25 joins it: 0.25 (penalty first would clip 4.25 to 1)
    logp = torch.tensor([[-1.0, -2.0, -9.0]], dtype=torch.float64)
    ref_logp = torch.tensor([[-1.5, -2.25, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])  # the third token is padding: its KL of 9 is left out
    shaping = RewardShaping(clip_range=1.0, kl_in_reward=True, kl_coef=1.0, kl_estimator="k1")
    out = shape_rewards(torch.tensor([5.0], dtype=torch.float64), mask, shaping, logp=logp, ref_logp=ref_logp)
    assert out.scores.tolist() == [0.25] and out.token_rewards is None
    # a per-token estimator with token_level_kl keeps the penalty at its tokens and the clipped score apart
    per_token = dataclasses.replace(shaping, per_token=True, token_level_kl=True)
    out = shape_rewards(torch.tensor([5.0], dtype=torch.float64), mask, per_token, logp=logp, ref_logp=ref_logp)
    assert out.scores.tolist() == [1.0] and out.token_rewards.tolist() == [[-0.5, -0.25, 0.0]]


def test_whitening_comes_last_and_keeps_the_mean():
    # sequence scores 1, 3 with k1 penalties 1 and 0: 0, 3; mean 1.5, sample std 1.5 sqrt(2)
    logp = torch.tensor([[-1.0], [-2.0]], dtype=torch.float64)
    ref_logp = torch.tensor([[-2.0], [-2.0]], dtype=torch.float64)
    shaping = RewardShaping(kl_in_reward=True, kl_coef=1.0, kl_estimator="k1", whiten=True)
    out = shape_rewards(torch.tensor([1.0, 3.0], dtype=torch.float64), torch.ones(2, 1), shaping, logp=logp,
                        ref_logp=ref_logp)
    d = 1.5 / math.sqrt(4.5 + 1e-8)
    assert out.scores.tolist() == pytest.approx([1.5 - d, 1.5 + d], abs=1e-12)


def test_per_token_kl_and_sequence_kl_carry_the_same_total():
    """Before whitening, a per-token KL and the summed KL differ only in where the penalty sits."""
    scores, mask, truncated, logp, ref_logp = batch()
    base = RewardShaping(missing_eos_penalty=1.0, normalize=True, clip_range=1.0, kl_in_reward=True, kl_coef=0.4,
                         per_token=True)
    summed = shape_rewards(scores, mask, base, truncated=truncated, logp=logp, ref_logp=ref_logp)
    token = shape_rewards(scores, mask, dataclasses.replace(base, token_level_kl=True), truncated=truncated,
                          logp=logp, ref_logp=ref_logp)
    assert summed.token_rewards is None
    assert (token.token_rewards[~mask.bool()] == 0).all() and (token.token_rewards[mask.bool()] < 0).all()
    torch.testing.assert_close(token.scores + token.token_rewards.sum(1), summed.scores)
    assert not torch.allclose(token.scores, summed.scores)


# --- masked rows and padding ------------------------------------------------------------------


def test_masked_row_and_padding():
    scores, mask, truncated, logp, ref_logp = batch()
    shaping = RewardShaping(kl_in_reward=True, kl_coef=0.5, per_token=True, token_level_kl=True, whiten=True)
    out = shape_rewards(scores, mask, shaping, truncated=truncated, logp=logp, ref_logp=ref_logp)
    assert torch.isfinite(out.token_rewards).all()  # NaN log-probs on padding do not leak in
    assert (out.token_rewards[~mask.bool()] == 0).all()
    assert (out.token_rewards[3] == 0).all()  # the all-masked row: no KL, no score, no whitened value
    # ... and it takes no part in the statistics: the other rows alone give the same values
    keep = [0, 1, 2, 4, 5]
    alone = shape_rewards(scores[keep], mask[keep], shaping, logp=logp[keep], ref_logp=ref_logp[keep])
    torch.testing.assert_close(out.token_rewards[keep], alone.token_rewards)
    # the sequence path counts every completion once, the masked row included (as the z-scoring does)
    sequence = shape_rewards(scores, mask, RewardShaping(whiten=True))
    torch.testing.assert_close(sequence.scores, torch.tensor(ref_unit_scale(scores.tolist()), dtype=torch.float64))


def test_inputs_are_not_modified():
    tensors = batch()
    copies = [t.clone() for t in tensors]
    shaping = RewardShaping(missing_eos_penalty=1.0, normalize=True, clip_range=1.0, kl_in_reward=True,
                            kl_coef=0.3, per_token=True, token_level_kl=True, whiten=True)
    scores, mask, truncated, logp, ref_logp = tensors
    shape_rewards(scores, mask, shaping, truncated=truncated, logp=logp, ref_logp=ref_logp)
    for t, c in zip(tensors, copies):
        assert torch.equal(t.nan_to_num(), c.nan_to_num())
    with pytest.raises(dataclasses.FrozenInstanceError):
        shaping.kl_coef = 0.0


def test_clip_scores():
    s = torch.tensor([20.0, 30.0, -15.0, 5.0])
    assert torch.equal(clip_scores(s, None), s)
    assert clip_scores(s, 10).tolist() == [10.0, 10.0, -10.0, 5.0]
    assert clip_scores(s, (-1.0, 25.0)).tolist() == [20.0, 25.0, -1.0, 5.0]


# --- bad input is refused, naming what is wrong --------------------------------------------


def test_refuses_missing_or_misshapen_inputs():
    scores, mask, truncated, logp, ref_logp = batch()
    with pytest.raises(ValueError, match=r"scores must have shape \(B,\)"):
        shape_rewards(scores[:, None], mask, RewardShaping())
    with pytest.raises(ValueError, match=r"mask must have shape \(B, T\) with B = 6"):
        shape_rewards(scores, mask[:4], RewardShaping())
    with pytest.raises(ValueError, match=r"missing_eos_penalty needs truncated of shape \(6,\).*got None"):
        shape_rewards(scores, mask, RewardShaping(missing_eos_penalty=1.0))
    kl = RewardShaping(kl_in_reward=True, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"needs ref_logp of shape \(6, 5\).*got None"):
        shape_rewards(scores, mask, kl, logp=logp)
    with pytest.raises(ValueError, match=r"needs logp of shape \(6, 5\).*got \(6, 4\)"):
        shape_rewards(scores, mask, kl, logp=logp[:, :4], ref_logp=ref_logp)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        shape_rewards(scores, mask, dataclasses.replace(kl, kl_estimator="k9"), logp=logp, ref_logp=ref_logp)
