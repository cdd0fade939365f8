import math

import pytest
import torch

from posttrain.core.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
)


def test_estimators_by_hand():
    # π(a) = 0.5, π_ref(a) = 0.25: logp - ref_logp = log 2
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    log2 = math.log(2)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(log2)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * log2**2)
    # r = π_ref/π = 0.5: (r - 1) - log r = -0.5 + log 2
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(-0.5 + log2)
    assert kl_penalty(logp, ref).item() == pytest.approx(0.1931471805599453)
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(log2)
    assert kl_penalty(ref, logp, "k1").item() == pytest.approx(-log2)


def test_k3_nonnegative_and_zero_for_identical_policies():
    torch.manual_seed(0)
    logp = torch.randn(16, 32, dtype=torch.float64) * 3
    ref = torch.randn(16, 32, dtype=torch.float64) * 3
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    assert (kl_penalty(logp, ref, "k2") >= 0).all()
    for kind in KL_ESTIMATORS:
        assert (kl_penalty(logp, logp.clone(), kind) == 0).all()


def test_k3_finite_for_extreme_ratio():
    out = kl_penalty(torch.tensor([-200.0]), torch.tensor([0.0]), "k3")
    assert torch.isfinite(out).all()


def test_k1_and_k3_unbiased_monte_carlo():
    # samples from π over 5 tokens; both estimators average to the exact KL(π || π_ref)
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2], dtype=torch.float64)
    exact = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    gen = torch.Generator().manual_seed(0)
    a = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    logp, ref = p.log()[a], q.log()[a]
    assert kl_penalty(logp, ref, "k1").mean().item() == pytest.approx(exact, abs=5e-3)
    assert kl_penalty(logp, ref, "k3").mean().item() == pytest.approx(exact, abs=5e-3)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(100.0, 64)
    assert ctl.value == 0.05


def test_adaptive_controller_by_hand():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10_000)
    # KL 9: error 9/6 - 1 = 0.5, clipped to 0.2; β *= 1 + 0.2 * 256 / 10000 = 1.00512
    ctl.update(9.0, 256)
    assert ctl.value == pytest.approx(0.100512)
    # KL 5.4: error -0.1; β *= 1 - 0.1 * 256 / 10000 = 0.99744
    ctl.update(5.4, 256)
    assert ctl.value == pytest.approx(0.100512 * 0.99744)
    # on target: unchanged
    before = ctl.value
    ctl.update(6.0, 256)
    assert ctl.value == pytest.approx(before)
