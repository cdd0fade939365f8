import math

import pytest
import torch

from posttrain.core.masked import aggregate_loss
from posttrain.core.policy_losses import (
    POLICY_LOSSES,
    clipped_surrogate,
    clipped_value_loss,
    reinforce,
)


def one_token(ratio, advantage, **options):
    """loss and d loss / d logp for a single token with the given π/π_old."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    adv = torch.tensor([[advantage]], dtype=torch.float64)
    loss, stats = clipped_surrogate(logp, old, adv, torch.ones(1, 1), **options)
    loss.sum().backward()
    return loss.item(), logp.grad.item(), stats["clipped"].item()


# (ratio, A, expected loss, clipped); ε = 0.2, loss = -min(ρA, clip(ρ, 0.8, 1.2) A)
CASES = [
    (1.1, 1.0, -1.1, False),  # inside the range
    (1.5, 1.0, -1.2, True),  # A > 0, above 1 + ε: capped at 1.2
    (0.5, 1.0, -0.5, False),  # A > 0, below 1 - ε: min picks the unclipped 0.5, still learns
    (0.5, -1.0, 0.8, True),  # A < 0, below 1 - ε: min(-0.5, -0.8) = -0.8
    (1.5, -1.0, 1.5, False),  # A < 0, above 1 + ε: min(-1.5, -1.2) = -1.5, still learns
    (0.9, -2.0, 1.8, False),  # inside, A = -2
]


@pytest.mark.parametrize("ratio, advantage, expected, clipped", CASES)
def test_clipped_surrogate_by_hand(ratio, advantage, expected, clipped):
    loss, grad, was_clipped = one_token(ratio, advantage)
    assert loss == pytest.approx(expected)
    assert was_clipped == clipped
    # d(-ρA)/d logp = -ρA where the unclipped branch is active, 0 where clipped
    assert grad == pytest.approx(0.0 if clipped else -ratio * advantage)


@pytest.mark.parametrize(
    "ratio, advantage, epsilon_high, expected, clipped",
    [
        (1.25, 1.0, 0.28, -1.25, False),  # DAPO clip-higher: 1.25 < 1.28 is inside
        (1.25, 1.0, None, -1.2, True),  # symmetric ε = 0.2 clips it at 1.2
        (1.3, 1.0, 0.28, -1.28, True),  # capped at 1 + 0.28
        (0.75, -1.0, 0.28, 0.8, True),  # the low side stays at 1 - 0.2
    ],
)
def test_asymmetric_epsilon_high(ratio, advantage, epsilon_high, expected, clipped):
    loss, _, was_clipped = one_token(ratio, advantage, epsilon_high=epsilon_high)
    assert loss == pytest.approx(expected)
    assert was_clipped == clipped


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_on_policy_ratio_is_one_and_gradient_is_reinforce(name):
    torch.manual_seed(0)
    logp = (-torch.rand(3, 5, dtype=torch.float64) * 3).requires_grad_()
    adv = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] + [0] * 4])
    loss, stats = POLICY_LOSSES[name].fn(logp, logp.detach(), adv, mask)
    assert (stats["ratio"] == 1).all()
    assert not stats["clipped"].any()
    assert (stats["approx_kl"] == 0).all()
    loss.sum().backward()
    # the plain policy gradient: ∇(-A log π) = -A ∇log π, per masked token
    assert torch.allclose(logp.grad, -adv * mask)
    assert torch.allclose(loss, -adv * mask)


def test_stats_values():
    logp = torch.tensor([[-1.0, -2.0, 5.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    _, stats = clipped_surrogate(logp, old, torch.ones(1, 3), mask)
    # log ratios 0.5 and -1.0: 0.5 * 0.25, 0.5 * 1.0; padding 0
    assert stats["approx_kl"][0].tolist() == pytest.approx([0.125, 0.5, 0.0])
    assert stats["ratio"][0].tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 1.0])
    # ratio e^0.5 > 1.2 with A > 0 is clipped; e^-1 < 0.8 with A > 0 is not
    assert stats["clipped"][0].tolist() == [True, False, False]


def test_padding_garbage_gives_no_nan():
    logp = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    old = torch.tensor([[-1.2, -30.0]])
    for name in POLICY_LOSSES:
        loss, _ = POLICY_LOSSES[name].fn(logp, old, torch.ones(1, 2), torch.tensor([[1, 0]]))
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()


def test_reinforce_is_unclipped():
    logp = torch.tensor([[math.log(3.0)]], dtype=torch.float64)
    loss, stats = reinforce(logp, torch.zeros(1, 1), torch.tensor([[2.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-6.0)  # -A ρ = -2 * 3
    assert not stats["clipped"].any()


def test_gspo_sequence_ratio_and_gradient():
    torch.manual_seed(1)
    B, T = 3, 4
    logp = (-torch.rand(B, T, dtype=torch.float64) * 2).requires_grad_()
    old = logp.detach() + 0.05 * torch.randn(B, T, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    seq_adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    adv = seq_adv[:, None].expand(B, T)
    loss, stats = clipped_surrogate(
        logp, old, adv, mask, epsilon=0.5, importance_sampling_level="sequence"
    )
    # s_i = exp(mean over the sequence's tokens of log π - log π_old), the same on every token
    for i in range(B):
        n = int(mask[i].sum())
        s_i = math.exp(sum((logp[i, t] - old[i, t]).item() for t in range(n)) / n)
        assert stats["ratio"][i, :n].tolist() == pytest.approx([s_i] * n)
    # the gradient equals that of GSPO's sequence objective -(1/B) Σ_i s_i A_i (no clipping
    # is active with ε = 0.5 and ratios near 1)
    assert not stats["clipped"].any()
    (grad,) = torch.autograd.grad(aggregate_loss(loss, mask, "seq_mean_token_mean"), logp)
    seq_log_ratio = ((logp - old) * mask).sum(-1) / mask.sum(-1)
    objective = -(torch.exp(seq_log_ratio) * seq_adv).mean()
    (expected,) = torch.autograd.grad(objective, logp)
    assert torch.allclose(grad, expected)


def test_gspo_token_gradient_with_token_advantages():
    # GSPO-token: token t of sequence i has value s_i but the gradient of its own log π, so
    # d(-s_{i,t} A_{i,t}) / d logp_{i,t} = -s_i A_{i,t}, and other tokens get nothing from it
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -0.6]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    loss, _ = clipped_surrogate(logp, old, adv, torch.ones(1, 3), epsilon=0.5,
                                importance_sampling_level="sequence")
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    s = math.exp((0.1 - 0.1 + 0.1) / 3)
    assert grad[0].tolist() == pytest.approx([-s * 1.0, s * 2.0, -s * 0.5])


def test_gspo_clips_whole_sequence():
    # sequence log ratio mean(0.3, 0.1) = 0.2 -> s = e^0.2 = 1.2214 > 1.2: every token clipped
    logp = torch.tensor([[0.3, 0.1, 0.0]], requires_grad=True)
    loss, stats = clipped_surrogate(
        logp, torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([[1, 1, 0]]),
        importance_sampling_level="sequence",
    )
    assert stats["clipped"][0].tolist() == [True, True, False]
    assert loss[0, :2].tolist() == pytest.approx([-1.2, -1.2])
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert (grad == 0).all()


def test_unknown_level():
    with pytest.raises(ValueError, match="importance_sampling_level"):
        clipped_surrogate(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1),
                          torch.ones(1, 1), importance_sampling_level="batch")


def test_clipped_value_loss_by_hand():
    # V_old = 1, c = 0.2, R = 2; padding on the last position
    values = torch.tensor([[1.1, 1.5, 0.5, 7.0]], dtype=torch.float64, requires_grad=True)
    old = torch.ones(1, 4, dtype=torch.float64)
    returns = torch.full((1, 4), 2.0, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, clipfrac = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    # 1.1: inside, 0.5 * 0.9^2 = 0.405
    # 1.5: clipped to 1.2, max(0.5^2, 0.8^2) = 0.64 -> 0.32 (clipped branch, no gradient)
    # 0.5: clipped to 0.8, max(1.5^2, 1.2^2) = 2.25 -> 1.125 (unclipped branch)
    assert loss[0].tolist() == pytest.approx([0.405, 0.32, 1.125, 0.0])
    assert clipfrac[0].tolist() == [False, True, False, False]
    loss.sum().backward()
    # d 0.5 (v - R)^2 / dv = v - R
    assert values.grad[0].tolist() == pytest.approx([-0.9, 0.0, -1.5, 0.0])


def test_register_policy_loss_guards():
    from posttrain.core.policy_losses import register_policy_loss

    def loss(logp, old_logp, advantages, mask, *, epsilon=0.2):
        return -advantages * logp, {}

    with pytest.raises(TypeError, match="aggregation"):  # the fact must be given, None included
        register_policy_loss("test_loss")
    with pytest.raises(ValueError, match="not a loss aggregation"):
        register_policy_loss("test_loss", aggregation="mean")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("clipped", aggregation=None)(loss)

    def positional_option(logp, old_logp, advantages, mask, epsilon=0.2):
        return -advantages * logp, {}

    with pytest.raises(TypeError, match="keyword-only"):
        register_policy_loss("test_loss", aggregation=None)(positional_option)
    assert "test_loss" not in POLICY_LOSSES
    assert POLICY_LOSSES["luspo"].aggregation == "seq_mean_token_sum" and POLICY_LOSSES["clipped"].aggregation is None
    assert POLICY_LOSSES["sapo"].options == ("sapo_temperature_pos", "sapo_temperature_neg",
                                             "importance_sampling_level")
