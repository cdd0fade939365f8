"""The completion forwards: log-probs of given completions under a model, as the trainers need them.

* `completion_logprobs`: the online update's forward (GRPO, RLOO, PPO, ...): per-token log-probs of
  sampled completions after left-padded prompts, each distinct prompt computed once
  (`logprobs.pack_groups`), optionally taking the sampler's recorded linear outputs (`accel.replay`).
* `completion_logps`: the preference trainers' forward (DPO, KTO, BCO): summed log-probs of
  [prompt | completion] rows, a pair's prompt computed once (`logprobs.pack_pairs`).
* `completion_token_logps`: the same rows' per-token log-probs with the whole logits (LD-DPO, WPO).
* `completion_logits`: the distillation trainers' forward: what scores each completion token of both models,
  the final hidden states with the output layer's weight where it is plain (`core.divergences.LinearLogits`),
  so that the divergence makes the logits a block of positions at a time; rows that share a prompt packed
  as `completion_logprobs` packs them (`shared_prompts`).

They differ in what comes in (a rollout's prompt and completion tensors, or a collator's rows) and what
goes out (per-token values with entropies, or sums with mean logits); the forward they share is
`logprobs.packed_logps` / `logprobs.token_logprobs` with the fused output layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.accel.replay import LinearRecord, replaying
from posttrain.core.divergences import LinearLogits
from posttrain.core.log_softmax import length_groups, sequence_logprobs
from posttrain.forward.logprobs import (PackedGroups, attention_kind, last_hidden_states, linear_selective_log_softmax,
                                        pack_groups, pack_pairs, packed_logps, plain_lm_head, token_logprobs)
from posttrain.forward.vision import IMAGE_GROUP, forward_inputs
from posttrain.models.modes import unwrap


def completion_logprobs(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                        completion_mask: Tensor, temperature: float = 1.0, with_entropy: bool = False,
                        replay: tuple[LinearRecord, Tensor] | tuple[LinearRecord, Tensor, bool] | None = None,
                        vision: dict[str, Tensor] | None = None):
    """Log-probs (R, C) of the completion tokens under softmax(logits / temperature), and their
    entropies (R, C) or None, computing each distinct prompt once.

    prompt_ids / prompt_mask (R, P) left-padded, completion_ids / completion_mask (R, C) right-padded.
    The k rows that share a prompt become one sequence [prompt, completion_1, ..., completion_k]
    (`forward.logprobs.pack_groups`) with a block attention mask: each completion sees the prompt and its own earlier tokens, at the
    positions it has in its own row (a block holds its completion's first C - 1 tokens: the last
    one would only give the logits of a token after the completion). One forward then computes the
    prompt once per group (its gradient collects what all k completions send it), each weight is
    used once (no per-use weight gradients to add up), and the logits are computed only at the
    scoring positions. Results and
    gradients equal those of the plain (R, P + C) forward up to float rounding. Falls back to the
    plain forward (`forward.logprobs.token_logprobs`) when that is estimated cheaper (few repeated
    prompts, or blocks so long that the dense-mask attention outweighs the saved prompt tokens) or
    the attention implementation cannot take a custom mask (only "sdpa" and "eager" can).

    replay: (record, rows) to take the decoder layers' linear outputs from the sampler's record
    (`accel/replay.py`) instead of computing them; rows (R,) are the rollout rows of these completions, and
    the record must come from the current weights. (record, rows, True): this forward is the record's
    last use, and each layer's part of it is let go as soon as the forward has read it.

    vision: the rows' prompt images (`forward.vision.row_inputs`, a micro-batch's `row_part`), or None. Rows
    share a prompt when their token ids and their image group agree; the packed forward then encodes each
    prompt's images once, the plain one each row's.
    """
    R, C = completion_ids.shape
    P = prompt_ids.shape[1]
    shared = shared_prompts(model, prompt_ids, prompt_mask, completion_ids, completion_mask, vision)
    if shared is None:  # little or no sharing
        ids, attention = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
        head = plain_lm_head(unwrap(model), ids)  # fused into the log-softmax where plain: no (R, C, V) logits
        images = {} if vision is None else forward_inputs(vision, torch.arange(R))
        with _replayed(replay, lambda record, rollout_rows: record.layout(rollout_rows[:, None], P, C)):
            logp, entropy, _ = token_logprobs(model, ids, attention, num_scored=C, temperature=temperature,
                                              with_entropy=with_entropy, exact_positions=True, head=head, **images)
        return logp, entropy
    head = plain_lm_head(unwrap(model), shared.packed.input_ids)  # the bare module; the forward keeps any DDP wrapper
    U, k, rows = shared.prompts, shared.slots, shared.rows
    images = {} if vision is None else forward_inputs(vision, shared.lead)  # each distinct prompt's images, once
    with _replayed(replay, shared.layout):
        logps, entropy, _ = packed_logps(model, shared.packed, head, temperature=temperature,
                                         with_entropy=with_entropy, **images)
    return logps.view(U * k, C)[rows], entropy.view(U * k, C)[rows] if with_entropy else None


@dataclass
class SharedPrompts:
    """Rows that share prompts, packed one sequence per distinct prompt (`shared_prompts`)."""

    packed: PackedGroups  # U sequences [prompt | block 1 | ... | block k], blocks of C - 1 tokens
    prompts: int  # U, the distinct prompts
    slots: int  # k, the most rows of one prompt
    rows: Tensor  # (R,) the slot of each row in the (U * k) slots, prompt by prompt
    lead: Tensor  # (U,) a row of each distinct prompt
    prompt_width: int  # P, the prompt columns of every sequence
    block: int  # C - 1, the columns of every completion block

    def layout(self, record: LinearRecord, rollout_rows: Tensor) -> Tensor:
        """Where each packed position is in the sampler's `record`, the rows (R,) being rollout rows `rollout_rows`."""
        slots = torch.full((self.prompts * self.slots,), -1, dtype=torch.long)  # the rollout row in each slot, or -1
        slots[self.rows.cpu()] = rollout_rows
        return record.layout(slots.view(self.prompts, self.slots), self.prompt_width, self.block)


def shared_prompts(model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor,
                   vision: dict[str, Tensor] | None = None) -> SharedPrompts | None:
    """The rows (R, P) / (R, C) packed by prompt (`logprobs.pack_groups`, blocks of C - 1 tokens: a completion's
    last token scores nothing), when that is estimated cheaper than the plain (R, P + C) forward and `model`'s
    attention takes a block mask ("sdpa", "eager"); else None. Rows share a prompt when their prompt ids and
    mask (and image group, with `vision`) agree."""
    R, C = completion_ids.shape
    P = prompt_ids.shape[1]
    first: dict[tuple, int] = {}  # prompt -> index of its sequence, by first appearance
    owner, block, taken = [], [], {}  # per row: its sequence and its completion block within it
    keys = torch.cat([prompt_ids, prompt_mask] + ([vision[IMAGE_GROUP][:, None].to(prompt_ids.device)]
                                                  if vision is not None else []), 1)
    for key in map(tuple, keys.tolist()):
        u = first.setdefault(key, len(first))
        taken[u] = taken.get(u, -1) + 1
        owner.append(u)
        block.append(taken[u])
    config = getattr(unwrap(model), "config", None)
    attn, hidden = attention_kind(model), getattr(config, "hidden_size", None) or 1024
    U, k = len(first), max(block) + 1

    def cost(rows: int, length: int) -> float:  # in token-forwards; a dense-mask attention pair costs ~1 / (6 hidden)
        return rows * length * (1 + length / (6 * hidden))

    B = C - 1  # a block's input tokens: a completion's last token scores nothing (its logits would score the next)
    if attn not in ("sdpa", "eager") or k == 1 or cost(U, P + k * B) >= cost(R, P + C):
        return None
    device = completion_ids.device
    rows = torch.tensor(owner, device=device) * k + torch.tensor(block, device=device)  # (R,) slot of each row
    lead = torch.zeros(U, dtype=torch.long, device=device)
    lead[torch.tensor(owner, device=device)] = torch.arange(R, device=device)  # a row of each sequence
    slot_ids = torch.zeros(U * k, C, dtype=completion_ids.dtype, device=device)  # empty slots: id 0, masked
    slot_ids[rows] = completion_ids
    slot_mask = torch.zeros(U * k, C, dtype=torch.bool, device=device)
    slot_mask[rows] = completion_mask.bool()
    packed = pack_groups(prompt_ids[lead], prompt_mask[lead], slot_ids.view(U, k, C), slot_mask.view(U, k, C), block=B)
    return SharedPrompts(packed, U, k, rows, lead, P, B)


def _replayed(replay, layout):
    """`replay.replaying` with the record laid out by `layout(record, rollout_rows)`; nothing without a replay."""
    if replay is None:
        return contextlib.nullcontext()
    record, rollout_rows, *last = replay
    return replaying(record, layout(record, rollout_rows.cpu()), bool(last and last[0]))


def _num_scored(completion_mask: Tensor) -> int:
    """K: the columns from the batch's first completion token on (token 0 has no context to be scored from)."""
    T = completion_mask.shape[1]
    first = int(completion_mask.any(0).to(torch.int8).argmax())
    return min(T - first, T - 1)


def completion_logps(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                     paired: bool = False, per_forward: int | None = None, model_inputs: dict | None = None):
    """Summed completion log-probs (N,), completion lengths (N,) and mean logits (N,) of [prompt | completion]
    rows (N, T), right-padded (the preference trainers' batches); the mean logits are detached.

    Only the columns from the first completion token on are scored (`_num_scored`), so the model
    computes no logits over the prompt columns shared by every row. With `paired` (rows i and
    i + N/2 share a prompt, as the paired collator lays them out, chosen rows first) each prompt goes
    through the model once where the output layer is plain and the attention takes a block mask:
    pair i becomes one sequence [prompt | chosen | rejected] (`pack_pairs`), so the model runs on
    P + C_chosen + C_rejected tokens instead of 2 P + C_chosen + C_rejected; equal to the two-row
    forward up to float rounding. On CPU, where a forward pass costs little beyond its tokens, pairs of
    uneven length then go through the model in groups of similar length (`length_groups`, `per_forward`
    = 16 tokens by default), so that less of the work is padding; on GPUs (`per_forward` None there) the
    batch stays whole.

    model_inputs: what else the forward takes for these rows (a vision-language model's pixel_values,
    image_grid_thw, ...); the rows then go through the model as they are, without pair packing (the image
    tokens of a row must meet its image features in one sequence).
    """
    T, K = input_ids.shape[1], _num_scored(completion_mask)
    model_inputs = model_inputs or {}
    head = plain_lm_head(model, input_ids)
    if paired and head is not None and attention_kind(model) in ("sdpa", "eager") and not model_inputs:
        return _paired_completion_logps(model, head, input_ids, attention_mask, completion_mask, per_forward)
    if head is None:
        logps, _, logits = token_logprobs(model, input_ids, attention_mask, num_scored=K, exact_positions=True,
                                          **model_inputs)
        with torch.no_grad():
            token_mean_logits = logits.mean(-1)  # (N, K)
    else:  # the model stops at its hidden states; the output layer is fused into the log-softmax
        hidden = last_hidden_states(model, input_ids=input_ids, attention_mask=attention_mask, **model_inputs)
        hidden = hidden[:, T - K - 1:T - 1]  # (N, K, H): position t scores token t + 1
        logps = linear_selective_log_softmax(hidden, head.weight, input_ids[:, T - K:])[0]
        with torch.no_grad():  # mean over the vocabulary of hidden @ W.T
            token_mean_logits = hidden @ head.weight.mean(0)
    mask = completion_mask[:, T - K:]
    lengths = mask.sum(-1)
    with torch.no_grad():
        mean_logits = (token_mean_logits * mask).sum(-1) / lengths.clamp(min=1)
    return sequence_logprobs(logps, mask), lengths, mean_logits.float()


def _paired_completion_logps(model, head, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                             per_forward: int | None):
    """`completion_logps(..., paired=True)` with the model's plain output layer `head`."""
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
    """`_paired_completion_logps` for one batch in one forward pass."""
    lengths = completion_mask.sum(-1)  # (2B,)
    packed = pack_pairs(input_ids, attention_mask, completion_mask)
    logps, _, hidden = packed_logps(model, packed, head, by_slot=True)  # (2B, K), (2B, K, H)
    mask = torch.arange(logps.shape[1], device=logps.device) < lengths[:, None]  # (2B, K) real completion tokens
    with torch.no_grad():
        mean_logits = ((hidden @ head.weight.mean(0)) * mask).sum(-1) / lengths.clamp(min=1)
    return sequence_logprobs(logps, mask), lengths, mean_logits.float()


def completion_token_logps(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                           model_inputs: dict | None = None):
    """Per-token log-probs (N, K) of the last K columns (as `completion_logps` scores them), the
    completion mask of those columns (N, K) and the logits that scored them (N, K, V).

    For losses that weight tokens (LD-DPO) or read the whole next-token distribution (WPO); unlike
    `completion_logps` it builds the (N, K, V) logits whole. model_inputs: as for `completion_logps`."""
    T, K = input_ids.shape[1], _num_scored(completion_mask)
    logps, _, logits = token_logprobs(model, input_ids, attention_mask, num_scored=K, exact_positions=True,
                                      **(model_inputs or {}))
    return logps, completion_mask[:, T - K:], logits


def completion_logits(model, mb: dict,
                      replay: tuple[LinearRecord, Tensor] | tuple[LinearRecord, Tensor, bool] | None = None):
    """The logits that score each completion token, (B, C, V), or `LinearLogits` (hidden (B, C, H), the output
    layer's weight) where the output layer is plain (`plain_lm_head`): then no logits are made here. With a plain
    output layer, rows that share a prompt go through the model packed (`shared_prompts`: each distinct prompt
    once), where that is cheaper; the hidden states equal the plain forward's up to float rounding. `replay`: as
    for `completion_logprobs`, the sampler's record of these rows' linear outputs (the policy's forward only)."""
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    attention = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    P, C = mb["prompt_ids"].shape[1], mb["completion_ids"].shape[1]
    positions = (attention.long().cumsum(-1) - 1).clamp(min=0)  # left-padded prompts: count real tokens only
    head = plain_lm_head(unwrap(model), ids)
    shared = None if head is None else shared_prompts(model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                                      mb["completion_mask"])
    if shared is not None:  # each distinct prompt once: its rows' completions side by side in one sequence
        with _replayed(replay, shared.layout):
            hidden = shared.packed.at_scores(last_hidden_states(model, **shared.packed.model_inputs(model)))
        return LinearLogits(hidden.view(shared.prompts * shared.slots, C, -1)[shared.rows], head.weight)
    with _replayed(replay, lambda record, rollout_rows: record.layout(rollout_rows[:, None], P, C)):
        if head is not None:
            hidden = last_hidden_states(model, input_ids=ids, attention_mask=attention, position_ids=positions)
            return LinearLogits(hidden[:, P - 1:P + C - 1], head.weight)
        keep = torch.arange(P - 1, P + C - 1, device=ids.device)
        return model(input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=keep,
                     use_cache=False).logits
