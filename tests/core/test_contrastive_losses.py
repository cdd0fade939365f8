"""The reference-free pair losses (CPO, SimPO, AlphaPO, TPO, ORPO) and the PRM step loss against numbers
worked by hand in float64."""

import math

import pytest
import torch

from posttrain.core.contrastive_losses import (MARGIN_LOSSES, _log1m_exp, alphapo_rewards, margin_loss,
                                               odds_ratio_loss, token_mean_nll)
from posttrain.core.process_rewards import IGNORE, STEP_AGGREGATIONS, step_accuracy, step_loss


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def softplus(x):  # -log σ(-x) = log(1 + e^x)
    return math.log1p(math.exp(x))


def test_registry_facts():
    assert set(MARGIN_LOSSES) == {"sigmoid", "hinge", "ipo", "simpo", "tpo-l"}
    assert {n for n, s in MARGIN_LOSSES.items() if s.length_normalised} == {"ipo", "simpo", "tpo-l"}
    assert {n for n, s in MARGIN_LOSSES.items() if s.smoothable} == {"sigmoid", "simpo", "tpo-l"}
    assert {n for n, s in MARGIN_LOSSES.items() if s.uses_gamma} == {"simpo", "tpo-l"}


def test_sigmoid_with_and_without_label_smoothing():
    # z = 0.5, β = 2: -log σ(1) = log(1 + e^-1); ε = 0.1 mixes in -log σ(-1) = log(1 + e)
    assert margin_loss("sigmoid", t(0.5), beta=2.0).item() == pytest.approx(softplus(-1.0), rel=1e-12)
    smoothed = margin_loss("sigmoid", t(0.5), beta=2.0, label_smoothing=0.1).item()
    assert smoothed == pytest.approx(0.9 * softplus(-1.0) + 0.1 * softplus(1.0), rel=1e-12)
    assert smoothed == pytest.approx(0.41326168751822285, rel=1e-12)


def test_hinge_ipo_and_target_margin():
    assert margin_loss("hinge", t(0.2, 1.0), beta=2.0).tolist() == pytest.approx([0.6, 0.0])
    assert margin_loss("ipo", t(3.0), beta=0.25).item() == pytest.approx(1.0)  # (3 - 1/(2·0.25))^2
    # SimPO / TPO-L: -log σ(βz - γ) = log(1 + e^-(2·1 - 0.5))
    for name in ("simpo", "tpo-l"):
        assert margin_loss(name, t(1.0), beta=2.0, gamma=0.5).item() == pytest.approx(0.20141327798275246, rel=1e-12)


def test_unknown_loss_and_smoothing_without_a_smoothed_form_raise():
    with pytest.raises(ValueError, match="unknown reference-free pair loss 'kto'"):
        margin_loss("kto", t(1.0), beta=1.0)
    with pytest.raises(ValueError, match="'hinge' loss has no label-smoothed form"):
        margin_loss("hinge", t(1.0), beta=1.0, label_smoothing=0.1)


def test_alphapo_rewards():
    # log p = -2, α = 0.5: (1 - p^-α) / α = (1 - e^1) / 0.5
    assert alphapo_rewards(t(-2.0), 0.5).item() == pytest.approx(2 * (1 - math.e), rel=1e-12)
    assert alphapo_rewards(t(-2.0), -0.5).item() == pytest.approx((1 - math.exp(-1.0)) / -0.5, rel=1e-12)
    assert torch.equal(alphapo_rewards(t(-2.0, -0.3), 0.0), t(-2.0, -0.3))  # α = 0: the log-prob itself
    assert alphapo_rewards(t(-2.0), 1e-9).item() == pytest.approx(-2.0, rel=1e-6)  # and its limit


def test_log1m_exp_on_both_sides_of_minus_log_2():
    for x in (-1e-8, -1e-3, -0.5, -math.log(2), -0.9, -5.0, -40.0):
        assert _log1m_exp(t(x)).item() == pytest.approx(math.log(-math.expm1(x)), rel=1e-12)


def test_odds_ratio_loss_by_hand():
    # p_w = 0.5 (odds 1, log odds 0), p_l = 0.2 (odds 1/4): log OR = log 4; loss = -β log σ(log 4) = β log(5/4)
    losses, log_odds = odds_ratio_loss(t(math.log(0.5)), t(math.log(0.2)), beta=0.1)
    assert log_odds.item() == pytest.approx(math.log(4), rel=1e-12)
    assert losses.item() == pytest.approx(0.1 * math.log(1.25), rel=1e-12)


def test_odds_ratio_loss_of_a_certain_completion_stays_finite():
    mean_w = t(0.0, -1e-9).requires_grad_()
    losses, log_odds = odds_ratio_loss(mean_w, t(-1.0, -1.0), beta=0.1)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(log_odds).all() and torch.isfinite(mean_w.grad).all()


def test_token_mean_nll():
    # 3 tokens in all with log-probs summing to -4
    assert token_mean_nll(t(-3.0, -1.0), t(2.0, 1.0)).item() == pytest.approx(4 / 3)


def test_step_loss_and_accuracy_against_a_float64_cross_entropy():
    logits = torch.tensor([[[0.0, 2.0], [1.0, -1.0], [0.5, 0.5]]], dtype=torch.float64)
    labels = torch.tensor([[1, IGNORE, 0]])
    # -log softmax at the labelled positions: log(1 + e^-2) and log 2
    expected = (math.log1p(math.exp(-2.0)) + math.log(2.0)) / 2
    assert step_loss(logits, labels).item() == pytest.approx(expected, rel=1e-12)
    assert step_accuracy(logits, labels) == (2, 2)  # position 2 is a tie, argmax picks class 0: right
    assert step_accuracy(logits, torch.tensor([[0, 1, 0]])) == (1, 3)  # argmax 1, 0, 0: the first two wrong
    none = torch.full_like(labels, IGNORE)
    zero = step_loss(logits.clone().requires_grad_(), none)
    assert zero.item() == 0.0


def test_step_aggregations():
    p = t(0.9, 0.2, 0.6)
    assert {n: round(f(p).item(), 6) for n, f in STEP_AGGREGATIONS.items()} == \
        {"min": 0.2, "prod": 0.108, "last": 0.6, "mean": round(1.7 / 3, 6)}
