"""Preference losses as pure functions of per-sequence log-probs.

Notation: logp_w, logp_l are log π(y|x) of the chosen and rejected completion, summed over
completion tokens; ref_* the same under the reference policy; the log-ratios are
ρ_w = logp_w - ref_w, ρ_l = logp_l - ref_l, and h = ρ_w - ρ_l.

Pairwise DPO family (`DPO_LOSSES`, each `fn(inp, *, beta, label_smoothing=0.0, ...) -> (B,)`):
  sigmoid    DPO, Rafailov et al. 2023: -log σ(βh); label smoothing ε gives conservative DPO
             (Mitchell 2023): -(1-ε) log σ(βh) - ε log σ(-βh).
  hinge      SLiC's hinge (Zhao et al. 2023) in the β-scaled form of RSO (Liu et al. 2024):
             relu(1 - βh).
  ipo        IPO, Azar et al. 2023: (h - 1/(2β))^2, β playing the paper's τ. h uses the
             log-probs as given, i.e. sums over tokens as in the paper; pass per-token means
             in the PreferenceInput for the length-averaged variant.
  robust     Robust DPO, Chowdhury et al. 2024: ((1-ε)(-log σ(βh)) + ε log σ(-βh)) / (1-2ε),
             an unbiased loss under label noise of rate ε < 1/2.
  bco_pair   BCO, Jung et al. 2024, on pairs: -log σ(βρ_w - δ) - log σ(-(βρ_l - δ)), δ a
             running mean of the rewards passed as option `delta`.
  sppo_hard  SPPO, Wu et al. 2024, with hard labels P(w≻l) = 1:
             (ρ_w - 1/(2β))^2 + (ρ_l + 1/(2β))^2.
  nca_pair   NCA, Chen et al. 2024: -log σ(βρ_w) - ½ log σ(-βρ_w) - ½ log σ(-βρ_l).
  apo_zero   APO-zero, D'Oosterlinck et al. 2024: 1 - σ(βρ_w) + σ(βρ_l).
  apo_down   APO-down: 1 + σ(βρ_w) - σ(βh). (Both APO losses are the paper's plus the
             constant 1, so that they are >= 0; gradients are unchanged.)
  simpo      SimPO, Meng et al. 2024, reference-free: -log σ(β(logp_w/|y_w| - logp_l/|y_l|) - γ),
             with label smoothing as in sigmoid.

Losses that need a reference raise when it is missing; for reference-free DPO pass zeros.
`bco_loss`, `kto_loss` and `pairwise_reward_loss` are the unpaired and reward-model losses.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class PreferenceInput:
    chosen_logps: Tensor  # (B,) log π(y_w|x), summed over completion tokens
    rejected_logps: Tensor  # (B,)
    ref_chosen_logps: Tensor | None = None  # (B,) reference policy (None for reference-free losses)
    ref_rejected_logps: Tensor | None = None  # (B,)
    chosen_lengths: Tensor | None = None  # (B,) completion token counts (length-normalised losses)
    rejected_lengths: Tensor | None = None  # (B,)


def _log_ratios(inp: PreferenceInput) -> tuple[Tensor, Tensor]:
    """(ρ_w, ρ_l), each (B,)."""
    if inp.ref_chosen_logps is None or inp.ref_rejected_logps is None:
        raise ValueError(
            "this loss needs reference log-probs (ref_chosen_logps, ref_rejected_logps); "
            "for reference-free training pass zeros"
        )
    return inp.chosen_logps - inp.ref_chosen_logps, inp.rejected_logps - inp.ref_rejected_logps


def _smoothed_logistic(z: Tensor, label_smoothing: float) -> Tensor:
    # -log σ(z) if the label is right with probability 1 - ε, -log σ(-z) otherwise
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def _no_smoothing(name: str, label_smoothing: float) -> None:
    if label_smoothing != 0.0:
        raise ValueError(f"the {name!r} loss has no label-smoothed form; set label_smoothing=0")


DPOLossFn = Callable[..., Tensor]
DPO_LOSSES: dict[str, DPOLossFn] = {}


def _register(name: str):
    def decorate(fn: DPOLossFn) -> DPOLossFn:
        DPO_LOSSES[name] = fn
        return fn

    return decorate


@_register("sigmoid")
def sigmoid_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    rho_w, rho_l = _log_ratios(inp)
    return _smoothed_logistic(beta * (rho_w - rho_l), label_smoothing)


@_register("hinge")
def hinge_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    _no_smoothing("hinge", label_smoothing)
    rho_w, rho_l = _log_ratios(inp)
    return torch.relu(1 - beta * (rho_w - rho_l))


@_register("ipo")
def ipo_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    _no_smoothing("ipo", label_smoothing)
    rho_w, rho_l = _log_ratios(inp)
    return (rho_w - rho_l - 1 / (2 * beta)) ** 2


@_register("robust")
def robust_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError("robust DPO needs 0 <= label_smoothing < 0.5 (the label-noise rate)")
    rho_w, rho_l = _log_ratios(inp)
    z = beta * (rho_w - rho_l)
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


@_register("bco_pair")
def bco_pair_loss(
    inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0, delta: float | Tensor = 0.0
) -> Tensor:
    _no_smoothing("bco_pair", label_smoothing)
    rho_w, rho_l = _log_ratios(inp)
    return -F.logsigmoid(beta * rho_w - delta) - F.logsigmoid(-(beta * rho_l - delta))


@_register("sppo_hard")
def sppo_hard_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    _no_smoothing("sppo_hard", label_smoothing)
    rho_w, rho_l = _log_ratios(inp)
    return (rho_w - 1 / (2 * beta)) ** 2 + (rho_l + 1 / (2 * beta)) ** 2


@_register("nca_pair")
def nca_pair_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    _no_smoothing("nca_pair", label_smoothing)
    rho_w, rho_l = _log_ratios(inp)
    r_w, r_l = beta * rho_w, beta * rho_l
    return -F.logsigmoid(r_w) - 0.5 * F.logsigmoid(-r_w) - 0.5 * F.logsigmoid(-r_l)


@_register("apo_zero")
def apo_zero_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    # for data whose chosen answers beat the model: push chosen up, rejected down
    _no_smoothing("apo_zero", label_smoothing)
    rho_w, rho_l = _log_ratios(inp)
    return 1 - torch.sigmoid(beta * rho_w) + torch.sigmoid(beta * rho_l)


@_register("apo_down")
def apo_down_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    # for data whose chosen answers are worse than the model's: push both down, rejected more
    _no_smoothing("apo_down", label_smoothing)
    rho_w, rho_l = _log_ratios(inp)
    return 1 + torch.sigmoid(beta * rho_w) - torch.sigmoid(beta * (rho_w - rho_l))


@_register("simpo")
def simpo_loss(
    inp: PreferenceInput,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    gamma_beta_ratio: float = 0.5,
    simpo_gamma: float | None = None,
) -> Tensor:
    """γ is `simpo_gamma` when given, else `gamma_beta_ratio * beta` (the paper tunes γ/β)."""
    if inp.chosen_lengths is None or inp.rejected_lengths is None:
        raise ValueError("simpo needs chosen_lengths and rejected_lengths (token counts)")
    gamma = gamma_beta_ratio * beta if simpo_gamma is None else simpo_gamma
    avg_w = inp.chosen_logps / inp.chosen_lengths.clamp(min=1)
    avg_l = inp.rejected_logps / inp.rejected_lengths.clamp(min=1)
    return _smoothed_logistic(beta * (avg_w - avg_l) - gamma, label_smoothing)


def dpo_loss(
    inp: PreferenceInput,
    loss_type: str | Sequence[str],
    beta: float,
    label_smoothing: float = 0.0,
    loss_weights: Sequence[float] | None = None,
    **options,
) -> Tensor:
    """Per-example loss (B,): one loss type, or a weighted sum of several (e.g. MPO's
    ["sigmoid", "bco_pair"]). Each loss receives the options its signature names; an option
    no chosen loss accepts is an error, not silently ignored."""
    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(loss_types):
        raise ValueError(f"{len(loss_types)} loss types but {len(weights)} loss_weights")
    unknown = [name for name in loss_types if name not in DPO_LOSSES]
    if unknown:
        raise ValueError(f"unknown DPO loss type(s) {unknown}; choose from {sorted(DPO_LOSSES)}")
    used: set[str] = set()
    total = 0.0
    for name, weight in zip(loss_types, weights):
        fn = DPO_LOSSES[name]
        accepted = inspect.signature(fn).parameters
        own = {k: v for k, v in options.items() if k in accepted}
        used.update(own)
        total = total + weight * fn(inp, beta=beta, label_smoothing=label_smoothing, **own)
    unused = set(options) - used
    if unused:
        raise ValueError(f"options {sorted(unused)} are not used by loss type(s) {loss_types}")
    return total


def dpo_rewards(inp: PreferenceInput, beta: float) -> tuple[Tensor, Tensor]:
    """Implicit rewards β ρ_w, β ρ_l, each (B,), detached (for logging)."""
    rho_w, rho_l = _log_ratios(inp)
    return (beta * rho_w).detach(), (beta * rho_l).detach()


def bco_loss(
    logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    *,
    beta: float,
    delta: float | Tensor,
    weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """BCO (Jung et al. 2024) on unpaired data: a binary classifier with logit r - δ.

    logps, ref_logps: (B,) summed log-probs; labels: (B,) True / 1 for desirable; δ: the
    running mean of rewards; weights: (B,) optional density ratios that scale the
    undesirable losses (the paper's underlying-distribution matching). Returns the per-example
    losses (B,) and the detached rewards r = β (logp - ref) (B,) to update δ with.
    """
    rewards = beta * (logps - ref_logps)  # (B,)
    desirable = labels.bool()
    undesirable_loss = -F.logsigmoid(-(rewards - delta))
    if weights is not None:
        undesirable_loss = undesirable_loss * weights
    losses = torch.where(desirable, -F.logsigmoid(rewards - delta), undesirable_loss)
    return losses, rewards.detach()


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    kl: Tensor | float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """KTO (Ethayarajh et al. 2024): desirable λ_D (1 - σ(β(ρ - z))), undesirable
    λ_U (1 - σ(β(z - ρ))), with ρ = logp - ref and z = max(kl, 0) the reference point.

    `kl` is a scalar estimate of KL(π || π_ref) in nats (not multiplied by β), e.g. the batch
    mean of logp - ref on mismatched prompt/completion pairs; it is detached, as in the paper.
    Returns per-example losses (B,) and detached rewards β ρ (B,).
    """
    log_ratio = logps - ref_logps  # (B,)
    z = torch.as_tensor(kl, dtype=log_ratio.dtype, device=log_ratio.device).detach().clamp(min=0)
    losses = torch.where(
        labels.bool(),
        desirable_weight * (1 - torch.sigmoid(beta * (log_ratio - z))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z - log_ratio))),
    )
    return losses, (beta * log_ratio).detach()


def pairwise_reward_loss(
    r_chosen: Tensor,
    r_rejected: Tensor,
    margin: Tensor | None = None,
    center_rewards_coefficient: float = 0.0,
) -> Tensor:
    """Bradley-Terry reward-model loss, a scalar: mean(-log σ(r_c - r_r - margin)), plus
    coef * mean((r_c + r_r)^2) to keep rewards centred at 0 (Eisenstein et al. 2023).

    r_chosen, r_rejected, margin: (B,)."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((r_chosen + r_rejected) ** 2).mean()
    return loss
