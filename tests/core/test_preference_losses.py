import math

import pytest
import torch

from posttrain.core.preference_losses import (
    DPO_LOSSES,
    PreferenceInput,
    UNPAIRED_LOSSES,
    bco_loss,
    check_label_smoothing,
    dpo_loss,
    dpo_rewards,
    kto_loss,
    ld_token_weights,
    pairwise_reward_loss,
    wpo_weights,
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
    if name == "exo_pair":
        eps = ls or 1e-3
        return sig(z) * (logsig(z) - math.log(1 - eps)) + sig(-z) * (logsig(-z) - math.log(eps))
    if name == "discopop":
        mix = sig(z / 0.05)
        return (1 - mix) * -logsig(z) + mix * math.exp(-z)
    raise KeyError(name)


PAIRED = ["sigmoid", "hinge", "ipo", "robust", "bco_pair", "sppo_hard", "nca_pair",
          "apo_zero", "apo_down", "exo_pair", "discopop"]
BATCH_LEVEL = ["aot", "aot_unpaired"]  # losses of the sorted batch, tested on their own
NORMALISED = ["sigmoid_norm", "simpo", "sft"]


def test_registry_holds_every_loss_and_its_facts():
    assert set(DPO_LOSSES) == set(PAIRED) | set(BATCH_LEVEL) | set(NORMALISED)
    assert {n for n, s in DPO_LOSSES.items() if s.reference_free} == {"simpo", "sft"}
    smoothable = {n for n, s in DPO_LOSSES.items() if s.max_label_smoothing is not None}
    assert smoothable == {"sigmoid", "robust", "exo_pair", "aot", "aot_unpaired", "sigmoid_norm", "simpo"}
    assert {n for n, s in DPO_LOSSES.items() if s.per_quantile} == set(BATCH_LEVEL)


@pytest.mark.parametrize("name", PAIRED)
def test_dpo_family_against_float64_reference(name):
    losses = dpo_loss(make_input(), name, beta=BETA)
    expected = [reference(name, w, l, BETA) for w, l in zip(RHO_W, RHO_L)]
    assert losses.shape == (2,)
    assert losses.tolist() == pytest.approx(expected, rel=1e-10)


def test_new_losses_by_hand():
    inp = make_input()
    # sigmoid_norm, pair 0: ρ_w/4 - ρ_l/6 = 0.25 + 0.0833.. = 1/3; pair 1: -0.2/10 - 0.6/8 = -0.095
    assert dpo_loss(inp, "sigmoid_norm", BETA).tolist() == pytest.approx(
        [math.log(1 + math.exp(-BETA / 3)), math.log(1 + math.exp(BETA * 0.095))])
    # sft: -logp_w / |y_w| = 10/4, 20.2/10; reference-free, so no reference is read
    no_ref = PreferenceInput(inp.chosen_logps, inp.rejected_logps, None, None, inp.chosen_lengths, inp.rejected_lengths)
    assert dpo_loss(no_ref, "sft", BETA).tolist() == pytest.approx([2.5, 2.02])
    # exo_pair with ε = 0.5: σ(z) log(2σ(z)) + σ(-z) log(2σ(-z)), 0 at z = 0
    tie = PreferenceInput(*(torch.tensor([-3.0]) for _ in range(4)))
    assert dpo_loss(tie, "exo_pair", BETA, label_smoothing=0.5).item() == pytest.approx(0.0, abs=1e-7)
    # ... and with ε = 0 read as 1e-3, at z = 0: 0.5 log(0.5 / 0.999) + 0.5 log(0.5 / 0.001)
    assert dpo_loss(tie, "exo_pair", BETA).item() == pytest.approx(
        0.5 * math.log(0.5 / 0.999) + 0.5 * math.log(0.5 / 0.001))
    # discopop at z = 0: half logistic (log 2), half exponential (1)
    assert dpo_loss(tie, "discopop", BETA).item() == pytest.approx(0.5 * math.log(2) + 0.5)
    # a larger τ blends more slowly: at z = 0.15 (pair 0), τ = 1 gives mix σ(0.15)
    mix = sig(0.15)
    assert dpo_loss(inp, "discopop", BETA, discopop_tau=1.0)[0].item() == pytest.approx(
        (1 - mix) * -logsig(0.15) + mix * math.exp(-0.15))


def test_aot_sorts_margins_over_the_batch():
    # three pairs whose policy and reference margins are ordered differently
    logp_w, logp_l = [-1.0, -4.0, -2.0], [-3.0, -3.5, -1.0]
    ref_w, ref_l = [-2.0, -2.0, -2.5], [-2.5, -1.0, -3.0]
    inp = PreferenceInput(*(torch.tensor(v, dtype=torch.float64) for v in (logp_w, logp_l, ref_w, ref_l)))
    beta, ls = 0.5, 0.1
    pi = sorted(w - l for w, l in zip(logp_w, logp_l))  # 2, -0.5, -1 -> [-1, -0.5, 2]
    ref = sorted(w - l for w, l in zip(ref_w, ref_l))  # 0.5, -1, 0.5 -> [-1, 0.5, 0.5]
    expected = [-(1 - ls) * logsig(beta * (p - r)) - ls * logsig(-beta * (p - r)) for p, r in zip(pi, ref)]
    assert dpo_loss(inp, "aot", beta, label_smoothing=ls).tolist() == pytest.approx(expected, rel=1e-10)
    rho_w = sorted(a - b for a, b in zip(logp_w, ref_w))  # 1, -2, 0.5
    rho_l = sorted(a - b for a, b in zip(logp_l, ref_l))  # -0.5, -2.5, 2
    expected = [-logsig(beta * (w - l)) for w, l in zip(rho_w, rho_l)]
    assert dpo_loss(inp, "aot_unpaired", beta).tolist() == pytest.approx(expected, rel=1e-10)
    # not the per-pair sigmoid loss: the pairing is replaced by the quantiles
    assert not torch.allclose(dpo_loss(inp, "aot", beta).sort().values, dpo_loss(inp, "sigmoid", beta).sort().values)


def f_margin(name, rho_w, rho_l, alpha=1.0):
    # f'(u) from its definition, u = e^ρ
    fprime = {
        "reverse_kl": lambda u: math.log(u) + 1,
        "forward_kl": lambda u: -1 / u,
        "js_divergence": lambda u: math.log(2 * u / (1 + u)),
        "alpha_divergence": lambda u: (1 - u ** -alpha) / alpha,
    }[name]
    return fprime(math.exp(rho_w)) - fprime(math.exp(rho_l))


@pytest.mark.parametrize("f_divergence", ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize("loss", ["sigmoid", "hinge", "ipo"])
def test_f_divergence_margins(f_divergence, loss):
    alpha = 0.3
    losses = dpo_loss(make_input(), loss, BETA, f_divergence=f_divergence, f_alpha=alpha)
    for got, w, l in zip(losses.tolist(), RHO_W, RHO_L):
        h = f_margin(f_divergence, w, l, alpha)
        expected = {"sigmoid": -logsig(BETA * h), "hinge": max(0.0, 1 - BETA * h), "ipo": (h - 1 / (2 * BETA)) ** 2}
        assert got == pytest.approx(expected[loss], rel=1e-10)
    # forward KL by hand, pair 0: h = e^0.5 - e^-1
    if f_divergence == "forward_kl" and loss == "sigmoid":
        assert losses[0].item() == pytest.approx(-logsig(BETA * (math.exp(0.5) - math.exp(-1))))


def test_f_divergence_limits_and_errors():
    inp = make_input()
    # α = 1 is the forward KL; α -> 0 tends to the reverse KL
    assert torch.allclose(dpo_loss(inp, "sigmoid", BETA, f_divergence="alpha_divergence", f_alpha=1.0),
                          dpo_loss(inp, "sigmoid", BETA, f_divergence="forward_kl"))
    assert torch.allclose(dpo_loss(inp, "sigmoid", BETA, f_divergence="alpha_divergence", f_alpha=1e-6),
                          dpo_loss(inp, "sigmoid", BETA), rtol=1e-5)
    with pytest.raises(ValueError, match="unknown f_divergence"):
        dpo_loss(inp, "sigmoid", BETA, f_divergence="chi2")
    with pytest.raises(ValueError, match="not used"):  # bco_pair reads ρ_w, ρ_l apart, not a margin
        dpo_loss(inp, "bco_pair", BETA, f_divergence="forward_kl")


def test_label_smoothing_range_per_loss():
    smoothable = [n for n, s in DPO_LOSSES.items() if s.max_label_smoothing is not None]
    for name in smoothable:
        if name == "robust":  # (1 - 2ε) in the denominator
            with pytest.raises(ValueError, match="< 0.5"):
                check_label_smoothing([name], 0.5)
        else:
            check_label_smoothing([name], 0.5)
        for bad in (-0.1, 0.6):
            with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\]"):
                check_label_smoothing([name], bad)
    with pytest.raises(ValueError, match="no label-smoothed form"):
        check_label_smoothing(["sigmoid", "discopop"], 0.1)


def test_ld_token_weights():
    # pair 0: chosen 3 tokens after a 1-column prompt offset, rejected 5 tokens; pair 1: chosen 2, rejected 1
    mask = torch.tensor([[0, 1, 1, 1, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 1, 1, 0],
                         [0, 0, 1, 0, 0, 0]])
    weights = ld_token_weights(mask, 0.25)
    assert weights.tolist() == [[0, 1, 1, 1, 0, 0],
                                [1, 0.25, 0, 0, 0, 0],
                                [1, 1, 1, 0.25, 0.25, 0],
                                [0, 0, 1, 0, 0, 0]]
    assert torch.equal(ld_token_weights(mask, 1.0), mask.float())


def test_wpo_weights_against_float64_reference():
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 7, dtype=torch.float64) * 2
    targets = torch.stack([logits[0].argmax(-1), logits[1].argmax(-1), logits[2].argmin(-1), logits[3].argmin(-1)])
    token_logps = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [0, 1, 1]])
    weights = wpo_weights(token_logps, logits, mask)
    expected = []
    for i in range(2):
        total = 0.0
        for row in (i, i + 2):
            terms = []
            for t in range(3):
                if mask[row, t]:
                    p = torch.softmax(logits[row, t], -1).tolist()
                    terms.append(math.log(p[targets[row, t]] / sum(q * q for q in p)))
            total += sum(terms) / len(terms)
        expected.append(min(1.0, math.exp(total)))
    assert weights.tolist() == pytest.approx(expected, rel=1e-5)
    assert 0 < min(expected) < 1  # one pair below the cap, so the weighting does something


def test_apo_zero_unpaired_by_hand():
    logps = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.5], dtype=torch.float64)
    spec = UNPAIRED_LOSSES["apo_zero_unpaired"]
    assert not spec.uses_kl and UNPAIRED_LOSSES["kto"].uses_kl
    # βρ = (0.25, -0.25): desirable 1 - σ(0.25), undesirable 1.33 σ(-0.25)
    losses, rewards = spec.fn(logps, ref, torch.tensor([1, 0]), None, beta=0.5, undesirable_weight=1.33)
    assert losses.tolist() == pytest.approx([1 - sig(0.25), 1.33 * sig(-0.25)])
    assert rewards.tolist() == pytest.approx([0.25, -0.25])


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
