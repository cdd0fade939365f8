"""Preference losses as pure functions of per-sequence log-probs.

Notation: logp_w, logp_l are log π(y|x) of the chosen and rejected completion, summed over
completion tokens; ref_* the same under the reference policy; the log-ratios are
ρ_w = logp_w - ref_w, ρ_l = logp_l - ref_l, and h = ρ_w - ρ_l.

Pairwise DPO family (`DPO_LOSSES`: name -> `DPOLoss`, whose `fn(inp, *, beta, [label_smoothing],
[options]) -> (B,)`; the entry also says whether the loss is reference-free and which label
smoothing ε it accepts, so trainers and config checks read those facts from here):
  sigmoid    DPO, Rafailov et al. 2023: -log σ(βh); label smoothing ε gives conservative DPO
             (Mitchell 2023): -(1-ε) log σ(βh) - ε log σ(-βh). ε in [0, 0.5].
  hinge      SLiC's hinge (Zhao et al. 2023) in the β-scaled form of RSO (Liu et al. 2024):
             relu(1 - βh).
  ipo        IPO, Azar et al. 2023: (h - 1/(2β))^2, β playing the paper's τ. h uses the
             log-probs as given, i.e. sums over tokens as in the paper; pass per-token means
             in the PreferenceInput for the length-averaged variant.
  robust     Robust DPO, Chowdhury et al. 2024: ((1-ε)(-log σ(βh)) + ε log σ(-βh)) / (1-2ε),
             an unbiased loss under label noise of rate ε in [0, 0.5).
  exo_pair   EXO, Ji et al. 2024, on pairs: KL(p_θ || (1-ε, ε)) with p_θ = (σ(βh), σ(-βh));
             ε = 0 is read as 1e-3.
  discopop   DiscoPOP / LRML, Lu et al. 2024: (1 - σ(βh/τ)) (-log σ(βh)) + σ(βh/τ) exp(-βh),
             τ = option `discopop_tau` (0.05).
  aot        AOT, Melnyk et al. 2024, paired: the sorted batch of policy margins logp_w - logp_l
             minus the sorted reference margins, under the (smoothed) logistic loss.
  aot_unpaired  AOT for unpaired use of the pairs: sorted ρ_w minus sorted ρ_l, same loss.
  bco_pair   BCO, Jung et al. 2024, on pairs: -log σ(βρ_w - δ) - log σ(-(βρ_l - δ)), δ a
             running mean of the rewards passed as option `delta`.
  sppo_hard  SPPO, Wu et al. 2024, with hard labels P(w≻l) = 1:
             (ρ_w - 1/(2β))^2 + (ρ_l + 1/(2β))^2.
  nca_pair   NCA, Chen et al. 2024: -log σ(βρ_w) - ½ log σ(-βρ_w) - ½ log σ(-βρ_l).
  apo_zero   APO-zero, D'Oosterlinck et al. 2024: 1 - σ(βρ_w) + σ(βρ_l).
  apo_down   APO-down: 1 + σ(βρ_w) - σ(βh). (Both APO losses are the paper's plus the
             constant 1, so that they are >= 0; gradients are unchanged.)
  sigmoid_norm  length-normalised DPO (Tülu 3, Lambert et al. 2024): -log σ(β(ρ_w/|y_w| - ρ_l/|y_l|)),
             smoothed as sigmoid.
  simpo      SimPO, Meng et al. 2024, reference-free: -log σ(β(logp_w/|y_w| - logp_l/|y_l|) - γ),
             with label smoothing as in sigmoid.
  sft        reference-free: the chosen completion's NLL per token, -logp_w/|y_w| (for MPO-style
             mixtures with `loss_weights`).

f-divergences (f-DPO, Wang et al. 2023): the losses of the margin h (sigmoid, hinge, ipo, robust,
exo_pair, discopop) take options `f_divergence` and `f_alpha`, and h becomes f'(u_w) - f'(u_l)
with u = π/π_ref (`F_DIVERGENCES`); reverse KL gives h = ρ_w - ρ_l.

Losses that need a reference raise when it is missing; for reference-free DPO pass zeros.
Online pair losses (the online preference trainers, `trainers/online_dpo.py`, `xpo.py`, `nash_md.py`):
`xpo_exploration` (XPO's bonus, Xie et al. 2024), `tied_pair_loss` (a pair without a preference, under a
fair coin's label) and `nash_md_loss` (Nash-MD's policy gradient, Munos et
al. 2023); Online DPO applies the pairwise losses above to the policy's own sampled pairs.

`bco_loss`, `kto_loss`, `apo_zero_unpaired_loss` (`UNPAIRED_LOSSES`) and `pairwise_reward_loss`
are the unpaired and reward-model losses; `ld_token_weights` (LD-DPO) and `wpo_weights` (WPO)
weight tokens and pairs.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.core.registry import Registry


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


# f'(u) of each f-divergence, u = π/π_ref, as a function of ρ = log u with additive constants dropped
# (they cancel in the margin f'(u_w) - f'(u_l)); f-DPO, Wang et al. 2023, "Beyond Reverse KL".
F_DIVERGENCES = Registry("f-divergence", entries={  # fn(rho, alpha) -> f'(u)
    "reverse_kl": lambda rho, alpha: rho,  # f(u) = u log u: plain DPO
    "forward_kl": lambda rho, alpha: -torch.exp(-rho),  # f(u) = -log u, f'(u) = -1/u
    "js_divergence": lambda rho, alpha: rho - F.softplus(rho),  # f'(u) = log(2u / (1 + u))
    "alpha_divergence": lambda rho, alpha: -torch.exp(-alpha * rho) / alpha,  # f'(u) = (1 - u^-α) / α
})


def _margin(inp: PreferenceInput, f_divergence: str, f_alpha: float) -> Tensor:
    """The pair's margin h (B,): f'(u_w) - f'(u_l); ρ_w - ρ_l under the reverse KL of plain DPO."""
    if f_divergence not in F_DIVERGENCES:
        raise ValueError(f"unknown f_divergence {f_divergence!r}; choose from {sorted(F_DIVERGENCES)}")
    term = F_DIVERGENCES[f_divergence]
    rho_w, rho_l = _log_ratios(inp)
    return term(rho_w, f_alpha) - term(rho_l, f_alpha)


DPOLossFn = Callable[..., Tensor]


@dataclass(frozen=True)
class DPOLoss:
    """A registered pairwise loss and the facts the trainer and config checks read from it."""

    fn: DPOLossFn  # fn(inp, *, beta, [label_smoothing], [options]) -> (B,)
    reference_free: bool = False  # reads no reference log-probs: no reference model is loaded for it alone
    max_label_smoothing: float | None = None  # label_smoothing ε allowed in [0, this]; None: no smoothed form
    max_included: bool = True  # False: ε must stay below max_label_smoothing
    per_quantile: bool = False  # the (B,) losses belong to sorted batch quantiles, not to the pairs (AOT)

    @property
    def options(self) -> set[str]:
        """Keyword options the loss reads besides beta and label_smoothing (e.g. delta, f_divergence)."""
        return set(inspect.signature(self.fn).parameters) - {"inp", "beta", "label_smoothing"}


DPO_LOSSES = Registry("DPO loss", DPOLoss)


def check_label_smoothing(loss_types: Sequence[str], label_smoothing: float) -> None:
    """Raise ValueError unless every loss in `loss_types` accepts `label_smoothing`."""
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5] (the probability that a label is flipped), "
                         f"got {label_smoothing}")
    if not label_smoothing:
        return
    for name in loss_types:
        spec = DPO_LOSSES[name]
        if spec.max_label_smoothing is None:
            smoothable = sorted(n for n, s in DPO_LOSSES.items() if s.max_label_smoothing is not None)
            raise ValueError(f"the {name!r} loss has no label-smoothed form; set label_smoothing=0 "
                             f"(losses with one: {smoothable})")
        top = spec.max_label_smoothing
        if label_smoothing > top or (label_smoothing == top and not spec.max_included):
            bound = f"<= {top}" if spec.max_included else f"< {top}"
            raise ValueError(f"the {name!r} loss needs 0 <= label_smoothing {bound}, got {label_smoothing}")


@DPO_LOSSES.register("sigmoid", max_label_smoothing=0.5)
def sigmoid_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0,
                 f_divergence: str = "reverse_kl", f_alpha: float = 1.0) -> Tensor:
    return _smoothed_logistic(beta * _margin(inp, f_divergence, f_alpha), label_smoothing)


@DPO_LOSSES.register("hinge")
def hinge_loss(inp: PreferenceInput, *, beta: float, f_divergence: str = "reverse_kl", f_alpha: float = 1.0) -> Tensor:
    return torch.relu(1 - beta * _margin(inp, f_divergence, f_alpha))


@DPO_LOSSES.register("ipo")
def ipo_loss(inp: PreferenceInput, *, beta: float, f_divergence: str = "reverse_kl", f_alpha: float = 1.0) -> Tensor:
    return (_margin(inp, f_divergence, f_alpha) - 1 / (2 * beta)) ** 2


@DPO_LOSSES.register("robust", max_label_smoothing=0.5, max_included=False)  # ε = 0.5 divides by 0
def robust_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0,
                f_divergence: str = "reverse_kl", f_alpha: float = 1.0) -> Tensor:
    z = beta * _margin(inp, f_divergence, f_alpha)
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


@DPO_LOSSES.register("exo_pair", max_label_smoothing=0.5)
def exo_pair_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0,
                  f_divergence: str = "reverse_kl", f_alpha: float = 1.0) -> Tensor:
    """KL(p_θ || p_label) from the model's pair distribution p_θ = (σ(βh), σ(-βh)) to the labels'
    (1 - ε, ε). A one-hot label makes the KL infinite, so ε = 0 is read as 1e-3 (TRL's convention)."""
    eps = label_smoothing or 1e-3
    z = beta * _margin(inp, f_divergence, f_alpha)
    p_w = torch.sigmoid(z)
    return p_w * (F.logsigmoid(z) - math.log(1 - eps)) + (1 - p_w) * (F.logsigmoid(-z) - math.log(eps))


@DPO_LOSSES.register("discopop")
def discopop_loss(inp: PreferenceInput, *, beta: float, discopop_tau: float = 0.05,
                  f_divergence: str = "reverse_kl", f_alpha: float = 1.0) -> Tensor:
    """Log-ratio modulated loss: the logistic loss for small z = βh, the exponential one for large z,
    blended by σ(z / τ)."""
    z = beta * _margin(inp, f_divergence, f_alpha)
    mix = torch.sigmoid(z / discopop_tau)
    return (1 - mix) * -F.logsigmoid(z) + mix * torch.exp(-z)


@DPO_LOSSES.register("aot", max_label_smoothing=0.5, per_quantile=True)
def aot_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """The policy's margins logp_w - logp_l should dominate the reference's in distribution over the
    batch: sort both and apply the (smoothed) logistic loss to the quantile differences. The (B,)
    result is one loss per quantile, not per pair; it depends on the whole (micro-)batch."""
    rho_w, rho_l = _log_ratios(inp)
    policy_margins = inp.chosen_logps - inp.rejected_logps
    ref_margins = policy_margins - (rho_w - rho_l)
    z = beta * (policy_margins.sort().values - ref_margins.sort().values)
    return _smoothed_logistic(z, label_smoothing)


@DPO_LOSSES.register("aot_unpaired", max_label_smoothing=0.5, per_quantile=True)
def aot_unpaired_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """The chosen log-ratios should dominate the rejected ones in distribution, whatever the pairing:
    sort each over the batch and apply the (smoothed) logistic loss to the quantile differences."""
    rho_w, rho_l = _log_ratios(inp)
    return _smoothed_logistic(beta * (rho_w.sort().values - rho_l.sort().values), label_smoothing)


@DPO_LOSSES.register("bco_pair")
def bco_pair_loss(inp: PreferenceInput, *, beta: float, delta: float | Tensor = 0.0) -> Tensor:
    rho_w, rho_l = _log_ratios(inp)
    return -F.logsigmoid(beta * rho_w - delta) - F.logsigmoid(-(beta * rho_l - delta))


@DPO_LOSSES.register("sppo_hard")
def sppo_hard_loss(inp: PreferenceInput, *, beta: float) -> Tensor:
    rho_w, rho_l = _log_ratios(inp)
    return (rho_w - 1 / (2 * beta)) ** 2 + (rho_l + 1 / (2 * beta)) ** 2


@DPO_LOSSES.register("nca_pair")
def nca_pair_loss(inp: PreferenceInput, *, beta: float) -> Tensor:
    rho_w, rho_l = _log_ratios(inp)
    r_w, r_l = beta * rho_w, beta * rho_l
    return -F.logsigmoid(r_w) - 0.5 * F.logsigmoid(-r_w) - 0.5 * F.logsigmoid(-r_l)


@DPO_LOSSES.register("apo_zero")
def apo_zero_loss(inp: PreferenceInput, *, beta: float) -> Tensor:
    # for data whose chosen answers beat the model: push chosen up, rejected down
    rho_w, rho_l = _log_ratios(inp)
    return 1 - torch.sigmoid(beta * rho_w) + torch.sigmoid(beta * rho_l)


@DPO_LOSSES.register("apo_down")
def apo_down_loss(inp: PreferenceInput, *, beta: float) -> Tensor:
    # for data whose chosen answers are worse than the model's: push both down, rejected more
    rho_w, rho_l = _log_ratios(inp)
    return 1 + torch.sigmoid(beta * rho_w) - torch.sigmoid(beta * (rho_w - rho_l))


def _per_token(logps: Tensor, lengths: Tensor | None, what: str) -> Tensor:
    if lengths is None:
        raise ValueError(f"{what} needs chosen_lengths and rejected_lengths (token counts)")
    return logps / lengths.clamp(min=1)


@DPO_LOSSES.register("sigmoid_norm", max_label_smoothing=0.5)
def sigmoid_norm_loss(inp: PreferenceInput, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """DPO on per-token log-ratios (length-normalised DPO, as in Tülu 3)."""
    rho_w, rho_l = _log_ratios(inp)
    h = _per_token(rho_w, inp.chosen_lengths, "sigmoid_norm") - _per_token(rho_l, inp.rejected_lengths, "sigmoid_norm")
    return _smoothed_logistic(beta * h, label_smoothing)


@DPO_LOSSES.register("simpo", reference_free=True, max_label_smoothing=0.5)
def simpo_loss(
    inp: PreferenceInput,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    gamma_beta_ratio: float = 0.5,
    simpo_gamma: float | None = None,
) -> Tensor:
    """γ is `simpo_gamma` when given, else `gamma_beta_ratio * beta` (the paper tunes γ/β)."""
    gamma = gamma_beta_ratio * beta if simpo_gamma is None else simpo_gamma
    avg_w = _per_token(inp.chosen_logps, inp.chosen_lengths, "simpo")
    avg_l = _per_token(inp.rejected_logps, inp.rejected_lengths, "simpo")
    return _smoothed_logistic(beta * (avg_w - avg_l) - gamma, label_smoothing)


@DPO_LOSSES.register("sft", reference_free=True)
def sft_loss(inp: PreferenceInput, *, beta: float) -> Tensor:
    """The chosen completion's negative log-likelihood per token (β unused), e.g. MPO's third term."""
    return -_per_token(inp.chosen_logps, inp.chosen_lengths, "sft")


def dpo_loss(
    inp: PreferenceInput,
    loss_type: str | Sequence[str],
    beta: float,
    label_smoothing: float = 0.0,
    loss_weights: Sequence[float] | None = None,
    **options,
) -> Tensor:
    """Per-example loss (B,): one loss type, or a weighted sum of several (e.g. MPO's
    ["sigmoid", "bco_pair", "sft"]). Each loss receives the options its signature names; an option
    no chosen loss accepts is an error, not silently ignored."""
    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(loss_types):
        raise ValueError(f"{len(loss_types)} loss types but {len(weights)} loss_weights")
    unknown = [name for name in loss_types if name not in DPO_LOSSES]
    if unknown:
        raise ValueError(f"unknown DPO loss type(s) {unknown}; choose from {sorted(DPO_LOSSES)}")
    check_label_smoothing(loss_types, label_smoothing)
    used: set[str] = set()
    total = 0.0
    for name, weight in zip(loss_types, weights):
        spec = DPO_LOSSES[name]
        own = {k: v for k, v in options.items() if k in spec.options}
        if spec.max_label_smoothing is not None:
            own["label_smoothing"] = label_smoothing
        used.update(own)
        total = total + weight * spec.fn(inp, beta=beta, **own)
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


def apo_zero_unpaired_loss(
    logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    kl: Tensor | float | None = None,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """APO-zero (D'Oosterlinck et al. 2024) on unpaired rows: desirable λ_D (1 - σ(βρ)), undesirable
    λ_U σ(βρ). No reference point, so `kl` is not read. Returns (losses (B,), detached βρ (B,))."""
    rewards = beta * (logps - ref_logps)  # (B,)
    losses = torch.where(labels.bool(), desirable_weight * (1 - torch.sigmoid(rewards)),
                         undesirable_weight * torch.sigmoid(rewards))
    return losses, rewards.detach()


@dataclass(frozen=True)
class UnpairedLoss:
    """A loss of unpaired rows, fn(logps, ref_logps, labels, kl, *, beta, desirable_weight,
    undesirable_weight) -> (losses (B,), rewards (B,)), and whether it reads the KL reference point."""

    fn: Callable[..., tuple[Tensor, Tensor]]
    uses_kl: bool


UNPAIRED_LOSSES = Registry("unpaired loss", UnpairedLoss)
UNPAIRED_LOSSES.add("kto", kto_loss, uses_kl=True)
UNPAIRED_LOSSES.add("apo_zero_unpaired", apo_zero_unpaired_loss, uses_kl=False)


def ld_token_weights(mask: Tensor, ld_alpha: float) -> Tensor:
    """LD-DPO (Liu et al. 2024, "Length Desensitization in Preference Optimization") token weights
    (2B, K): 1 on the first l_p = min(|y_w|, |y_l|) completion tokens of each pair, ld_alpha on the
    longer completion's tokens beyond them, 0 off the completion.

    mask: (2B, K) completion tokens of [chosen; rejected] rows, pair i in rows i and B + i."""
    mask = mask.to(torch.float64 if mask.dtype == torch.float64 else torch.float32)
    lengths = mask.sum(-1)
    B = lengths.shape[0] // 2
    public = torch.minimum(lengths[:B], lengths[B:]).repeat(2)  # (2B,)
    index = mask.cumsum(-1)  # 1-based position of each token within its completion
    return torch.where(index <= public[:, None], 1.0, ld_alpha) * mask


@torch.no_grad()
def wpo_weights(token_logps: Tensor, logits: Tensor, mask: Tensor) -> Tensor:
    """WPO (Zhou et al. 2024) pair weights (B,), detached: exp(w_w + w_l) capped at 1, with
    w = the per-token mean of log π(y_t) - log Σ_v π(v)^2 (the paper's aligned weight: a token
    the model would sample as surely as any scores 0).

    token_logps, mask: (2B, K) of [chosen; rejected] rows; logits: (2B, K, V) that scored them."""
    log_sq_mass = torch.logsumexp(2 * torch.log_softmax(logits.float(), -1), -1)  # (2B, K) log Σ π(v)^2
    mask = mask.float()
    per_row = ((token_logps.float() - log_sq_mass) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    B = per_row.shape[0] // 2
    return torch.exp(per_row[:B] + per_row[B:]).clamp(max=1.0)


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


def tied_pair_loss(inp: PreferenceInput, loss_type: str | Sequence[str], beta: float, **options) -> Tensor:
    """The loss (B,) of pairs that state no preference (tied scores), expected under a fair coin's label:
    ½ (loss(w ≻ l) + loss(l ≻ w)). For the sigmoid loss ½ (-log σ(βh) - log σ(-βh)), smallest at h = 0: a
    tie pulls the two completions' log-ratios together instead of pushing an arbitrary one up."""
    swapped = PreferenceInput(inp.rejected_logps, inp.chosen_logps, inp.ref_rejected_logps, inp.ref_chosen_logps,
                              inp.rejected_lengths, inp.chosen_lengths)
    return 0.5 * (dpo_loss(inp, loss_type, beta, **options) + dpo_loss(swapped, loss_type, beta, **options))


def xpo_exploration(ref_sample_logps: Tensor, alpha: float) -> Tensor:
    """XPO's exploration term (Xie et al. 2024, "Exploratory Preference Optimization"), added to the DPO loss of
    each pair: α log π(ỹ|x), ỹ the reference policy's sample (B,). Minimising it lowers the policy's likelihood of
    what the reference would say, pushing it to explore beyond the reference's support."""
    return alpha * ref_sample_logps


def nash_md_loss(logps: Tensor, ref_logps: Tensor, mask: Tensor, probability: Tensor, beta: float) -> Tensor:
    """Nash-MD's loss per completion (B,) (Munos et al. 2023, "Nash Learning from Human Feedback"), on the
    policy's sample y with P = P(y beats y'), y' the geometric mixture's sample:

        -(P - 0.5) Σ_t log π(y_t) + β Σ_t sg(log π(y_t) - log π_ref(y_t)) log π(y_t)

    a REINFORCE estimate of the preference (0.5 the control variate) and of the KL to the reference (the
    per-token log-ratio as its reward). logps, ref_logps, mask (B, T); probability (B,), no gradient."""
    mask = mask.bool()
    logps = torch.where(mask, logps, 0.0)
    log_ratio = torch.where(mask, logps - ref_logps, 0.0).detach()
    score = (probability.detach() - 0.5) * logps.sum(-1)
    return beta * (log_ratio * logps).sum(-1) - score
