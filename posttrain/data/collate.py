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
