"""Log-probabilities from logits, without a full log-softmax copy: the pure tensor math under
`posttrain.forward` (which asks the model for hidden states or logits and calls these).

Log-softmax is never materialised as a full float32 (B, T, V) copy: we gather the chosen logit and
subtract a log-sum-exp computed a few rows at a time, and the backward writes its gradient chunk by
chunk into one tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ROWS = 1024  # rows of (V,) logits processed at once; bounds the temporary to CHUNK_ROWS * V floats


def selective_log_softmax(logits: Tensor, index: Tensor, chunk_rows: int = CHUNK_ROWS) -> Tensor:
    """log softmax(logits)[..., index] without a full log-softmax copy.

    logits: (..., V); index: (...) token ids. Returns (...) in float32 (or float64 for float64 logits).
    The gradient, one_hot(index) - softmax per row, is written chunk by chunk into one tensor the
    shape of `logits` (autograd through logsumexp + gather would build several).
    """
    if logits.requires_grad and torch.is_grad_enabled():
        return _SelectiveLogSoftmax.apply(logits, index, chunk_rows, False)[0]
    return _selective_log_softmax(logits, index, chunk_rows, False)[0]


def selective_log_softmax_stats(logits: Tensor, index: Tensor, chunk_rows: int = CHUNK_ROWS):
    """(log-probs as `selective_log_softmax`, entropy, argmax), all shaped like `index`, in one pass.

    Entropy and argmax are metrics (no gradient); getting them from the same pass over the
    logits costs a fraction of separate `entropy_from_logits` and `argmax` calls.
    """
    if logits.requires_grad and torch.is_grad_enabled():
        logps, entropy, argmax = _SelectiveLogSoftmax.apply(logits, index, chunk_rows, True)
    else:
        logps, _, entropy, argmax = _selective_log_softmax(logits, index, chunk_rows, True)
    return logps, entropy, argmax


def _selective_log_softmax(logits: Tensor, index: Tensor, chunk_rows: int, stats: bool):
    """(log-probs of `index`, log-sum-exp, entropy or None, argmax or None) per row, shaped like `index`."""
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    flat = logits.detach().reshape(-1, logits.shape[-1])
    n = flat.shape[0]
    lse = torch.empty(n, dtype=out_dtype, device=logits.device)
    entropy = torch.empty(n, dtype=out_dtype, device=logits.device) if stats else None
    argmax = torch.empty(n, dtype=torch.long, device=logits.device) if stats else None
    for start in range(0, n, chunk_rows):
        rows, part = flat[start:start + chunk_rows].to(out_dtype), slice(start, start + chunk_rows)
        if not stats:
            lse[part] = torch.logsumexp(rows, dim=-1)
            continue
        top, argmax[part] = rows.max(dim=-1)
        shifted = rows - top[:, None]
        weights = shifted.exp()
        total = weights.sum(-1)
        lse[part] = top + total.log()
        # H = log Z - E_p[x - max], with Z = sum exp(x - max)
        entropy[part] = total.log() - torch.linalg.vecdot(weights, shifted) / total
    chosen = flat.gather(-1, index.reshape(-1, 1)).squeeze(-1).to(out_dtype)
    shape = index.shape
    return ((chosen - lse).view(shape), lse.view(shape), entropy.view(shape) if stats else None,
            argmax.view(shape) if stats else None)


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, index, chunk_rows, stats):
        logps, lse, entropy, argmax = _selective_log_softmax(logits, index, chunk_rows, stats)
        ctx.save_for_backward(logits, index, lse)
        ctx.chunk_rows = chunk_rows
        if not stats:
            return logps, None, None
        ctx.mark_non_differentiable(entropy, argmax)
        return logps, entropy, argmax

    @staticmethod
    def backward(ctx, grad, *unused):
        logits, index, lse = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        idx, lse, g = index.reshape(-1, 1), lse.reshape(-1, 1), grad.reshape(-1, 1).to(lse.dtype)
        out = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            # d logp[i] / d logits[j] = 1[j == index] - softmax[j]
            if out.dtype == lse.dtype:  # write straight into the gradient: no temporary
                chunk = torch.sub(flat[rows], lse[rows], out=out[rows])
            else:  # bf16/fp16 logits: an explicit float32 copy, then in place (faster than a mixed-dtype sub)
                chunk = flat[rows].to(lse.dtype).sub_(lse[rows])
            chunk.exp_().mul_(-g[rows]).scatter_add_(1, idx[rows], g[rows])
            if chunk.data_ptr() != out[rows].data_ptr():
                out[rows] = chunk
        return out.view_as(logits), None, None, None


def entropy_from_logits(logits: Tensor, chunk_rows: int = CHUNK_ROWS) -> Tensor:
    """Entropy of softmax(logits) over the last dim, chunked. (..., V) -> (...)."""
    out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    flat = logits.reshape(-1, logits.shape[-1])
    pieces = []
    for start in range(0, flat.shape[0], chunk_rows):
        rows = flat[start:start + chunk_rows].to(out_dtype)
        logp = torch.log_softmax(rows, dim=-1)
        pieces.append(-(logp.exp() * logp).sum(-1))
    if not pieces:
        return logits.new_zeros(logits.shape[:-1], dtype=out_dtype)
    return torch.cat(pieces).view(logits.shape[:-1])


def sequence_logprobs(token_logps: Tensor, mask: Tensor) -> Tensor:
    """Sum of token log-probs over the masked tokens of each row. (B, T) -> (B,)."""
    return (token_logps * mask).sum(-1)


def length_groups(lengths: list[int], per_forward: int) -> list[list[int]]:
    """Rows split into groups, each to be padded to its own longest row, that minimise the padded
    tokens plus `per_forward` tokens' worth of cost per forward pass (exact, over groups of rows
    adjacent in length order). Each group lists row indices in ascending order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)  # best[j]: cost of the j longest rows
    for j in range(1, n + 1):
        for i in range(j):  # the last group is order[i:j], padded to lengths[order[i]]
            cost = best[i] + (j - i) * lengths[order[i]] + per_forward
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups[::-1]
