"""Per-token policy-gradient losses and the clipped value loss.

  clipped    PPO's clipped surrogate (Schulman et al. 2017), with the asymmetric clip range
             of DAPO (Yu et al. 2025: `epsilon_high` > `epsilon`) and the sequence-level
             importance ratio of GSPO (Zheng et al. 2025).
  reinforce  the plain policy gradient: -A * π/π_old, no clipping (REINFORCE, Williams
             1992; used by RLOO and REINFORCE++ when each batch is used for one step).
  cispo      CISPO (MiniMax-M1, MiniMax 2025): -sg(min(ρ, 1 + ε_high)) A log π. The clipped
             importance weight is detached, so every token keeps a gradient (none is dropped
             by the clip, unlike PPO); only the upper bound is applied, as in the paper's setup
             (ε_low large).
  sapo       SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization"): -f(ρ) A with the
             smooth gate f(ρ) = (4/τ) σ(τ (ρ - 1)) in place of the hard clip; τ = τ_pos for
             A > 0 and τ_neg for A <= 0. f'(1) = 1, so at ρ = 1 the gradient is the policy
             gradient's; far from 1 it fades instead of stopping.
  luspo      LUSPO (Liu et al. 2026, "Length-Unbiased Sequence Policy Optimization"): GSPO's
             clipped sequence-ratio surrogate with each sequence's loss scaled by its length |o_i|,
             which removes GSPO's bias towards short responses. Here: the GSPO-token loss per token,
             aggregated by "seq_mean_token_sum" (each sequence's token sum = |o_i| x its token mean);
             `loss_type="luspo"` sets both.
  vespo      VESPO (Shen et al. 2026, "Variational Sequence-level Soft Policy Optimization"):
             -sg(φ(W)) A log π, W = π(o)/π_old(o) the whole completion's importance ratio (a product
             over its tokens: no length normalisation) and φ(W) = W^k exp(λ (1 - W)), a gamma-shaped
             kernel with φ(1) = 1 that fades stale samples smoothly; (k, λ) are set apart for
             A >= 0 and A < 0. Token mean, as TRL aggregates it.

  gmpo       GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"): -A Π_t ρ_t^(1/|o|), the
             geometric mean of the token ratios, each clipped in log space to [-ε, ε_high] on the side
             its advantage would push (PPO's pessimistic min, in log space): much less sensitive to one
             outlier ratio than the arithmetic mean, so a wider range (ε = 0.4, e^±0.4) is the default of
             GMPOConfig. In token form, as GSPO-token: averaged per sequence ("seq_mean_token_mean";
             `loss_type="gmpo"` sets both) its gradient is the paper's.
  dppo       DPPO (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning"): the trust region
             is a divergence between the current and the sampling policy at each token instead of a ratio clip:
             -sg(min(ρ, clip_ratio_c)) A log π, with a token left out where its divergence D exceeds ε_high and
             π > π_old while A > 0, or exceeds ε while π < π_old and A <= 0 (moving further out of the region).
             D is "binary_tv" |π - π_old| or "binary_kl" the Bernoulli KL(π_old || π) of the sampled token's
             probability. Token mean (TRL requires loss_type "dapo").

CISPO's, SAPO's, DPPO's and VESPO's values are shifted by a constant (no gradient) so that, as for the others, a
token sampled by the current policy (ρ = 1) has loss -A: CISPO -sg(w) A (1 + log π - sg(log π)), SAPO
-(f(ρ) - f(1) + 1) A, VESPO -sg(φ(W)) A (1 + log π - sg(log π)). Gradients are the papers'; only the logged loss reads on one scale.

`delta` (INTELLECT-2, Prime Intellect 2025) bounds the clipped surrogate's ratio from above
also where the advantage is negative (there PPO's clip leaves ρ unbounded): ρ -> min(ρ, δ).

Every loss has one signature, `fn(logp, old_logp, advantages, mask, *, options)` (each option read
from the config field of its name), and returns `(per_token_loss (B, T), stats)`; aggregation over
tokens is `masked.aggregate_loss`'s job. `register_policy_loss` records the aggregation a loss's
paper uses, if any: such a loss is also a `loss_type` of its name (online_config derives them).
The stats are detached and per token: `ratio` (B, T), `clipped` (B, T bool, False on
padding), `approx_kl` (B, T) = 0.5 (log π - log π_old)^2.

Departure: the log-ratio is set to 0 on padding before exponentiating, so garbage log-probs
on padded positions cannot make inf * 0 = NaN in the backward pass.

GSPO: the paper's sequence ratio is s_i = exp(mean_t log π/π_old). We use its "GSPO-token"
form: every token of sequence i carries the value s_i but the gradient of its own log π,
log s_{i,t} = sg[log s_i] + log π_t - sg[log π_t]. With a sequence-level advantage and
"seq_mean_token_mean" aggregation the gradient equals GSPO's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from posttrain.core.importance import IMPORTANCE_CORRECTIONS
from posttrain.core.masked import AGGREGATIONS, masked_mean
from posttrain.core.registry import Registry


PolicyLossFn = Callable[..., tuple[Tensor, dict]]


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss and the facts the config reads from it."""

    fn: PolicyLossFn  # fn(logp, old_logp, advantages, mask, **options) -> (per_token_loss (B, T), stats)
    # the aggregation the loss's paper uses, or None: any. A loss with one is also a `loss_type` of its
    # name that sets both (TRL's convention: loss_type="cispo" is CISPO with the token mean).
    aggregation: str | None
    options: tuple[str, ...]  # fn's keyword-only parameters, each read from the config field of that name


POLICY_LOSSES = Registry("policy loss", PolicyLoss, positional=("logp", "old_logp", "advantages", "mask"))
# The options of the losses below: each is the config field of its name (OnlineConfig), checked against its bound.
POLICY_LOSSES.option("epsilon", 0.2, "Clip range of the importance ratio (>= 0).", bound=(0, None),
                     what="a clip range of the importance ratio")
POLICY_LOSSES.option("epsilon_high", None, "Upper clip range (DAPO, >= 0); None: epsilon.", bound=(0, None),
                     what="a clip range of the importance ratio")
POLICY_LOSSES.option("sapo_temperature_pos", 1.0, "SAPO's gate temperature for positive advantages (loss_type 'sapo').")
POLICY_LOSSES.option("sapo_temperature_neg", 1.05, "SAPO's gate temperature for other advantages (loss_type 'sapo').")
# a negative VESPO rate would grow phi without bound as W grows
POLICY_LOSSES.option("vespo_k_pos", 2.0, "VESPO's shape k of the kernel phi(W) = W^k exp(lambda (1 - W)) on the "
                     "sequence ratio W, for advantages >= 0 (loss_type 'vespo').", bound=(0, None))
POLICY_LOSSES.option("vespo_lambda_pos", 3.0, "VESPO's rate lambda for advantages >= 0.", bound=(0, None))
POLICY_LOSSES.option("vespo_k_neg", 3.0, "VESPO's shape k for negative advantages.", bound=(0, None))
POLICY_LOSSES.option("vespo_lambda_neg", 2.0, "VESPO's rate lambda for negative advantages.", bound=(0, None))
POLICY_LOSSES.option("divergence_type", "binary_tv", "DPPO's divergence for its trust region: 'binary_tv' "
                     "(|pi - pi_old| of the sampled token) or 'binary_kl' (the Bernoulli KL of that probability).")
POLICY_LOSSES.option("clip_ratio_c", 20.0, "DPPO's cap on the detached importance ratio, clamped to [0, clip_ratio_c] "
                     "(> 0).", bound=(0, None), what="a cap of the importance ratio")


def register_policy_loss(name: str, *, aggregation: str | None) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register `fn` as policy loss `name`; `aggregation` (a core.masked mode, or None) must be given."""
    if aggregation is not None and aggregation not in AGGREGATIONS:
        raise ValueError(f"register_policy_loss({name!r}): aggregation={aggregation!r} is not a loss "
                         f"aggregation; choose from {sorted(AGGREGATIONS)} or None")

    return POLICY_LOSSES.register(name, aggregation=aggregation)


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """log π/π_old per token (B, T), 0 on padding; "sequence" gives GSPO-token's ratio."""
    token_log_ratio = torch.where(mask.bool(), logp - old_logp, 0.0)  # (B, T)
    if level == "token":
        return token_log_ratio
    if level in ("sequence", "sequence_token"):  # TRL's GSPO-token name is "sequence_token"
        seq_log_ratio = masked_mean(token_log_ratio, mask, dim=-1)  # (B,)
        log_ratio = logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)
        return torch.where(mask.bool(), log_ratio, 0.0)
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', not {level!r}")


def _stats(ratio: Tensor, clipped: Tensor, logp: Tensor, old_logp: Tensor, mask: Tensor) -> dict:
    mask = mask.bool()
    return {
        "ratio": ratio.detach(),  # (B, T)
        "clipped": clipped & mask,  # (B, T) bool
        "approx_kl": torch.where(mask, 0.5 * (logp - old_logp).detach() ** 2, 0.0),  # (B, T)
    }


@register_policy_loss("clipped", aggregation=None)
def clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
    delta: float | None = None,
) -> tuple[Tensor, dict]:
    """-min(ρ' A, clip(ρ, 1 - ε, 1 + ε_high) A) per token, ρ' = min(ρ, δ) (ρ' = ρ without δ);
    ε_high defaults to ε.

    logp, old_logp, advantages, mask: (B, T). `clipped` marks tokens where the clipped term
    is the smaller one, i.e. where the token gives no gradient.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, importance_sampling_level))  # (B, T)
    unclipped_loss = -(ratio if delta is None else torch.clamp(ratio, max=delta)) * advantages
    clipped_loss = -torch.clamp(ratio, 1.0 - epsilon, 1.0 + eps_high) * advantages
    per_token = torch.where(mask.bool(), torch.maximum(unclipped_loss, clipped_loss), 0.0)
    return per_token, _stats(ratio, clipped_loss > unclipped_loss, logp, old_logp, mask)


@register_policy_loss("reinforce", aggregation=None)
def reinforce(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    importance_sampling_level: str = "token",
) -> tuple[Tensor, dict]:
    """-A ρ per token, ρ = π/π_old unclipped. At ρ = 1 its gradient is -A ∇log π."""
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, importance_sampling_level))  # (B, T)
    per_token = torch.where(mask.bool(), -advantages * ratio, 0.0)
    return per_token, _stats(ratio, torch.zeros_like(mask, dtype=torch.bool), logp, old_logp, mask)


@register_policy_loss("cispo", aggregation="token_mean")
def cispo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon_high: float | None = None,
    epsilon: float = 0.2,
    importance_sampling_level: str = "token",
) -> tuple[Tensor, dict]:
    """-sg(min(ρ, 1 + ε_high)) A log π per token; ε_high defaults to ε. `clipped` marks tokens whose
    weight was capped (they still give a gradient, of a smaller weight)."""
    cap = 1.0 + (epsilon if epsilon_high is None else epsilon_high)
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, importance_sampling_level))  # (B, T)
    weight = torch.clamp(ratio, max=cap).detach()
    log_pi = 1.0 + logp - logp.detach()  # log π up to a constant: value 1, gradient ∇log π
    per_token = torch.where(mask.bool(), -weight * advantages * log_pi, 0.0)
    return per_token, _stats(ratio, ratio.detach() > cap, logp, old_logp, mask)


@register_policy_loss("sapo", aggregation="token_mean")
def sapo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    importance_sampling_level: str = "token",
) -> tuple[Tensor, dict]:
    """-(4/τ) σ(τ (ρ - 1)) A per token, τ = sapo_temperature_pos where A > 0, else sapo_temperature_neg.
    No token is clipped: `clipped` is all False."""
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, importance_sampling_level))  # (B, T)
    tau = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
    gate = (torch.sigmoid(tau * (ratio - 1.0)) - 0.5) * 4.0 / tau + 1.0  # f(ρ) - f(1) + 1
    per_token = torch.where(mask.bool(), -gate * advantages, 0.0)
    return per_token, _stats(ratio, torch.zeros_like(mask, dtype=torch.bool), logp, old_logp, mask)


@register_policy_loss("luspo", aggregation="seq_mean_token_sum")
def luspo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
) -> tuple[Tensor, dict]:
    """GSPO's clipped loss with the sequence ratio at every token (its length scaling is the aggregation's:
    summed over the sequence's tokens, not averaged)."""
    return clipped_surrogate(logp, old_logp, advantages, mask, epsilon=epsilon, epsilon_high=epsilon_high,
                             importance_sampling_level="sequence", delta=delta)


@register_policy_loss("vespo", aggregation="token_mean")
def vespo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> tuple[Tensor, dict]:
    """-sg(φ(W)) A log π per token, log W = Σ_t log π/π_old over the completion's tokens and
    φ(W) = W^k exp(λ (1 - W)); (k, λ) = (vespo_k_pos, vespo_lambda_pos) where A >= 0, else the _neg pair
    (A is one number per sequence in GRPO; a per-token advantage picks per token). No token is clipped."""
    log_ratio = _log_ratio(logp, old_logp, mask, "token")  # (B, T), 0 on padding
    log_w = log_ratio.sum(-1, keepdim=True).detach().clamp(-20.0, 20.0)  # (B, 1); exp stays finite
    positive = advantages >= 0
    k = torch.where(positive, vespo_k_pos, vespo_k_neg)
    lam = torch.where(positive, vespo_lambda_pos, vespo_lambda_neg)
    phi = torch.exp(k * log_w + lam * (1.0 - torch.exp(log_w)))  # (B, T) φ(W), 1 at W = 1
    log_pi = 1.0 + logp - logp.detach()  # log π up to a constant: value 1, gradient ∇log π
    per_token = torch.where(mask.bool(), -phi * advantages * log_pi, 0.0)
    return per_token, _stats(torch.exp(log_ratio), torch.zeros_like(mask, dtype=torch.bool), logp, old_logp, mask)


DPPO_DIVERGENCES = ("binary_tv", "binary_kl")


def binary_divergence(logp: Tensor, old_logp: Tensor, divergence_type: str) -> Tensor:
    """DPPO's per-token divergence (B, T) between the sampling policy's and the current policy's probability of the
    sampled token, each read as a Bernoulli: |p - q|, or q log(q/p) + (1 - q) log((1 - q)/(1 - p)), q = π_old."""
    p, q = torch.exp(logp), torch.exp(old_logp)
    if divergence_type == "binary_tv":
        return (p - q).abs()
    if divergence_type == "binary_kl":
        top = 1 - 1e-7  # log(1 - p) stays finite for a token of probability 1
        return q * (old_logp - logp) + (1 - q) * (torch.log1p(-q.clamp(max=top)) - torch.log1p(-p.clamp(max=top)))
    raise ValueError(f"divergence_type must be one of {DPPO_DIVERGENCES}, got {divergence_type!r}")


@register_policy_loss("dppo", aggregation="token_mean")
def dppo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.15,
    epsilon_high: float | None = None,
    divergence_type: str = "binary_tv",
    clip_ratio_c: float = 20.0,
) -> tuple[Tensor, dict]:
    """-sg(min(ρ, clip_ratio_c)) A log π per token, 0 where the token left DPPO's trust region: its divergence
    (`binary_divergence`) above ε_high (default ε) with π > π_old and A > 0, or above ε with π < π_old and A <= 0.
    `clipped` marks the tokens left out."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = _log_ratio(logp, old_logp, mask, "token")  # (B, T), 0 on padding
    with torch.no_grad():
        divergence = binary_divergence(logp, old_logp, divergence_type)
        up, down = log_ratio > 0, log_ratio < 0
        left = torch.where(advantages > 0, (divergence > eps_high) & up, (divergence > epsilon) & down)
        weight = torch.exp(log_ratio.clamp(max=math.log(clip_ratio_c)))
    log_pi = 1.0 + logp - logp.detach()  # log π up to a constant: value 1, gradient ∇log π
    per_token = torch.where(mask.bool() & ~left, -weight * advantages * log_pi, 0.0)
    return per_token, _stats(torch.exp(log_ratio), left, logp, old_logp, mask)


@register_policy_loss("gmpo", aggregation="seq_mean_token_mean")
def gmpo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.4,
    epsilon_high: float | None = None,
) -> tuple[Tensor, dict]:
    """-A g per token, g = exp(mean_t clip'(log ρ_t)) the sequence's clipped geometric-mean ratio: clip' bounds log ρ_t
    to [-ε, ε_high] (ε_high defaults to ε) only where that lowers the objective (above for A > 0, below for A < 0).
    Token form: the gradient of token t's loss is -A g ∇clip'(log ρ_t), so the sequence mean's gradient is GMPO's
    for a sequence-level advantage. `clipped` marks the tokens held at a bound (they give no gradient)."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = _log_ratio(logp, old_logp, mask, "token")  # (B, T), 0 on padding
    bounded = torch.clamp(log_ratio, -epsilon, eps_high)
    positive = advantages > 0
    clipped_log_ratio = torch.where(positive, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
    geometric = torch.exp(masked_mean(clipped_log_ratio, mask, dim=-1)).detach().unsqueeze(-1)  # (B, 1)
    # the token form (as GSPO-token): each token carries the sequence's value -A g and the gradient of its own
    # clipped log-ratio, -A g ∇clip'(log ρ_t); averaged over the sequence it is ∇(-A g) for a sequence-level A
    own = torch.exp(clipped_log_ratio - clipped_log_ratio.detach())
    per_token = torch.where(mask.bool(), -advantages * geometric * own, 0.0)
    held = torch.where(positive, log_ratio > eps_high, (log_ratio < -epsilon) & (advantages < 0))
    return per_token, _stats(torch.exp(log_ratio), held, logp, old_logp, mask)


def entropy_bonus(logp: Tensor, entropy: Tensor, ratio: Tensor | None = None) -> Tensor:
    """A per-token surrogate whose value is the entropy H_t and whose gradient, in expectation over
    the sampled token a ~ π, is ∇H_t: H_t - sg(log π(a) + H_t) (log π(a) - sg(log π(a))), as
    ∇H = -E_a[(log π(a) + H) ∇log π(a)] (the score-function form; + H is a baseline).

    logp (B, T) with gradient; entropy (B, T) exact over the vocabulary, without gradient (the fused
    log-softmax gives none); ratio (B, T) π/π_old reweights tokens sampled from an older policy.
    Departure: TRL differentiates the exact entropy through the logits; this estimate is unbiased
    and avoids materialising the (B, T, V) logits with a gradient.
    """
    entropy = entropy.detach()
    score = -(logp.detach() + entropy) * (logp - logp.detach())
    if ratio is not None:
        score = score * ratio.detach()
    return entropy + score


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    cliprange_value: float = 0.2,
) -> tuple[Tensor, Tensor]:
    """PPO's value loss: 0.5 max((V - R)^2, (clip(V, V_old ± c) - R)^2) per token.

    values, old_values, returns, mask: (B, T). Returns the per-token loss (B, T), 0 on
    padding, and a (B, T) bool marking where the clipped branch was the larger.
    """
    c = cliprange_value
    clipped_values = old_values + torch.clamp(values - old_values, -c, c)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    per_token = torch.where(mask.bool(), 0.5 * torch.maximum(loss_unclipped, loss_clipped), 0.0)
    clipfrac = (loss_clipped > loss_unclipped) & mask.bool()
    return per_token, clipfrac


def a2po_regression_loss(logps: Tensor, ref_logps: Tensor, advantages: Tensor, beta2: float) -> Tensor:
    """A*-PO's stage-2 loss per completion (B,) (Brantley et al. 2025, "Accelerating RL for LLM Reasoning with
    Optimal Advantage Regression"): (β2 log π(y|x)/π_ref(y|x) - A)^2, the implicit reward regressed onto the
    optimal advantage A = r - V*(x). logps, ref_logps: (B,) sums over the completion's tokens."""
    return (beta2 * (logps - ref_logps) - advantages) ** 2


def truncated_importance_weights(old_logp: Tensor, vllm_logp: Tensor, cap: float) -> Tensor:
    """min(pi_old / pi_vllm, cap) per token (B, T): TRL's `token_truncate` correction of
    `core.importance.IMPORTANCE_CORRECTIONS` on every position (no mask, no lower bound). No gradient flows
    through it."""
    return IMPORTANCE_CORRECTIONS["token_truncate"].fn(old_logp, vllm_logp, torch.ones_like(old_logp), None, cap)
