"""TRL 1.16's GRPO loss forms, worked by hand: CISPO, SAPO, INTELLECT-2's delta, the entropy bonus's
gradient estimate and the top-entropy token mask."""

import math

import pytest
import torch

from posttrain.core.masked import top_quantile_mask
from posttrain.core.policy_losses import POLICY_LOSSES, cispo, clipped_surrogate, entropy_bonus, sapo


def one_token(fn, ratio: float, advantage: float, **options):
    """(loss, d loss / d log π, clipped) of one token with π/π_old = ratio, in float64."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, stats = fn(logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([[advantage]], dtype=torch.float64),
                     torch.ones(1, 1), **options)
    loss.sum().backward()
    return loss.item(), logp.grad.item(), bool(stats["clipped"].item())


def test_registered_under_trl_names():
    assert POLICY_LOSSES["cispo"].fn is cispo and POLICY_LOSSES["sapo"].fn is sapo


@pytest.mark.parametrize("ratio, advantage, grad, clipped", [
    (2.0, 1.0, -1.28, True),    # weight capped at 1 + ε_high = 1.28, but the token still has a gradient
    (2.0, -1.0, 1.28, True),    # the cap holds for negative advantages too
    (0.5, 1.0, -0.5, False),    # no lower bound: weight = ρ
    (1.1, -2.0, 2.2, False),
])
def test_cispo_gradient_is_detached_weight_times_advantage(ratio, advantage, grad, clipped):
    # MiniMax-M1: ∇J = sg(min(ρ, 1 + ε_high)) A ∇log π, so d loss / d log π = -w A
    loss, g, was_clipped = one_token(cispo, ratio, advantage, epsilon_high=0.28)
    assert g == pytest.approx(grad)
    assert loss == pytest.approx(grad)  # value -w A (1 + log π - sg(log π)) = -w A
    assert was_clipped == clipped
    # PPO's clip would give this token no gradient at all
    if clipped and advantage > 0:
        assert one_token(clipped_surrogate, ratio, advantage, epsilon_high=0.28)[1] == 0.0


def test_sapo_soft_gate_by_hand():
    # ρ = 1.5, A = 1, τ_pos = 1: f(ρ) - f(1) + 1 = 4 (σ(0.5) - 0.5) + 1; f'(ρ) = 4 σ(0.5) (1 - σ(0.5))
    s = 1 / (1 + math.exp(-0.5))
    loss, g, clipped = one_token(sapo, 1.5, 1.0)
    assert loss == pytest.approx(-(4 * (s - 0.5) + 1))
    assert g == pytest.approx(-4 * s * (1 - s) * 1.5)  # d/d log π = f'(ρ) ρ
    assert not clipped
    # A < 0 uses τ_neg: f'(ρ) = 4 σ(τ (ρ - 1)) (1 - σ(τ (ρ - 1))), here τ = 2, ρ = 0.5
    s = 1 / (1 + math.exp(-2 * -0.5))
    _, g, _ = one_token(sapo, 0.5, -3.0, sapo_temperature_neg=2.0)
    assert g == pytest.approx(4 * s * (1 - s) * 0.5 * 3.0)


def test_sapo_gate_fades_where_the_hard_clip_stops():
    # far above the clip range the gradient is small but not 0; at ρ = 1 it is the policy gradient's
    assert one_token(sapo, 1.0, 1.0)[1] == pytest.approx(-1.0)
    far = one_token(sapo, 8.0, 1.0)[1]  # 4 σ(7) (1 - σ(7)) * 8 ≈ 0.029
    assert -0.05 < far < 0 and one_token(clipped_surrogate, 8.0, 1.0)[1] == 0.0


@pytest.mark.parametrize("ratio, advantage, delta, expected", [
    (3.0, -1.0, 2.0, 2.0),   # PPO leaves 3 unbounded for A < 0: -min(3, δ) A = 2
    (3.0, -1.0, None, 3.0),
    (1.5, -1.0, 2.0, 1.5),   # below δ nothing changes
    (3.0, 1.0, 2.0, -1.2),   # A > 0: the usual upper clip 1 + ε wins
])
def test_delta_two_sided_clip(ratio, advantage, delta, expected):
    assert one_token(clipped_surrogate, ratio, advantage, delta=delta)[0] == pytest.approx(expected)


def test_entropy_bonus_value_and_expected_gradient():
    # value: the exact entropy; gradient, averaged over the sampled token a ~ π: ∇H (checked in float64)
    z = torch.tensor([0.3, -1.0, 2.0, 0.1], dtype=torch.float64, requires_grad=True)
    p = z.softmax(-1)
    H = -(p * p.log()).sum()
    (exact,) = torch.autograd.grad(H, z, retain_graph=True)
    expected = torch.zeros_like(z)
    for a in range(4):
        logp = z.log_softmax(-1)[a].view(1, 1)
        bonus = entropy_bonus(logp, H.detach().view(1, 1))
        assert bonus.item() == pytest.approx(H.item())
        (g,) = torch.autograd.grad(bonus.sum(), z)
        expected += p[a].detach() * g
    assert torch.allclose(expected, exact)


def test_top_quantile_mask_by_hand():
    x = torch.tensor([[1.0, 5.0, 3.0, 0.0], [4.0, 2.0, 9.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # 100 is padding: never kept, never counted
    # 7 masked values 0 1 2 3 4 5 9; the 0.5 quantile is 3: keep 3, 4, 5, 9
    kept = top_quantile_mask(x, mask, 0.5)
    assert kept.tolist() == [[0, 1, 1, 0], [1, 0, 1, 0]]
    assert top_quantile_mask(x, mask, 1.0).tolist() == mask.tolist()


def test_luspo_scales_gspo_sequence_loss_by_length():
    """LUSPO: each sequence contributes |o_i| x GSPO's sequence loss; with "seq_mean_token_sum" (what
    loss_type="luspo" selects) that is the token sum of the sequence-ratio loss."""
    from posttrain.core.masked import aggregate_loss
    from posttrain.core.policy_losses import luspo

    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, 0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.2, -2.1, -0.4], [-1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    per_token, _ = luspo(logp, old, adv, mask)
    # sequence 0: s = exp(mean(0.2, 0.1, -0.1)) = exp(0.0667) ≈ 1.069 < 1.2, loss -s per token, 3 tokens
    s0 = math.exp((0.2 + 0.1 - 0.1) / 3)
    # sequence 1: s = exp(-0.5) ≈ 0.607 < 0.8 with A < 0: clipped term -0.8 * -1 = 0.8 > 0.607 wins
    expected = (3 * -s0 + 1 * 0.8) / 2
    assert aggregate_loss(per_token, mask, "seq_mean_token_sum").item() == pytest.approx(expected)
