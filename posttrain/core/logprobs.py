"""The one place where logits become log-probabilities.

Every trainer gets per-token log-probs and entropies from here. Two habits keep memory flat:
the model is asked only for the logits of the positions we score (``logits_to_keep``), and
log-softmax is never materialised as a full float32 (B, T, V) copy: we gather the chosen
logit and subtract a log-sum-exp computed a few rows at a time. Where the output layer is a
plain linear map (`plain_lm_head`), `linear_selective_log_softmax` fuses it in: logits a
vocabulary block at a time, online softmax statistics, and a backward that hands each block's
gradient straight to the two matmuls.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from posttrain.core.masked import shared_prefix_attention_mask

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


VOCAB_CHUNK = 4096  # vocabulary columns per block of the fused head: a block is rows * VOCAB_CHUNK floats


def linear_selective_log_softmax(hidden: Tensor, weight: Tensor, index: Tensor, with_stats: bool = False,
                                 vocab_chunk: int = VOCAB_CHUNK):
    """`selective_log_softmax(hidden @ weight.T, index)` with the vocabulary projection fused in.

    hidden: (..., H) final hidden states; weight: (V, H) the output embedding (lm_head, possibly
    tied to the input embedding); index: (...) token ids. Returns (log-probs, entropy, argmax),
    each shaped like `index`; entropy and argmax (metrics, no gradient) are None unless
    `with_stats`. Log-probs are float32 (float64 for float64 inputs).

    The logits are computed `vocab_chunk` columns at a time with online softmax statistics, so
    no (N, V) temporaries are made besides the logits kept for backward (in the matmul dtype:
    bf16 under bf16 autocast). Backward turns each block into its gradient
    g * (one_hot(index) - softmax) in one reused buffer and feeds it straight to the two matmuls
    (dL/dhidden, dL/dweight); it never builds the (N, V) gradient.
    """
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        logps, entropy, argmax = _LinearSelectiveLogSoftmax.apply(hidden, weight, index, vocab_chunk, with_stats)
    else:
        logps, entropy, argmax, _, _ = _linear_selective_log_softmax(hidden, weight, index, vocab_chunk,
                                                                     with_stats, keep=False)
    return logps, entropy, argmax


_PLAIN_HEADS = weakref.WeakKeyDictionary()  # model -> (its output layer, that layer if plain else None)


def plain_lm_head(model, input_ids: Tensor):
    """The model's output layer if its logits are exactly `head(outputs.hidden_states[-1])`, else None.

    That is what `linear_selective_log_softmax` needs: a bias-free `nn.Linear` head (no adapter on
    it), no logit scaling or soft-capping, and a last hidden state that already went through
    the final norm. Checked once per model (and output layer) on the first 8 tokens of
    `input_ids` (one row, eval mode, no grad).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    known = _PLAIN_HEADS.get(model)
    if known is not None and known[0] is head:
        return known[1]
    config = getattr(model, "config", None)
    # (a partitioned weight, e.g. DeepSpeed ZeRO-3, lives only inside the forward: shape (0,), not plain)
    plain = type(head) is torch.nn.Linear and head.bias is None and head.weight.dim() == 2 and all(
        getattr(config, k, None) in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if plain:
        training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.autocast(input_ids.device.type, enabled=False):
                out = model(input_ids=input_ids[:1, :8], output_hidden_states=True, use_cache=False)
                plain = bool(out.hidden_states) and torch.allclose(head(out.hidden_states[-1]).float(),
                                                                   out.logits.float(), rtol=1e-4, atol=1e-4)
        finally:
            model.train(training)
    _PLAIN_HEADS[model] = (head, head if plain else None)
    return head if plain else None


def last_hidden_states(model, **inputs) -> Tensor:
    """The model's final hidden states (B, T, H) without its output layer (no logits computed), for
    `linear_selective_log_softmax` with the head from `plain_lm_head`. `inputs` go to the forward."""
    device = inputs["input_ids"].device
    outputs = model(**inputs, use_cache=False, output_hidden_states=True,
                    logits_to_keep=torch.zeros(0, dtype=torch.long, device=device))
    return outputs.hidden_states[-1]


def _matmul_dtype(hidden: Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _linear_selective_log_softmax(hidden, weight, index, chunk, stats, keep):
    """(log-probs, entropy, argmax, log-sum-exp, logit blocks kept for backward or None); flat (N,) each."""
    dtype = _matmul_dtype(hidden)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    h = hidden.detach().reshape(-1, hidden.shape[-1]).to(dtype)
    idx = index.reshape(-1)
    n, V = h.shape[0], weight.shape[0]
    blocks = []
    chosen = torch.zeros(n, dtype=acc, device=h.device)
    top = total = spread = argmax = None  # running max, sum exp(x - top), sum exp(x - top) * (x - top), argmax
    for lo in range(0, V, chunk):
        hi = min(lo + chunk, V)
        block = torch.mm(h, weight.detach()[lo:hi].to(dtype).t())  # (N, hi - lo) logits
        if keep:
            blocks.append(block)
        x = block if block.dtype == acc else block.to(acc)
        m, at = x.max(-1)
        local = (idx - lo).clamp(0, hi - lo - 1)
        inside = (idx >= lo) & (idx < hi)
        chosen = torch.where(inside, x.gather(1, local[:, None]).squeeze(1), chosen)
        new_top = m if top is None else torch.maximum(top, m)
        shifted = x - new_top[:, None]
        weights = shifted.exp()
        if top is None:
            total = weights.sum(-1)
            if stats:
                spread, argmax = torch.linalg.vecdot(weights, shifted), at
        else:
            scale = (top - new_top).exp()
            if stats:  # rebase to the new max: (x - new) = (x - old) + (old - new)
                spread = scale * (spread + (top - new_top) * total) + torch.linalg.vecdot(weights, shifted)
                argmax = torch.where(m > top, at + lo, argmax)  # ties keep the earlier (lower) id
            total = total * scale + weights.sum(-1)
        top = new_top
    if top is None:  # no rows or an empty vocabulary
        top = total = spread = torch.zeros(n, dtype=acc, device=h.device)
        argmax = torch.zeros(n, dtype=torch.long, device=h.device)
    lse = top + total.log()
    shape = index.shape
    entropy = (total.log() - spread / total).view(shape) if stats else None  # H = log Z - E_p[x - max]
    return (chosen - lse).view(shape), entropy, argmax.view(shape) if stats else None, lse, blocks


class _LinearSelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, index, chunk, stats):
        logps, entropy, argmax, lse, blocks = _linear_selective_log_softmax(hidden, weight, index, chunk, stats,
                                                                            keep=True)
        ctx.save_for_backward(hidden, weight, index, lse, *blocks)
        ctx.chunk = chunk
        if stats:
            ctx.mark_non_differentiable(entropy, argmax)
        return logps, entropy, argmax

    @staticmethod
    def backward(ctx, grad, *unused):
        hidden, weight, index, lse, *blocks = ctx.saved_tensors
        with torch.autocast(hidden.device.type, enabled=False):  # the matmul dtype is the one forward chose
            return _LinearSelectiveLogSoftmax._backward(ctx, grad, hidden, weight, index, lse, blocks)

    @staticmethod
    def _backward(ctx, grad, hidden, weight, index, lse, blocks):
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        h = hidden.reshape(-1, hidden.shape[-1])
        dtype = blocks[0].dtype if blocks else h.dtype
        h = h.to(dtype)
        idx, g = index.reshape(-1), grad.reshape(-1).to(lse.dtype)
        grad_hidden = torch.zeros(h.shape, dtype=lse.dtype, device=h.device) if want_hidden else None
        grad_weight = torch.empty_like(weight) if want_weight else None
        buffer = None
        for block, lo in zip(blocks, range(0, weight.shape[0], ctx.chunk)):
            hi = lo + block.shape[1]
            if buffer is None or buffer.shape != block.shape:
                buffer = torch.empty(block.shape, dtype=lse.dtype, device=block.device)
            # d logp[i] / d logits[j] = 1[j == index] - softmax[j], times the incoming gradient
            if block.dtype == lse.dtype:
                torch.sub(block, lse[:, None], out=buffer)
            else:
                buffer.copy_(block).sub_(lse[:, None])
            buffer.exp_().mul_(-g[:, None])
            inside = (idx >= lo) & (idx < hi)
            buffer.scatter_add_(1, (idx - lo).clamp(0, hi - lo - 1)[:, None], torch.where(inside, g, 0)[:, None])
            part = buffer if dtype == lse.dtype else buffer.to(dtype)
            w = weight[lo:hi].to(dtype)
            if want_hidden:
                if part.dtype == grad_hidden.dtype:
                    grad_hidden.addmm_(part, w)
                else:
                    grad_hidden += torch.mm(part, w)
            if want_weight:
                if grad_weight.dtype == dtype:
                    torch.mm(part.t(), h, out=grad_weight[lo:hi])
                else:
                    grad_weight[lo:hi] = torch.mm(part.t(), h)
        if want_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype).view(hidden.shape)
        return grad_hidden, grad_weight, None, None, None


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


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, num_scored: int | None = None,
                   temperature: float = 1.0, with_entropy: bool = False, return_outputs: bool = False,
                   exact_positions: bool = False, **model_kwargs):
    """Log-probs of the last `num_scored` tokens of each row under `model` (and their entropies).

    input_ids, attention_mask: (B, T). Token t is scored by the logits at t-1, so the model is
    asked for the last `num_scored + 1` logits only (all T when None).
    Left-padded rows get position_ids from the attention mask unless `position_ids` is passed.
    Returns (logps (B, K), entropy (B, K) or None, logits (B, K, V)) with K = num_scored or T-1;
    position j of the result scores input_ids[:, T-K+j].
    With `return_outputs`, the model's raw outputs come as a 4th element (e.g. a value head's
    values from the same forward).
    With `exact_positions`, `logits_to_keep` is the tensor of the K scoring positions, so the
    model computes exactly the K logits and they come out contiguous: the log-softmax and its
    backward then copy nothing (the last-K+1-then-slice default copies the (B, K, V) logits
    twice). Needs a model whose forward takes a tensor `logits_to_keep` (transformers causal LMs).
    """
    T = input_ids.shape[1]
    K = T - 1 if num_scored is None else num_scored
    if "position_ids" not in model_kwargs and attention_mask is not None and not bool(attention_mask[:, 0].all()):
        # Left padding (rollouts): positions count real tokens only, as in the sampler; without
        # this, transformers would number the pad columns too and shift every position.
        model_kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if exact_positions:
        keep = torch.arange(T - K - 1, T - 1, device=input_ids.device)
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep,
                        use_cache=False, **model_kwargs)
        logits = outputs.logits  # (B, K, V), contiguous
    else:
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=K + 1,
                        use_cache=False, **model_kwargs)
        logits = outputs.logits[:, -(K + 1):-1, :]  # (B, K, V)
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, T - K:]
    logps = selective_log_softmax(logits, targets)
    entropy = None
    if with_entropy:
        with torch.no_grad():  # entropy is a metric here, never a loss term
            entropy = entropy_from_logits(logits.detach())
    if return_outputs:
        return logps, entropy, logits, outputs
    return logps, entropy, logits


def sequence_logprobs(token_logps: Tensor, mask: Tensor) -> Tensor:
    """Sum of token log-probs over the masked tokens of each row. (B, T) -> (B,)."""
    return (token_logps * mask).sum(-1)


def attention_kind(model) -> str | None:
    """The model's attention implementation ("sdpa", "eager", ...), through a DDP wrapper."""
    inner = getattr(model, "module", model)  # DDP
    return getattr(getattr(inner, "config", None), "_attn_implementation", None)


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


def paired_completion_logps(model, head, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                            per_forward: int | None = None):
    """Summed completion log-probs (2B,), lengths (2B,) and mean logits (2B,) of preference pairs,
    computing each prompt once (`head`: the model's plain output layer, see `plain_lm_head`).

    Pair i becomes one sequence [prompt | chosen | rejected] with a block attention mask (each completion sees the prompt and
    its own earlier tokens, at the positions it has in its own row), so the model runs on
    P + C_chosen + C_rejected tokens instead of 2 P + C_chosen + C_rejected. Equal to the two-row
    forward up to float rounding. input_ids etc.: (2B, T) right-padded, chosen rows first.

    On CPU, where a forward pass costs little beyond its tokens, pairs of uneven length go through
    the model in groups of similar length (`length_groups`, `per_forward` = 16 tokens by default),
    so that less of the work is padding; on GPUs (`per_forward` None there) the batch stays whole.
    """
    B = input_ids.shape[0] // 2
    if per_forward is None and input_ids.device.type == "cpu":
        per_forward = 16
    pair_lengths = (attention_mask[:B].sum(-1) + completion_mask[B:].sum(-1)).tolist()
    groups = [list(range(B))] if per_forward is None else length_groups(pair_lengths, per_forward)
    if len(groups) == 1:
        return _paired_forward(model, head, input_ids, attention_mask, completion_mask)
    rows = [torch.tensor(g + [B + i for i in g], device=input_ids.device) for g in groups]
    parts = [_paired_forward(model, head, input_ids[r], attention_mask[r], completion_mask[r]) for r in rows]
    inverse = torch.cat(rows).argsort()
    return tuple(torch.cat(values)[inverse] for values in zip(*parts))


def _paired_forward(model, head, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor):
    """`paired_completion_logps` for one batch in one forward pass."""
    device = input_ids.device
    N = input_ids.shape[0]
    B = N // 2
    lengths = completion_mask.sum(-1)  # (2B,)
    totals = attention_mask.sum(-1)
    prompt_len = (totals[:B] - lengths[:B]).tolist()
    c_len, r_len = lengths[:B].tolist(), lengths[B:].tolist()
    L = max(p + c + r for p, c, r in zip(prompt_len, c_len, r_len))
    K = max(max(c_len), max(r_len), 1)
    ids = torch.zeros(B, L, dtype=input_ids.dtype, device=device)
    positions = torch.zeros(B, L, dtype=torch.long, device=device)
    segment = torch.full((B, L), 3, dtype=torch.long, device=device)  # 0 prompt, 1 chosen, 2 rejected, 3 pad
    gather = torch.zeros(N, K, dtype=torch.long, device=device)  # packed position scoring each completion token
    targets = torch.zeros(N, K, dtype=input_ids.dtype, device=device)
    mask = torch.zeros(N, K, dtype=torch.bool, device=device)
    for i, (p, c, r) in enumerate(zip(prompt_len, c_len, r_len)):
        chosen, rejected = input_ids[i, p:p + c], input_ids[B + i, p:p + r]
        ids[i, :p + c + r] = torch.cat([input_ids[i, :p], chosen, rejected])
        positions[i, :p + c + r] = torch.cat([torch.arange(p + c, device=device), torch.arange(p, p + r, device=device)])
        segment[i, :p], segment[i, p:p + c], segment[i, p + c:p + c + r] = 0, 1, 2
        for row, start, n, toks in ((i, p, c, chosen), (B + i, p + c, r, rejected)):
            # token j of a completion is scored at the position before it: the prompt's last for j = 0
            gather[row, :n] = torch.cat([torch.tensor([p - 1], device=device),
                                         torch.arange(start, start + n - 1, device=device)])
            targets[row, :n], mask[row, :n] = toks, True
    eager = head.weight.dtype if attention_kind(model) == "eager" else None  # eager adds the mask to the scores
    attn = shared_prefix_attention_mask(segment, segment != 3, additive_dtype=eager)
    hidden = last_hidden_states(model, input_ids=ids, attention_mask=attn, position_ids=positions)  # (B, L, H)
    pair = torch.arange(N, device=device) % B
    picked = hidden[pair[:, None], gather]  # (2B, K, H)
    logps = linear_selective_log_softmax(picked, head.weight, targets)[0]
    with torch.no_grad():
        mean_logits = ((picked @ head.weight.mean(0)) * mask).sum(-1) / lengths.clamp(min=1)
    return sequence_logprobs(logps, mask), lengths, mean_logits.float()
