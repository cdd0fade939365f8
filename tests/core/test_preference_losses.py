import math

import pytest
import torch

from posttrain.core.preference_losses import (
    DPO_LOSSES,
    PreferenceInput,
    bco_loss,
    dpo_loss,
    dpo_rewards,
    kto_loss,
    pairwise_reward_loss,
)


def sig(x):
    return 1 / (1 + math.exp(-x))


def logsig(x):
    return -math.log1p(math.exp(-x))


# Two pairs. Pair 0: logp_w -10, ref_w -11 -> ρ_w = 1; logp_l -12, ref_l -11.5 -> ρ_l = -0.5;
# h = 1.5. Pair 1: ρ_w = -0.2, ρ_l = 0.6, h = -0.8. β = 0.1.
BETA = 0.1
RHO_W, RHO_L = [1.0, -0.2], [-0.5, 0.6]


def make_input(requires_grad=False):
    return PreferenceInput(
        chosen_logps=torch.tensor([-10.0, -20.2], dtype=torch.float64, requires_grad=requires_grad),
        rejected_logps=torch.tensor([-12.0, -14.4], dtype=torch.float64),
        ref_chosen_logps=torch.tensor([-11.0, -20.0], dtype=torch.float64),
        ref_rejected_logps=torch.tensor([-11.5, -15.0], dtype=torch.float64),
        chosen_lengths=torch.tensor([4, 10]),
        rejected_lengths=torch.tensor([6, 8]),
    )


def reference(name, rho_w, rho_l, beta, ls=0.0, delta=0.0):
    """float64 formulas transcribed from the papers, one pair at a time"""
    h = rho_w - rho_l
    z = beta * h
    if name == "sigmoid":
        return -(1 - ls) * logsig(z) - ls * logsig(-z)
    if name == "hinge":
        return max(0.0, 1 - z)
    if name == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    if name == "robust":
        return ((1 - ls) * -logsig(z) + ls * logsig(-z)) / (1 - 2 * ls)
    if name == "bco_pair":
        return -logsig(beta * rho_w - delta) - logsig(-(beta * rho_l - delta))
    if name == "sppo_hard":
        return (rho_w - 1 / (2 * beta)) ** 2 + (rho_l + 1 / (2 * beta)) ** 2
    if name == "nca_pair":
        return -logsig(beta * rho_w) - 0.5 * logsig(-beta * rho_w) - 0.5 * logsig(-beta * rho_l)
    if name == "apo_zero":
        return 1 - sig(beta * rho_w) + sig(beta * rho_l)
    if name == "apo_down":
        return 1 + sig(beta * rho_w) - sig(z)
    raise KeyError(name)


PAIRED = ["sigmoid", "hinge", "ipo", "robust", "bco_pair", "sppo_hard", "nca_pair",
          "apo_zero", "apo_down"]


def test_registry_holds_every_loss():
    assert set(DPO_LOSSES) == set(PAIRED) | {"simpo"}


@pytest.mark.parametrize("name", PAIRED)
def test_dpo_family_against_float64_reference(name):
    losses = dpo_loss(make_input(), name, beta=BETA)
    expected = [reference(name, w, l, BETA) for w, l in zip(RHO_W, RHO_L)]
    assert losses.shape == (2,)
    assert losses.tolist() == pytest.approx(expected, rel=1e-10)


def test_hand_numbers():
    inp = make_input()
    # pair 0: βh = 0.15; pair 1: βh = -0.08
    assert dpo_loss(inp, "hinge", BETA).tolist() == pytest.approx([0.85, 1.08])
    # IPO: (1.5 - 1/0.2)^2 = 12.25; (-0.8 - 5)^2 = 33.64
    assert dpo_loss(inp, "ipo", BETA).tolist() == pytest.approx([12.25, 33.64])
    # SPPO: (1 - 5)^2 + (-0.5 + 5)^2 = 16 + 20.25
    assert dpo_loss(inp, "sppo_hard", BETA)[0].item() == pytest.approx(36.25)
    # DPO at h = 0 is log 2
    tie = PreferenceInput(*(torch.tensor([-3.0]) for _ in range(4)))
    assert dpo_loss(tie, "sigmoid", 0.5).item() == pytest.approx(math.log(2))


@pytest.mark.parametrize("name", ["sigmoid", "robust"])
def test_label_smoothing(name):
    losses = dpo_loss(make_input(), name, beta=BETA, label_smoothing=0.1)
    expected = [reference(name, w, l, BETA, ls=0.1) for w, l in zip(RHO_W, RHO_L)]
    assert losses.tolist() == pytest.approx(expected, rel=1e-10)
    # conservative DPO by hand for pair 0: 0.9 * log(1 + e^-0.15) + 0.1 * log(1 + e^0.15)
    if name == "sigmoid":
        by_hand = 0.9 * math.log(1 + math.exp(-0.15)) + 0.1 * math.log(1 + math.exp(0.15))
        assert losses[0].item() == pytest.approx(by_hand)


def test_robust_equals_dpo_without_noise_and_rejects_half():
    inp = make_input()
    assert torch.allclose(dpo_loss(inp, "robust", BETA), dpo_loss(inp, "sigmoid", BETA))
    with pytest.raises(ValueError, match="0.5"):
        dpo_loss(inp, "robust", BETA, label_smoothing=0.5)


def test_bco_pair_delta():
    losses = dpo_loss(make_input(), "bco_pair", beta=BETA, delta=0.02)
    # pair 0: -log σ(0.1 - 0.02) - log σ(-(-0.05 - 0.02))
    assert losses[0].item() == pytest.approx(-logsig(0.08) - logsig(0.07))
    assert losses[1].item() == pytest.approx(reference("bco_pair", -0.2, 0.6, BETA, delta=0.02))


def test_simpo():
    inp = make_input()
    # pair 0: avg logps -10/4 = -2.5, -12/6 = -2; β = 2, γ = 0.5 * 2 = 1:
    # -log σ(2 * (-0.5) - 1) = log(1 + e^2)
    losses = dpo_loss(inp, "simpo", beta=2.0)
    assert losses[0].item() == pytest.approx(math.log(1 + math.exp(2)))
    # pair 1: -20.2/10 - (-14.4/8) = -2.02 + 1.8 = -0.22
    assert losses[1].item() == pytest.approx(-logsig(2.0 * -0.22 - 1.0))
    # an absolute γ overrides the ratio
    losses = dpo_loss(inp, "simpo", beta=2.0, simpo_gamma=0.3)
    assert losses[0].item() == pytest.approx(-logsig(-1.3))
    losses = dpo_loss(inp, "simpo", beta=2.0, gamma_beta_ratio=0.0, label_smoothing=0.2)
    assert losses[0].item() == pytest.approx(-0.8 * logsig(-1.0) - 0.2 * logsig(1.0))
    # reference-free: it does not read the reference
    no_ref = PreferenceInput(inp.chosen_logps, inp.rejected_logps, None, None,
                             inp.chosen_lengths, inp.rejected_lengths)
    assert torch.allclose(dpo_loss(no_ref, "simpo", 2.0), dpo_loss(inp, "simpo", 2.0))
    with pytest.raises(ValueError, match="lengths"):
        dpo_loss(PreferenceInput(inp.chosen_logps, inp.rejected_logps), "simpo", 2.0)


def test_dpo_gradient():
    # d/d logp_w of -log σ(βh) = -β σ(-βh)
    inp = make_input(requires_grad=True)
    dpo_loss(inp, "sigmoid", BETA).sum().backward()
    assert inp.chosen_logps.grad.tolist() == pytest.approx([-BETA * sig(-0.15), -BETA * sig(0.08)])


def test_loss_weights_combination():
    inp = make_input()
    combined = dpo_loss(inp, ["sigmoid", "bco_pair"], BETA, loss_weights=[0.8, 0.2], delta=0.02)
    expected = [
        0.8 * reference("sigmoid", w, l, BETA) + 0.2 * reference("bco_pair", w, l, BETA, delta=0.02)
        for w, l in zip(RHO_W, RHO_L)
    ]
    assert combined.tolist() == pytest.approx(expected, rel=1e-10)
    # no weights: a plain sum
    total = dpo_loss(inp, ["hinge", "ipo"], BETA)
    assert total.tolist() == pytest.approx([0.85 + 12.25, 1.08 + 33.64])


def test_dispatch_errors():
    inp = make_input()
    with pytest.raises(ValueError, match="loss_weights"):
        dpo_loss(inp, ["sigmoid", "ipo"], BETA, loss_weights=[1.0])
    with pytest.raises(ValueError, match="unknown DPO loss"):
        dpo_loss(inp, "orpo", BETA)
    with pytest.raises(ValueError, match="not used"):
        dpo_loss(inp, "sigmoid", BETA, delta=0.1)  # delta belongs to bco_pair
    with pytest.raises(ValueError, match="label-smoothed"):
        dpo_loss(inp, "hinge", BETA, label_smoothing=0.1)
    with pytest.raises(ValueError, match="reference log-probs"):
        dpo_loss(PreferenceInput(inp.chosen_logps, inp.rejected_logps), "sigmoid", BETA)


def test_dpo_rewards():
    inp = make_input(requires_grad=True)
    chosen, rejected = dpo_rewards(inp, BETA)
    assert chosen.tolist() == pytest.approx([0.1, -0.02])
    assert rejected.tolist() == pytest.approx([-0.05, 0.06])
    assert not chosen.requires_grad


def test_bco_loss_by_hand():
    logps = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.5], dtype=torch.float64)
    labels = torch.tensor([True, False])
    # r = 0.5 * (0.5, -0.5) = (0.25, -0.25), δ = 0.1
    # desirable: -log σ(0.25 - 0.1); undesirable: -log σ(-(-0.25 - 0.1)) = -log σ(0.35)
    losses, rewards = bco_loss(logps, ref, labels, beta=0.5, delta=0.1)
    assert losses.tolist() == pytest.approx([-logsig(0.15), -logsig(0.35)])
    assert rewards.tolist() == pytest.approx([0.25, -0.25])
    # density-ratio weights scale only the undesirable example
    weighted, _ = bco_loss(logps, ref, torch.tensor([1, 0]), beta=0.5, delta=0.1,
                           weights=torch.tensor([3.0, 2.0], dtype=torch.float64))
    assert weighted.tolist() == pytest.approx([-logsig(0.15), -2 * logsig(0.35)])


def test_kto_loss_by_hand():
    logps = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.5], dtype=torch.float64)
    labels = torch.tensor([1, 0])
    kl = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    # ρ = (0.5, -0.5), β = 0.5, z = 0.2
    # desirable: 1 - σ(0.5 * (0.5 - 0.2)) = 1 - σ(0.15)
    # undesirable: 1.33 * (1 - σ(0.5 * (0.2 + 0.5))) = 1.33 * (1 - σ(0.35))
    losses, rewards = kto_loss(logps, ref, labels, kl, beta=0.5, undesirable_weight=1.33)
    assert losses.tolist() == pytest.approx([1 - sig(0.15), 1.33 * (1 - sig(0.35))])
    assert rewards.tolist() == pytest.approx([0.25, -0.25])
    losses.sum().backward()
    assert kl.grad is None  # the reference point is a constant
    # a negative KL estimate is clamped to 0
    losses, _ = kto_loss(logps, ref, labels, -0.3, beta=0.5, desirable_weight=2.0)
    assert losses.tolist() == pytest.approx([2 * (1 - sig(0.25)), 1 - sig(0.25)])


def test_pairwise_reward_loss_by_hand():
    r_c = torch.tensor([2.0, 0.0], dtype=torch.float64)
    r_r = torch.tensor([1.0, 1.0], dtype=torch.float64)
    # differences 1 and -1
    assert pairwise_reward_loss(r_c, r_r).item() == pytest.approx(
        (-logsig(1.0) - logsig(-1.0)) / 2
    )
    # margins (0.5, 0) -> differences 0.5 and -1; centring: mean(3^2, 1^2) = 5, times 0.01
    loss = pairwise_reward_loss(r_c, r_r, margin=torch.tensor([0.5, 0.0], dtype=torch.float64),
                                center_rewards_coefficient=0.01)
    assert loss.item() == pytest.approx((-logsig(0.5) - logsig(-1.0)) / 2 + 0.05)
