"""Per-token KL estimators and KL-coefficient controllers.

The estimators approximate KL(π || π_ref) from tokens sampled from π, using only the two
log-probabilities of the sampled token (J. Schulman, "Approximating KL divergence", 2020).
With log r = log π_ref(a) - log π(a):
  k1 = -log r                 unbiased, high variance, can be negative per token
  k2 = 0.5 (log r)^2          biased, low variance, always >= 0
  k3 = (r - 1) - log r        unbiased, low variance, always >= 0
"abs" = |log r| is a further heuristic used in the RLHF literature.
Departure: k3 clamps log r to [-20, 20] so that exp cannot overflow on a token the reference
finds wildly (un)likely; the clamp is far outside the range seen in stable training.

The controllers set the coefficient of a KL penalty in the reward. The adaptive one is the
proportional controller of Ziegler et al. 2019, "Fine-Tuning Language Models from Human
Preferences" (Sec. 2.2).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.core.registry import Registry


def _k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


def _k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def _k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    log_r = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.exp(log_r) - log_r - 1


def _abs(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return (logp - ref_logp).abs()


KL_ESTIMATORS = Registry("KL estimator", entries={  # fn(logp, ref_logp) -> (B, T)
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "abs": _abs,
})


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token KL(π || π_ref) estimate from log π and log π_ref of sampled tokens.

    logp, ref_logp: (B, T); returns (B, T). Padding positions are not masked here; reduce
    the result with `masked_mean` or `aggregate_loss`.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose from {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp, ref_logp)


class FixedKLController:
    """A constant KL coefficient; `update` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Ziegler et al. 2019: steer the measured KL towards `target`.

    e = clip(KL / target - 1, -0.2, 0.2);  β <- β (1 + e * n_steps / horizon)
    The clip bounds how fast β moves when the KL is far off; `horizon` (in samples) sets the
    time constant.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError("AdaptiveKLController needs target > 0 and horizon > 0")
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
