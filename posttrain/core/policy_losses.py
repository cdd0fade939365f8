"""Per-token policy-gradient losses and the clipped value loss.

  clipped    PPO's clipped surrogate (Schulman et al. 2017), with the asymmetric clip range
             of DAPO (Yu et al. 2025: `epsilon_high` > `epsilon`) and the sequence-level
             importance ratio of GSPO (Zheng et al. 2025).
  reinforce  the plain policy gradient: -A * π/π_old, no clipping (REINFORCE, Williams
             1992; used by RLOO and REINFORCE++ when each batch is used for one step).

Every loss has one signature, `fn(logp, old_logp, advantages, mask, **options)`, and returns
`(per_token_loss (B, T), stats)`; aggregation over tokens is `masked.aggregate_loss`'s job.
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

from typing import Callable

import torch
from torch import Tensor

from posttrain.core.masked import masked_mean


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """log π/π_old per token (B, T), 0 on padding; "sequence" gives GSPO-token's ratio."""
    token_log_ratio = torch.where(mask.bool(), logp - old_logp, 0.0)  # (B, T)
    if level == "token":
        return token_log_ratio
    if level == "sequence":
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


def clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    importance_sampling_level: str = "token",
) -> tuple[Tensor, dict]:
    """-min(ρ A, clip(ρ, 1 - ε, 1 + ε_high) A) per token; ε_high defaults to ε.

    logp, old_logp, advantages, mask: (B, T). `clipped` marks tokens where the clipped term
    is the smaller one, i.e. where the token gives no gradient.
    """
    eps_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(_log_ratio(logp, old_logp, mask, importance_sampling_level))  # (B, T)
    unclipped_loss = -ratio * advantages
    clipped_loss = -torch.clamp(ratio, 1.0 - epsilon, 1.0 + eps_high) * advantages
    per_token = torch.where(mask.bool(), torch.maximum(unclipped_loss, clipped_loss), 0.0)
    return per_token, _stats(ratio, clipped_loss > unclipped_loss, logp, old_logp, mask)


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


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict]]] = {
    "clipped": clipped_surrogate,
    "reinforce": reinforce,
}


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
