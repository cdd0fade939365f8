"""Masked reductions and loss aggregation.

Every per-token quantity in posttrain lives in a padded `(B, T)` tensor next to a 0/1 mask.
These helpers reduce over the masked entries only. Padding is selected away with
`torch.where`, not multiplied by zero, so a NaN or inf on a padded position cannot leak in.

`aggregate_loss` turns a per-token loss into the scalar that is backpropagated. The modes
follow the names used in the literature (token mean as in DAPO, Yu et al. 2025; sequence mean
as in the original GRPO, Shao et al. 2024; the fixed-length normaliser of Dr. GRPO, Liu et al.
2025). Each takes an optional `denominator` so that a caller can pass one global count,
summed over gradient-accumulation micro-batches and processes; then summing the results of the
micro-batches gives the same number as computing the whole batch at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from posttrain.core.registry import Registry

WHITEN_EPS = 1e-8


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    # x, mask: same shape; dim None reduces everything to a scalar
    picked = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked entries. An all-padding row (or batch) gives 0, not NaN."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all masked entries (a scalar).

    With `unbiased`, Bessel's correction n / (n - 1) is applied; a single masked entry gives
    variance 0 rather than a division by zero.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.to(x.dtype).sum()
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries; 0 on padding.

    With `shift_mean=False` the mean is added back: only the scale changes, which keeps the
    sign of e.g. a mostly-positive advantage.
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


# --- loss aggregation --------------------------------------------------------------------
# Each mode is `fn(per_token (B, T), mask (B, T), denominator) -> scalar`: the masked numerator
# divided by `denominator`. Its registration names what that denominator counts,
# `count(mask (B, T), max_length) -> scalar`: aggregate_loss uses this batch's count, and a
# caller that splits a batch sums the counts of all its micro-batches (and processes) instead.


@dataclass(frozen=True)
class Aggregation:
    """A registered loss aggregation and what its denominator counts."""

    fn: Callable[[Tensor, Tensor, Tensor | float], Tensor]
    count: Callable[[Tensor, int | None], Tensor]  # count(mask, max_length): the denominator of `mask`'s rows


AGGREGATIONS = Registry("loss aggregation", Aggregation)


def register_aggregation(name: str, *, count: Callable[[Tensor, int | None], Tensor]):
    """Register `fn` as aggregation mode `name`, dividing by `count(mask, max_length)` (required: the
    denominator is the fact that keeps micro-batches and processes summing to the whole batch)."""
    if not callable(count):
        raise TypeError(f"register_aggregation({name!r}): count must be a function (mask, max_length) -> the "
                        f"denominator, got {count!r}")

    return AGGREGATIONS.register(name, count=count)


def count_tokens(mask: Tensor, max_length: int | None = None) -> Tensor:
    """The number of masked tokens."""
    return mask.sum()


def count_sequences(mask: Tensor, max_length: int | None = None) -> Tensor:
    """The number of sequences: rows with no masked token are batch padding, not sequences."""
    return (mask.sum(-1) > 0).sum()


def count_rows_times_max_length(mask: Tensor, max_length: int | None) -> Tensor:
    """rows * max_length: a constant per row, whatever its length (Dr. GRPO's normaliser)."""
    if max_length is None:
        raise ValueError("an aggregation dividing by rows * max_length (e.g. seq_mean_token_sum_norm) needs "
                         "max_length (the generation budget), or an explicit denominator")
    return torch.tensor(mask.shape[0] * max_length, device=mask.device)


@register_aggregation("token_mean", count=count_tokens)
def _token_mean(per_token, mask, denominator):
    # Every token in the (global) batch weighs the same.
    return masked_sum(per_token, mask) / denominator


@register_aggregation("seq_mean_token_mean", count=count_sequences)
def _seq_mean_token_mean(per_token, mask, denominator):
    # Every sequence weighs the same, tokens weigh the same within a sequence.
    return masked_mean(per_token, mask, dim=-1).sum() / denominator


@register_aggregation("seq_mean_token_sum", count=count_sequences)
def _seq_mean_token_sum(per_token, mask, denominator):
    # Longer sequences weigh more: each contributes its token sum.
    return masked_sum(per_token, mask, dim=-1).sum() / denominator


@register_aggregation("seq_mean_token_sum_norm", count=count_rows_times_max_length)
def _seq_mean_token_sum_norm(per_token, mask, denominator):
    # Dr. GRPO: a constant normaliser, so no sequence-length bias enters the gradient.
    return masked_sum(per_token, mask) / denominator


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: str,
    denominator: float | Tensor | None = None,
    max_length: int | None = None,
) -> Tensor:
    """Reduce a per-token loss `(B, T)` to a scalar.

    `denominator` is what the summed numerator is divided by; by default the mode's registered
    count of this batch, `AGGREGATIONS[mode].count(mask, max_length)` (at least 1): masked tokens
    for "token_mean", non-empty rows for "seq_mean_token_mean" (each sequence contributing its
    token mean) and "seq_mean_token_sum" (its token sum), rows * max_length for
    "seq_mean_token_sum_norm" (`max_length` is then required). To make a result independent of how the batch is split, pass the count over the whole
    optimizer step (all micro-batches, all processes) and sum the micro-batch results.
    DDP averages gradients over its N processes, so a caller that wants the global mean
    passes that global count divided by N.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose from {sorted(AGGREGATIONS)}")
    aggregation = AGGREGATIONS[mode]
    if denominator is None:
        denominator = aggregation.count(mask, max_length).clamp(min=1)
    return aggregation.fn(per_token, mask, denominator)


def shared_prefix_attention_mask(segment: Tensor, valid: Tensor, additive_dtype: torch.dtype | None = None) -> Tensor:
    """4D attention mask (U, 1, L, L) for sequences that pack a shared prefix and several blocks.

    segment (U, L): 0 for the shared prefix (a prompt), b >= 1 for the tokens of block b (one
    completion each); valid (U, L): real tokens. Query q sees key j when j <= q, j is real, and j
    is in the prefix or in q's own block; every position sees itself (so padding rows stay finite).
    Boolean (sdpa), or with `additive_dtype` 0 / finfo.min to add to the scores (eager attention).
    """
    L = segment.shape[1]
    col = torch.arange(L, device=segment.device)
    causal = col[None, :] <= col[:, None]  # (L, L) query x key
    seg_q, seg_k = segment[:, :, None], segment[:, None, :]
    allowed = causal[None] & valid[:, None, :] & ((seg_k == 0) | (seg_k == seg_q))
    allowed = (allowed | torch.eye(L, dtype=torch.bool, device=segment.device)[None])[:, None]
    if additive_dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=additive_dtype, device=segment.device).masked_fill_(
        ~allowed, torch.finfo(additive_dtype).min)


def top_quantile_mask(x: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """The masked entries of x (B, T) at or above the (1 - quantile) quantile of the masked entries:
    the top `quantile` share, e.g. the highest-entropy 20% of tokens with 0.2 ("Beyond the 80/20 Rule",
    Wang et al. 2025). quantile 1.0 keeps every masked entry. Returns a (B, T) 0/1 mask like `mask`."""
    keep = mask.bool()
    if quantile >= 1.0 or not keep.any():
        return mask
    threshold = torch.quantile(x[keep].float(), 1.0 - quantile)
    return (keep & (x >= threshold)).to(mask.dtype)
