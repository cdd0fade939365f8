"""Padding collation: lists of token-id lists -> rectangular tensors."""

from __future__ import annotations

import torch


def pad(sequences: list[list[int]], value: int, side: str = "right", dtype=torch.long) -> torch.Tensor:
    """(B, T_max) tensor of `sequences` padded with `value` on `side` ("right" or "left")."""
    width = max((len(s) for s in sequences), default=0)
    out = torch.full((len(sequences), width), value, dtype=dtype)
    for i, seq in enumerate(sequences):
        if len(seq):
            if side == "right":
                out[i, : len(seq)] = torch.as_tensor(seq, dtype=dtype)
            else:
                out[i, width - len(seq):] = torch.as_tensor(seq, dtype=dtype)
    return out


IGNORE_INDEX = -100  # label value that the loss skips
MASK_COLUMNS = ("loss_mask", "completion_mask", "assistant_masks")  # the loss mask of a row, first present wins


class LanguageModelingCollator:
    """Tokenised rows -> a causal-LM batch with `labels` (-100 where no loss is taken).

    A row has `input_ids`, optionally `loss_mask` (1 where the token is a training target; all
    ones when absent; TRL's `completion_mask` or `assistant_masks` of rows tokenised beforehand
    serve when it is absent) and `seq_lengths` (the sequences a packed row holds; one when absent).
    The first token of every sequence is never a target, so a packed sequence is never
    predicted from the one before it.

    Layouts:
      * padding_free: the whole batch becomes ONE row, no padding; `position_ids` restart at 0
        for each sequence and there is no attention mask, which transformers reads as
        block-diagonal (packed) attention.
      * packed rows (some row holds several sequences): right-padded rows with restarting
        `position_ids` and no attention mask; attention stays within each row's sequences, and
        costs B * T^2 rather than (B * T)^2 for the single row above.
      * otherwise: right-padded rows with an `attention_mask` (`flatten_padded` turns such a batch
        into the padding-free layout later, where that is cheaper).
    """

    def __init__(self, pad_token_id: int, padding_free: bool = False):
        self.pad_token_id = pad_token_id
        self.padding_free = padding_free

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        ids, labels, positions = [], [], []
        for row in rows:
            seq = list(row["input_ids"])
            mask = next((row[k] for k in MASK_COLUMNS if row.get(k) is not None), None)
            lab = [t if m else IGNORE_INDEX for t, m in zip(seq, mask)] if mask is not None else list(seq)
            pos, start = [], 0
            for n in row.get("seq_lengths") or [len(seq)]:
                if n:
                    lab[start] = IGNORE_INDEX
                pos.extend(range(n))
                start += n
            ids.append(seq)
            labels.append(lab)
            positions.append(pos)
        if self.padding_free:
            flat = lambda xs: torch.tensor([[t for x in xs for t in x]], dtype=torch.long)  # noqa: E731
            return {"input_ids": flat(ids), "labels": flat(labels), "position_ids": flat(positions)}
        batch = {"input_ids": pad(ids, self.pad_token_id), "labels": pad(labels, IGNORE_INDEX)}
        if any(len(row.get("seq_lengths") or ()) > 1 for row in rows):
            # pads continue the last sequence's positions: they come after it, so causality hides them
            width = batch["input_ids"].shape[1]
            batch["position_ids"] = pad([p + list(range(p[-1] + 1, p[-1] + 1 + width - len(p))) if p else []
                                         for p in positions], 0)
        else:
            batch["attention_mask"] = pad([[1] * len(s) for s in ids], 0)
        return batch


def flatten_padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """A right-padded causal-LM batch {input_ids, labels, attention_mask} (B, T) in the padding-free
    layout: ONE row (1, N) of its N real tokens, `position_ids` restarting at 0 for each row, no
    attention mask. None when that would change which tokens are targets (a row padded on the left,
    or a target on padding): a row's first label becomes IGNORE_INDEX, as no padded row predicts it.
    """
    mask = batch["attention_mask"].bool()  # (B, T)
    lengths = mask.sum(1)  # (B,)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # (B, T)
    labels = batch["labels"]
    if not torch.equal(mask, positions < lengths[:, None]) or bool((labels[~mask] != IGNORE_INDEX).any()):
        return None
    labels = labels.masked_fill(positions == 0, IGNORE_INDEX)  # else it would be the previous row's last target
    return {"input_ids": batch["input_ids"][mask][None], "labels": labels[mask][None],
            "position_ids": positions[mask][None]}
