"""The model-facing log-probabilities: where a model's forward becomes per-token log-probs.

Every trainer gets per-token log-probs and entropies from here (the pure log-softmax math is
`core.log_softmax`). Two habits keep memory flat: the model is asked only for the logits of the
positions we score (``logits_to_keep``), and log-softmax is never materialised as a full float32
(B, T, V) copy (`core.log_softmax.selective_log_softmax`). Where the output layer is a
plain linear map (`plain_lm_head`), `linear_selective_log_softmax` fuses it in: logits a
vocabulary block at a time, online softmax statistics, and a backward that hands each block's
gradient straight to the two matmuls.

Completions that share a prompt are scored in one sequence per prompt, [prompt | completion 1 |
... | completion k] with a block attention mask (`pack_groups`, `packed_logps`): the online
trainers' groups of samples and the preference trainers' pairs (`pack_pairs`) alike. What the
trainers call is in `forward.completions`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.accel import document_attention, products
from posttrain.core.log_softmax import entropy_from_logits, selective_log_softmax, selective_log_softmax_stats
from posttrain.core.masked import shared_prefix_attention_mask
from posttrain.models.modes import eval_mode

VOCAB_CHUNK = 4096  # vocabulary columns per block of the fused head: a block is rows * VOCAB_CHUNK floats
# The fused head keeps its logits for the backward up to this size and recomputes them there above it:
# 512 MiB is 2700 positions of a 49k vocabulary in float32, e.g. SFT at batch 2 x 2048 holds 805 MiB of
# logits next to about 5 GiB of activations; recomputing costs one more (N, H) x (H, V) product.
KEEP_LOGITS_BYTES = 512 * 2**20


def linear_selective_log_softmax(hidden: Tensor, weight: Tensor, index: Tensor, with_stats: bool = False,
                                 vocab_chunk: int = VOCAB_CHUNK):
    """`selective_log_softmax(hidden @ weight.T, index)` with the vocabulary projection fused in.

    hidden: (..., H) final hidden states; weight: (V, H) the output embedding (lm_head, possibly
    tied to the input embedding); index: (...) token ids. Returns (log-probs, entropy, argmax),
    each shaped like `index`; entropy and argmax (metrics, no gradient) are None unless
    `with_stats`. Log-probs are float32 (float64 for float64 inputs).

    The logits are computed `vocab_chunk` columns at a time with online softmax statistics, so
    no (N, V) temporaries are made besides the logits kept for backward (in the matmul dtype:
    bf16 under bf16 autocast; above `KEEP_LOGITS_BYTES` none are kept and backward recomputes each
    block with the same product, so the values are the same). Backward turns each block into its gradient
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
    if head is not None and hasattr(getattr(head, "weight", None), "placements"):
        return None  # an FSDP2 shard (DTensor): whole only inside the sharded root's forward, never plain
    known = _PLAIN_HEADS.get(model)
    if known is not None and known[0] is head:
        return known[1]
    config = getattr(model, "config", None)
    # A DeepSpeed ZeRO-3 weight (ds_id) lives only inside the module's own forward: outside it, it is
    # shape (0,), or still full when a generation or check happened to leave it gathered -- never plain.
    plain = products.is_linear(head) and head.bias is None and head.weight.dim() == 2 and not hasattr(
        head.weight, "ds_id") and all(
        getattr(config, k, None) in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if plain:
        with eval_mode(model), torch.no_grad(), torch.autocast(input_ids.device.type, enabled=False):
            out = model(input_ids=input_ids[:1, :8], output_hidden_states=True, use_cache=False)
            plain = bool(out.hidden_states) and torch.allclose(head(out.hidden_states[-1]).float(),
                                                               out.logits.float(), rtol=1e-4, atol=1e-4)
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
        block = products.mm(h, weight.detach()[lo:hi].to(dtype).t())  # (N, hi - lo) logits
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
        ctx.dtype = _matmul_dtype(hidden)
        keep = index.numel() * weight.shape[0] * ctx.dtype.itemsize <= KEEP_LOGITS_BYTES
        logps, entropy, argmax, lse, blocks = _linear_selective_log_softmax(hidden, weight, index, chunk, stats,
                                                                            keep=keep)
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
        dtype = ctx.dtype
        h = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
        idx, g = index.reshape(-1), grad.reshape(-1).to(lse.dtype)
        grad_hidden = torch.zeros(h.shape, dtype=lse.dtype, device=h.device) if want_hidden else None
        grad_weight = torch.empty_like(weight) if want_weight else None
        buffer = None
        for k, lo in enumerate(range(0, weight.shape[0], ctx.chunk)):
            hi = min(lo + ctx.chunk, weight.shape[0])
            # the forward's logits, or the forward's product again
            block = blocks[k] if blocks else products.mm(h, weight.detach()[lo:hi].to(dtype).t())
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
                    products.addmm_(grad_hidden, part, w)
                else:
                    grad_hidden += products.mm(part, w)
            if want_weight:
                if grad_weight.dtype == dtype:
                    products.mm_into(grad_weight[lo:hi], part.t(), h)
                else:
                    grad_weight[lo:hi] = products.mm(part.t(), h)
        if want_hidden:
            grad_hidden = grad_hidden.to(hidden.dtype).view(hidden.shape)
        return grad_hidden, grad_weight, None, None, None


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor, num_scored: int | None = None,
                   temperature: float = 1.0, with_entropy: bool = False, return_outputs: bool = False,
                   exact_positions: bool = False, head: torch.nn.Linear | None = None, **model_kwargs):
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
    With `head` (the model's plain output layer, `plain_lm_head`), the model computes no logits: the
    output layer is fused into the log-softmax (`linear_selective_log_softmax`), so no (B, K, V) logits
    and no entropy temporaries sit beside the forward's activations, and the logits come back as None.
    """
    if head is not None and return_outputs:
        raise ValueError("token_logprobs: the fused output layer (head=) returns no model outputs")
    T = input_ids.shape[1]
    K = T - 1 if num_scored is None else num_scored
    if "position_ids" not in model_kwargs and attention_mask is not None and not bool(attention_mask[:, 0].all()):
        # Left padding (rollouts): positions count real tokens only, as in the sampler; without
        # this, transformers would number the pad columns too and shift every position.
        model_kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if head is not None:
        hidden = last_hidden_states(model, input_ids=input_ids, attention_mask=attention_mask,
                                    **model_kwargs)[:, T - K - 1:T - 1]  # (B, K, H): the states that score each token
        scaled = hidden / temperature if temperature != 1.0 else hidden  # logits / T = (hidden / T) W^T
        logps, entropy, _ = linear_selective_log_softmax(scaled, head.weight, input_ids[:, T - K:],
                                                         with_stats=with_entropy)
        return logps, entropy, None
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


def attention_kind(model) -> str | None:
    """The model's attention implementation ("sdpa", "eager", ...), through a DDP wrapper. Document attention
    (`accel.document_attention`, which SFT switches sdpa models to) is "sdpa": it is sdpa where no caller
    passes sequence boundaries."""
    if document_attention.active(model):
        return "sdpa"
    inner = getattr(model, "module", model)  # DDP
    return getattr(getattr(inner, "config", None), "_attn_implementation", None)


@dataclass
class PackedGroups:
    """Completions that share a prompt, packed one sequence per prompt: [prompt | block 1 | ... | block k].

    Each block holds one completion and sees the prompt and its own earlier tokens (the block mask
    of `attention_mask`), at the positions it has in its own row, so one forward gives every
    completion what its own [prompt | completion] row would give, computing the prompt once. A pair
    of preference completions is a group of two. Built by `pack_groups`; scored by `packed_logps`.
    """

    input_ids: Tensor     # (U, L) the packed tokens; 0 after the last block
    position_ids: Tensor  # (U, L) the prompt counts its real tokens; each block restarts after the prompt
    segment: Tensor       # (U, L) 0 prompt, j + 1 block j, k + 1 after the last block
    valid: Tensor         # (U, L) real tokens
    score_at: Tensor      # (U or 1, k, C) column whose hidden state scores completion token t (the prompt's
    #                       last for t = 0); 1 row when every group has the same layout (`pack_groups(block=n)`)
    targets: Tensor       # (U, k, C) the completion tokens
    last_at: Tensor       # (U, k) column of each completion's last packed token (the prompt's last if empty)

    def attention_mask(self, additive_dtype: torch.dtype | None = None) -> Tensor:
        """(U, 1, L, L) boolean block mask (sdpa), or additive in `additive_dtype` (eager attention)."""
        return shared_prefix_attention_mask(self.segment, self.valid, additive_dtype=additive_dtype)

    def model_inputs(self, model) -> dict:
        """input_ids, attention_mask and position_ids for `model`'s forward (any module that takes them:
        a causal LM, its base model under a reward head)."""
        eager = attention_kind(model) == "eager"  # eager attention adds the mask to the scores
        dtype = getattr(model, "module", model).get_input_embeddings().weight.dtype if eager else None
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask(dtype),
                "position_ids": self.position_ids}

    def one_row_inputs(self) -> tuple[dict, Tensor]:
        """The groups side by side in ONE row without padding, for document attention
        (`accel.document_attention`): input_ids, position_ids and a block-diagonal (1, 1, N, N) boolean
        mask whose diagonal blocks are the groups' block masks, with each group's bounds as `cu_seq_lens_q`
        / `_k`; and (U, L) the column of each packed token in that row (-1 where none)."""
        valid = self.valid.bool()
        U, L = valid.shape
        device = valid.device
        group = torch.arange(U, device=device)[:, None].expand(U, L)[valid]  # (N,) group of each kept token
        col = torch.arange(L, device=device)[None].expand(U, L)[valid]  # (N,) its column in the group's row
        blocks = self.attention_mask()  # (U, 1, L, L)
        mask = (group[:, None] == group[None]) & blocks[group[:, None], 0, col[:, None], col[None]]  # (N, N)
        lengths = valid.sum(1)
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        longest = int(lengths.max())
        where = torch.where(valid, valid.reshape(-1).cumsum(0).view(U, L) - 1, -1)
        return {"input_ids": self.input_ids[valid][None], "attention_mask": mask[None, None],
                "position_ids": self.position_ids[valid][None], "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                "max_length_q": longest, "max_length_k": longest}, where

    def at_scores(self, values: Tensor, by_slot: bool = False) -> Tensor:
        """(U, k * C, ...) entries of `values` (U, L, ...) at the scoring columns, group by group, or
        with `by_slot` (k * U, C, ...): every group's first completion, then every group's second, ..."""
        U, k, C = self.targets.shape
        if by_slot:
            groups = torch.arange(U, device=values.device).repeat(k)[:, None]
            return values[groups, self.score_at.expand(U, k, C).transpose(0, 1).reshape(k * U, C)]
        if self.score_at.shape[0] == 1:  # one layout for all groups: a column slice
            return values[:, self.score_at.flatten()]
        return values[torch.arange(U, device=values.device)[:, None], self.score_at.view(U, k * C)]

    def at_last(self, values: Tensor, by_slot: bool = False) -> Tensor:
        """(U, k, ...) entries of `values` (U, L, ...) at each completion's last packed token (a reward
        model's scoring position), or with `by_slot` (k * U, ...) ordered as `at_scores` orders them."""
        U, k = self.last_at.shape
        groups = torch.arange(U, device=values.device)
        if by_slot:
            return values[groups.repeat(k), self.last_at.t().flatten()]
        return values[groups[:, None], self.last_at]


def pack_groups(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                block: int | None = None) -> PackedGroups:
    """Pack each prompt (U, P) with its k completions (U, k, C) into one sequence (`PackedGroups`).

    Prompts may be left- or right-padded; completions are right-padded, an all-masked slot is empty.
    With `block` None the layout is tight: a prompt keeps its columns through its last real token and
    each completion takes exactly its length. With `block` = n every prompt keeps all P columns and
    every completion n columns (its first n tokens: n = C - 1 loses nothing, the last token only
    scores what would follow), so groups whose prompts are left-padded share one layout and the
    scoring columns, the same in every sequence, can be a forward's `logits_to_keep`.
    """
    U, k, C = completion_ids.shape
    P, device = prompt_ids.shape[1], prompt_ids.device
    lengths = completion_mask.sum(-1)  # (U, k)
    prompt_last = torch.where(prompt_mask.bool(), torch.arange(P, device=device), -1).amax(1) if P else \
        torch.full((U,), -1, device=device)  # (U,) column of each prompt's last real token
    if block is None:
        prompt_width = prompt_last + 1
        widths = lengths
    else:
        prompt_width = torch.full((U,), P, dtype=torch.long, device=device)
        widths = torch.full((U, k), block, dtype=torch.long, device=device)
    starts = prompt_width[:, None] + widths.cumsum(1) - widths  # (U, k) first column of each block
    L = int((prompt_width + widths.sum(1)).max())
    t = torch.arange(C, device=device)
    block_col = starts[..., None] + t  # (U, k, C)
    prompt_col = torch.arange(P, device=device).expand(U, P)
    in_prompt, in_block = prompt_col < prompt_width[:, None], t < widths[..., None]

    def placed(fill, prompt_values, block_values, dtype):  # (U, L); an extra column takes what is not placed
        out = torch.full((U, L + 1), fill, dtype=dtype, device=device)
        out.scatter_(1, torch.where(in_prompt, prompt_col, L), prompt_values.to(dtype).expand(U, P))
        out.scatter_(1, torch.where(in_block, block_col, L).view(U, k * C), block_values.to(dtype).reshape(U, k * C))
        return out[:, :L]

    real_prompt = prompt_mask.sum(1)
    segment_of_block = torch.arange(1, k + 1, device=device)[None, :, None].expand(U, k, C)
    packed = PackedGroups(
        input_ids=placed(0, prompt_ids, completion_ids, prompt_ids.dtype),
        position_ids=placed(0, (prompt_mask.cumsum(1) - 1).clamp(min=0), real_prompt[:, None, None] + t.expand(U, k, C),
                            torch.long),
        segment=placed(k + 1, torch.zeros(1, 1, device=device), segment_of_block, torch.long),
        valid=placed(False, prompt_mask, completion_mask, torch.bool),
        # token t is scored by the hidden state of token t - 1 of its block, token 0 by the prompt's last
        score_at=torch.where(t == 0, prompt_last[:, None, None],
                             torch.where(t <= widths[..., None], block_col - 1, 0)),
        targets=completion_ids,
        last_at=torch.where(lengths > 0, starts + torch.minimum(lengths, widths) - 1, prompt_last[:, None]))
    if block is not None and bool((packed.score_at == packed.score_at[:1]).all()):  # left-padded prompts
        packed.score_at = packed.score_at[:1]
    return packed


def packed_logps(model, packed: PackedGroups, head: torch.nn.Linear | None, temperature: float = 1.0,
                 with_entropy: bool = False, by_slot: bool = False, **model_kwargs):
    """Log-probs (U, k * C) of the packed completion tokens under softmax(logits / temperature), their
    entropies (U, k * C) or None, and the hidden states (U, k * C, H) that score them (None without `head`).
    With `by_slot`, rows (k * U, C) ordered as `PackedGroups.at_scores` orders them (for pairs: the
    chosen rows, then the rejected ones, as the preference collators lay them out).

    `head`: the model's plain output layer (`plain_lm_head`), fused into the log-softmax so no
    logits are made; None computes the logits at the scoring columns through the model's own head
    (by `logits_to_keep` when all groups share a layout, else all of them). `model_kwargs` go to the forward
    (a vision-language model's images, one group's once).
    """
    U, k, C = packed.targets.shape
    targets = packed.targets.transpose(0, 1).reshape(k * U, C) if by_slot else packed.targets.reshape(U, k * C)
    inputs = {**packed.model_inputs(model), **model_kwargs}
    if head is not None:
        hidden = packed.at_scores(last_hidden_states(model, **inputs), by_slot)
        scaled = hidden / temperature if temperature != 1.0 else hidden  # logits / T = (hidden / T) W^T
        logps, entropy, _ = linear_selective_log_softmax(scaled, head.weight, targets, with_stats=with_entropy)
        return logps, entropy, hidden
    shared = packed.score_at.shape[0] == 1 and not by_slot
    outputs = model(**inputs, logits_to_keep=packed.score_at.flatten() if shared else 0, use_cache=False)
    logits = outputs.logits if shared else packed.at_scores(outputs.logits, by_slot)
    if temperature != 1.0:
        logits = logits / temperature
    if with_entropy:
        logps, entropy, _ = selective_log_softmax_stats(logits, targets)
        return logps, entropy, None
    return selective_log_softmax(logits, targets), None, None


def pack_pairs(input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor) -> PackedGroups:
    """Preference pairs as `pack_groups` groups of two, tight: [prompt | chosen | rejected] per pair.

    input_ids, attention_mask, completion_mask: (2B, T) right-padded [prompt | completion] rows, the B
    chosen rows first, then the rejected ones in the same order; pair i's prompt is taken from its
    chosen row (the rejected row must hold the same prompt). A reward model uses it without the LM
    head: its backbone's hidden states (B, L, H) on `model_inputs`, then `at_last(hidden, by_slot=True)`
    gives each completion's last-token state (2B, H) in the rows' order.
    """
    B = input_ids.shape[0] // 2
    lengths = completion_mask.sum(-1)  # (2B,)
    prompt_len = attention_mask[:B].sum(-1) - lengths[:B]  # (B,)
    P, K = int(prompt_len.max()), max(int(lengths.max()), 1)
    col = torch.arange(max(P, K), device=input_ids.device)
    prompt_mask = col[:P] < prompt_len[:, None]
    # completion token t of a row sits at column prompt_len + t
    at = (prompt_len.repeat(2)[:, None] + col[:K]).clamp(max=input_ids.shape[1] - 1)
    in_completion = col[:K] < lengths[:, None]
    completions = torch.where(in_completion, input_ids.gather(1, at), 0)  # (2B, K)
    return pack_groups(torch.where(prompt_mask, input_ids[:B, :P], 0), prompt_mask,
                       completions.view(2, B, K).transpose(0, 1), in_completion.view(2, B, K).transpose(0, 1))
