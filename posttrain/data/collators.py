"""TRL's public data collators, with TRL's field names in and out, for custom training loops.

* `DataCollatorForLanguageModeling`: tokenised rows -> a causal-LM batch (input_ids, attention_mask,
  position_ids, labels), padded or padding-free, with completion-only and assistant-only masks.
* `DataCollatorForPreference`: prompt_ids / chosen_ids / rejected_ids -> one batch of 2B rows, the
  chosen sequences first, with a completion_mask (TRL's current DPO collator).
* `DataCollatorForUnpairedPreference`: prompt_ids / completion_ids (/ KL_completion_ids) ->
  completion_input_ids, completion_attention_mask, completion_mask (KTO's collator).

All pad with `posttrain.data.collate.pad`. posttrain's own trainers keep their internal collators
(`LanguageModelingCollator`, `PreferenceCollator`); these are for code written against TRL's.

Departure from TRL (also in docs/migrating.md): in `DataCollatorForLanguageModeling`, where one row
holds several sequences (padding_free, or packed rows with `seq_lengths`), the label of each
sequence's first token after the first is -100: TRL keeps it, so the loss trains the last token
of one sequence to predict the first of the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.data.data_collator import DataCollatorMixin

from posttrain.data.collate import IGNORE_INDEX, pad

__all__ = ["DataCollatorForLanguageModeling", "DataCollatorForPreference", "DataCollatorForUnpairedPreference"]


def pad_to(sequences: list[list[int]], value: int, multiple: int | None = None, side: str = "right") -> torch.Tensor:
    """`pad(sequences, value, side)`, its width rounded up to a multiple of `multiple` (None: not rounded)."""
    out = pad(sequences, value, side)
    if multiple and out.shape[1] % multiple:
        extra = torch.full((out.shape[0], multiple - out.shape[1] % multiple), value, dtype=out.dtype)
        out = torch.cat([out, extra] if side == "right" else [extra, out], dim=1)
    return out


def _first(example: dict, *keys: str):
    """The value of the first of `keys` that `example` has, or a KeyError naming them all."""
    for key in keys:
        if key in example:
            return example[key]
    raise KeyError(f"the example has none of the fields {list(keys)}; it has {sorted(example)}")


def _positions(example: dict, length: int) -> list[int]:
    """Position ids restarting at 0 for each of the example's `seq_lengths` (one sequence when absent)."""
    lengths = example.get("seq_lengths") or [length]
    if sum(lengths) != length:
        raise ValueError(f"seq_lengths {list(lengths)} add up to {sum(lengths)}, but input_ids has {length} tokens")
    return [p for n in lengths for p in range(n)]


@dataclass
class DataCollatorForLanguageModeling(DataCollatorMixin):
    """Rows {"input_ids", optional "labels", "completion_mask", "assistant_masks", "seq_lengths"} -> a batch
    (posttrain's SFT rows, with "loss_mask", work too: it is the data_collator SFTTrainer can be given).

    Output: input_ids (pad_token_id-padded), attention_mask (absent when padding-free rows are packed with
    seq_lengths, so attention stays within each sequence), position_ids (restarting per packed sequence; with
    return_position_ids), labels (the row's labels or its input_ids; -100 on padding, outside the completion
    when completion_only_loss and a completion_mask is given, outside assistant turns when assistant_masks is
    given or where a "loss_mask" is 0, and on every packed sequence's first token but the row's first).

    padding_free: the whole batch becomes one row of shape (1, N) with no padding. pad_to_multiple_of: pad
    the padded layout's width to a multiple of this. return_tensors: only "pt".
    """

    pad_token_id: int
    completion_only_loss: bool = True
    padding_free: bool = False
    return_position_ids: bool = True
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [list(_first(e, "input_ids")) for e in examples]
        labels = [list(e["labels"]) if "labels" in e else list(s) for e, s in zip(examples, ids)]
        positions = [_positions(e, len(s)) for e, s in zip(examples, ids)]
        # loss_mask: rows that posttrain's SFTTrainer prepared, whose masks are decided already
        masks = [k for k in ("completion_mask", "assistant_masks", "loss_mask")
                 if k in examples[0] and (k != "completion_mask" or self.completion_only_loss)]
        for row, example in enumerate(examples):
            for key in masks:
                labels[row] = [t if m else IGNORE_INDEX for t, m in zip(labels[row], example[key])]
            # a sequence that follows another in its row (packed, or flattened) is not predicted from it
            first = 0 if self.padding_free and row else 1
            labels[row] = [IGNORE_INDEX if p == 0 and j >= first else t
                           for j, (t, p) in enumerate(zip(labels[row], positions[row]))]
        packed = self.padding_free and self.return_position_ids and "seq_lengths" in examples[0]
        if self.padding_free:
            flat = lambda rows: torch.tensor([[t for r in rows for t in r]], dtype=torch.long)  # noqa: E731
            batch = {"input_ids": flat(ids)}
            if not packed:
                batch["attention_mask"] = torch.ones_like(batch["input_ids"])
            if self.return_position_ids:
                batch["position_ids"] = flat(positions)
            batch["labels"] = flat(labels)
            return batch
        multiple = self.pad_to_multiple_of
        batch = {"input_ids": pad_to(ids, self.pad_token_id, multiple),
                 "attention_mask": pad_to([[1] * len(s) for s in ids], 0, multiple)}
        if self.return_position_ids:
            batch["position_ids"] = pad_to(positions, 0, multiple)
        batch["labels"] = pad_to(labels, IGNORE_INDEX, multiple)
        return batch


def _ref_logps(examples: list[dict], keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor([float(e[k]) for e in examples]) for k in keys if k in examples[0]}


@dataclass
class DataCollatorForPreference(DataCollatorMixin):
    """Rows {"prompt_ids", "chosen_ids", "rejected_ids", optional "ref_chosen_logps", "ref_rejected_logps"} ->
    input_ids, attention_mask, completion_mask of shape (2B, T): rows 0..B-1 are prompt + chosen, rows B..2B-1
    prompt + rejected, right-padded; completion_mask is 1 on the completion tokens. The reference log-probs
    come out as (B,) tensors. TRL's older field names (prompt_input_ids, chosen_input_ids, rejected_input_ids)
    are read too."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        prompts = [list(_first(e, "prompt_ids", "prompt_input_ids")) for e in examples]
        completions = [list(_first(e, f"{side}_ids", f"{side}_input_ids")) for side in ("chosen", "rejected")
                       for e in examples]
        prompts = prompts + prompts
        multiple = self.pad_to_multiple_of
        batch = {
            "input_ids": pad_to([p + c for p, c in zip(prompts, completions)], self.pad_token_id, multiple),
            "attention_mask": pad_to([[1] * (len(p) + len(c)) for p, c in zip(prompts, completions)], 0, multiple),
            "completion_mask": pad_to([[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions)], 0,
                                      multiple),
        }
        return {**batch, **_ref_logps(examples, ("ref_chosen_logps", "ref_rejected_logps"))}


@dataclass
class DataCollatorForUnpairedPreference(DataCollatorMixin):
    """Rows {"prompt_ids", "completion_ids", "label", optional "KL_completion_ids", "ref_logps", "ref_KL_logps"}
    -> for each of "completion" and (when given) "KL_completion": `{prefix}_input_ids` (prompt + completion,
    cut to max_length, right-padded), `{prefix}_attention_mask`, `{prefix}_mask` (1 on the completion tokens);
    ref_logps / ref_KL_logps as (B,) tensors; label as a list of bools."""

    pad_token_id: int
    max_length: int | None = None
    return_tensors: str = "pt"

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = {}
        for prefix in ("completion", "KL_completion"):
            if f"{prefix}_ids" not in examples[0]:
                continue
            seqs = [list(e["prompt_ids"]) + list(e[f"{prefix}_ids"]) for e in examples]
            marks = [[0] * len(e["prompt_ids"]) + [1] * len(e[f"{prefix}_ids"]) for e in examples]
            if self.max_length is not None:
                seqs, marks = [s[:self.max_length] for s in seqs], [m[:self.max_length] for m in marks]
            batch[f"{prefix}_input_ids"] = pad(seqs, self.pad_token_id)
            batch[f"{prefix}_attention_mask"] = pad([[1] * len(s) for s in seqs], 0)
            batch[f"{prefix}_mask"] = pad(marks, 0)
        batch.update(_ref_logps(examples, ("ref_logps", "ref_KL_logps")))
        batch["label"] = [e["label"] for e in examples]
        return batch
