"""Reference-free pair losses: the policy's own log-probs of the chosen and rejected completion, no
reference model (CPO, SimPO, AlphaPO, TPO, ORPO).

Notation: r_w, r_l are the implicit rewards of the chosen and rejected completion (log π(y|x), summed
over the completion or averaged per token, see each loss's `length_normalised`), z = r_w - r_l.

Margin losses (`MARGIN_LOSSES`: name -> `MarginLoss`, whose `fn(z, *, beta, [label_smoothing], [gamma]) -> (B,)`;
the options a loss reads are its keyword-only parameters, so `smoothable` and `uses_gamma` come from its signature):
  sigmoid  CPO, Xu et al. 2024 (their eq. 3, DPO's loss with the reference dropped): the ε-smoothed
           logistic loss -(1-ε) log σ(βz) - ε log σ(-βz); TPO's main loss on summed log-probs.
  hinge    SLiC's hinge, Zhao et al. 2023: relu(1 - βz).
  ipo      IPO, Azar et al. 2023, on per-token means: (z - 1/(2β))^2.
  simpo    SimPO, Meng et al. 2024, on per-token means: the smoothed logistic loss of βz - γ.
  tpo-l    TPO-L, Saeidi et al. 2024: SimPO's form, its γ named `tpo_l_gamma`.

`alphapo_rewards`: AlphaPO (Gupta et al. 2025) reshapes the reward r = log p into (1 - p^(-α)) / α
(log p again as α -> 0). `odds_ratio_loss`: ORPO (Hong et al. 2024), the log odds ratio of the
per-token mean probabilities. `token_mean_nll`: the behaviour-cloning / SFT term the three trainers add.

Departures: `odds_ratio_loss` clamps the mean log-prob at -1e-6 (p < 1), where the odds are finite;
at p = 1 the log odds and their gradient are infinite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.core.preference_losses import _smoothed_logistic
from posttrain.core.registry import Registry


@dataclass(frozen=True)
class MarginLoss:
    """A loss of the reward margin z = r_w - r_l and the facts the trainers and config checks read from it."""

    fn: Callable[..., Tensor]  # fn(z (B,), *, beta, [label_smoothing], [gamma]) -> (B,)
    length_normalised: bool  # rewards are per-token mean log-probs (else sums over the completion)
    options: tuple[str, ...] = ()  # its keyword-only parameters (read off its signature)

    @property
    def smoothable(self) -> bool:
        """Accepts label_smoothing > 0."""
        return "label_smoothing" in self.options

    @property
    def uses_gamma(self) -> bool:
        """Reads a target margin γ."""
        return "gamma" in self.options


MARGIN_LOSSES = Registry("reference-free pair loss", MarginLoss, positional=("z",))


@MARGIN_LOSSES.register("sigmoid", length_normalised=False)
def sigmoid_margin(z: Tensor, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    return _smoothed_logistic(beta * z, label_smoothing)


@MARGIN_LOSSES.register("hinge", length_normalised=False)
def hinge_margin(z: Tensor, *, beta: float) -> Tensor:
    return torch.relu(1 - beta * z)


@MARGIN_LOSSES.register("ipo", length_normalised=True)
def ipo_margin(z: Tensor, *, beta: float) -> Tensor:
    return (z - 1 / (2 * beta)) ** 2


@MARGIN_LOSSES.register("simpo", length_normalised=True)
def target_margin(z: Tensor, *, beta: float, label_smoothing: float = 0.0, gamma: float = 0.5) -> Tensor:
    # the Bradley-Terry objective asked for a margin of at least γ
    return _smoothed_logistic(beta * z - gamma, label_smoothing)


MARGIN_LOSSES.add("tpo-l", target_margin, length_normalised=True)


def margin_loss(name: str, z: Tensor, *, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0) -> Tensor:
    """Per-pair loss (B,) of the registered margin loss `name` (γ reaches only the losses that read it); raises for
    an unknown name or a label smoothing the loss has no form for."""
    spec = MARGIN_LOSSES.choose(name)
    if label_smoothing and not spec.smoothable:
        raise ValueError(f"the {name!r} loss has no label-smoothed form; set label_smoothing=0")
    options = {k: v for k, v in (("label_smoothing", label_smoothing), ("gamma", gamma)) if k in spec.options}
    return spec.fn(z, beta=beta, **options)


def check_margin_options(loss_type: str, loss_types, label_smoothing: float, shown: list[str], smoothed: str,
                         bc_name: str, bc_weight: float) -> None:
    """A config's choice of pair loss (one of `loss_types`, `shown` in the message), its label smoothing (only
    where the loss has a smoothed form, `smoothed` names them) and its behaviour-cloning weight `bc_name` >= 0."""
    if loss_type not in loss_types:
        raise ValueError(f"loss_type must be one of {shown}, got {loss_type!r}")
    if not 0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    if label_smoothing and not MARGIN_LOSSES[loss_type].smoothable:
        raise ValueError(f"loss_type {loss_type!r} has no label-smoothed form; set label_smoothing=0 or use {smoothed}")
    if bc_weight < 0:
        raise ValueError(f"{bc_name} must be >= 0, got {bc_weight}")


def alphapo_rewards(logps: Tensor, alpha: float) -> Tensor:
    """AlphaPO's reward (1 - p^(-α)) / α of p = exp(logps), computed as -expm1(-α logps) / α; at α = 0 the
    log-prob itself."""
    if alpha == 0:
        return logps
    return -torch.expm1(-alpha * logps) / alpha


def _log1m_exp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2 (Mächler 2012)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def odds_ratio_loss(mean_chosen: Tensor, mean_rejected: Tensor, *, beta: float) -> tuple[Tensor, Tensor]:
    """ORPO's preference term: with p the per-token mean probability, odds(p) = p / (1 - p) and
    log OR = log odds(p_w) - log odds(p_l), the loss is -β log σ(log OR) (B,). Returns (losses, log OR),
    both (B,); mean_chosen, mean_rejected: (B,) per-token mean log-probs."""
    lw, ll = mean_chosen.clamp(max=-1e-6), mean_rejected.clamp(max=-1e-6)
    log_odds = (lw - _log1m_exp(lw)) - (ll - _log1m_exp(ll))
    return -beta * F.logsigmoid(log_odds), log_odds


def token_mean_nll(logps: Tensor, lengths: Tensor) -> Tensor:
    """The completions' negative log-likelihood per token over the whole batch, a scalar: -Σ logps / Σ lengths
    (cross-entropy over every completion token, as the SFT term of CPO, ORPO and TPO is taken).
    logps: (B,) summed completion log-probs; lengths: (B,) their token counts."""
    return -logps.sum() / lengths.sum().clamp(min=1)
