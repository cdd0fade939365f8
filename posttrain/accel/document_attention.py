"""Document attention: SDPA that attends within each packed sequence only, at the cost of those sequences.

A row that holds several sequences (SFT packing, or a padded batch flattened into one row) tells
transformers where each sequence starts by restarting `position_ids`; under "sdpa" transformers then
builds a block-diagonal causal mask and runs one attention over the whole row: (sum of lengths)^2 / 2
query-key pairs, most of them masked. Flash-attention kernels take the sequence boundaries instead
(`cu_seq_lens_q` / `cu_seq_lens_k`, the cumulative lengths) and compute only the pairs within each
sequence: sum(length^2) / 2. On CPU there is no flash-attention package, so this module gives SDPA
the same arguments: with `cu_seq_lens_q` it runs causal SDPA on each sequence alone (transformers'
own `sdpa_attention_forward`, `is_causal=True`) and joins the outputs; without them it is
transformers' SDPA unchanged. A sequence's output is then exactly what it is in a row of its own.
A caller may also pass its own block-diagonal mask (B, 1, T, T) with the boundaries: each sequence
then attends under its diagonal block (a reward model's `[prompt | chosen | rejected]` pairs, each
completion seeing the prompt and itself), and causally where that block is the causal mask.

What it saves against the dense block mask is measured in benchmarks/README.md ("Document attention").

`enable(model)` switches a model whose attention is "sdpa" to this implementation
(`ATTENTION`, registered with transformers' attention and mask interfaces; the mask is SDPA's, so
callers that do not pass the boundaries get exactly SDPA); `disable(model)` switches it back to plain
"sdpa", for code that reads the attention's name itself. The name is not saved with the model (its
config's `_attn_implementation` is not serialised). `boundaries(position_ids)` gives the keyword
arguments for a batch whose rows restart their positions at each sequence.
"""

from __future__ import annotations

import torch

ATTENTION = "posttrain_sdpa"
_REGISTERED = False


def document_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                  cu_seq_lens_q=None, cu_seq_lens_k=None, **kwargs):
    """transformers' attention-function signature: query (B, Hq, T, D), key and value (B, Hkv, T, D) ->
    (B, T, Hq, D), None. With `cu_seq_lens_q` (int, (S + 1,): where each of the S sequences of the B * T
    flattened positions starts, then B * T), each sequence attends to itself only: under the slice of
    `attention_mask` (B, 1, T, T) that covers it, or causally where that slice is causal or there is no mask
    (the block mask transformers builds for restarting positions is). Else transformers' SDPA as it is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("document attention: cu_seq_lens_k must equal cu_seq_lens_q (no cache, self-attention)")
    B, _, T, _ = query.shape
    bounds = cu_seq_lens_q.tolist()
    if bounds[0] != 0 or bounds[-1] != B * T or any(s // T != (e - 1) // T for s, e in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"document attention: cu_seq_lens_q must run from 0 to {B * T} (batch x length), "
                         f"each sequence within one row, got {bounds}")
    lengths = [[] for _ in range(B)]  # each row's sequences' lengths, in order: they tile the row
    for s, e in zip(bounds[:-1], bounds[1:]):
        lengths[s // T].append(e - s)
    # each sequence's (H, L, D) views, split off its row: the backward joins their gradients with one
    # concatenation per row, where slicing would zero-fill a full-size gradient per sequence and add them up
    rows = [t.unbind(0) if B > 1 else (t.squeeze(0),) for t in (query, key, value)]
    parts = []
    for r in range(B):
        a, m = 0, 0 if attention_mask is None or attention_mask.shape[0] == 1 else r  # a batch-1 mask serves every row
        for q, k, v in zip(*(row[r].split(lengths[r], dim=1) for row in rows)):
            b = a + q.shape[1]
            mask = None if attention_mask is None else attention_mask[m:m + 1, :, a:b, a:b]
            if mask is not None and _is_causal(mask):
                mask = None
            parts.append(sdpa_attention_forward(module, q[None], k[None], v[None], mask, dropout=dropout,
                                                scaling=scaling, is_causal=mask is None)[0])
            a = b
    out = torch.cat(parts, 1) if len(parts) > 1 else parts[0]  # (1, B * T, Hq, D)
    return out.view(B, T, *out.shape[2:]), None


def _is_causal(mask: torch.Tensor) -> bool:
    """Whether a (1, 1 or H, L, L) mask, boolean (True: attend) or additive (0: attend), is the causal one."""
    allowed = mask if mask.dtype == torch.bool else mask == 0
    L = allowed.shape[-1]
    return bool(torch.equal(allowed, torch.ones(L, L, dtype=torch.bool, device=mask.device).tril().expand_as(allowed)))


def register() -> None:
    """Make `ATTENTION` known to transformers (attention function and SDPA's mask); idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, document_sdpa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    _REGISTERED = True


def enable(model) -> bool:
    """Switch `model` (a transformers model, its config's attention "sdpa") to document attention, in place.
    Returns whether its attention is document attention now; any other attention is left alone, and so is a
    model whose class is not one of transformers' own (remote or user code may read the attention's name
    itself, or not pass the boundaries on)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "_attn_implementation", None)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT
    if kind != "sdpa" or not type(inner).__module__.startswith("transformers.models."):
        return kind == ATTENTION
    register()
    config._attn_implementation = ATTENTION
    return True


def active(model) -> bool:
    """Whether `model` (or the module a DDP wrapper holds) runs document attention."""
    inner = getattr(model, "module", model)  # DDP
    return getattr(getattr(inner, "config", None), "_attn_implementation", None) == ATTENTION


def disable(model) -> None:
    """Back to plain "sdpa" where `enable` switched it."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == ATTENTION:
        config._attn_implementation = "sdpa"


def boundaries(position_ids: torch.Tensor) -> dict:
    """The flash-attention keyword arguments for rows (B, T) of packed sequences, told apart as transformers
    tells them for its block mask (a sequence starts at each row's start and wherever the position does not
    go up by one): `cu_seq_lens_q`/`_k` (int32: each sequence's start in the flattened B * T positions, then
    B * T) and `max_length_q`/`_k`. A row's trailing padding that continues its last sequence's positions
    stays in that sequence (causality hides it from the real tokens)."""
    B, T = position_ids.shape
    new = torch.ones_like(position_ids, dtype=torch.bool)
    new[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    starts = torch.nonzero(new.reshape(-1)).flatten()
    cu = torch.cat([starts, starts.new_tensor([B * T])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
