"""Rollouts put together: chosen rows of several rollouts (generation batches drawn one after another, as
dynamic sampling draws them; the groups a replay buffer kept, `trainers/grpo_replay_buffer.join_groups`) as one
`Rollout`, prompts left-padded and completions right-padded to the widest.
The sampler's record of linear outputs (`accel/replay.py`) indexes one rollout's rows, so none is kept."""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.rollout.generate import Rollout


def _pad_to(x: Tensor, width: int, value, left: bool = False) -> Tensor:
    """(N, W) -> (N, width), `value` added on the left or the right."""
    extra = width - x.shape[1]
    return torch.nn.functional.pad(x, (extra, 0) if left else (0, extra), value=value) if extra else x


def take_rows(parts: list[Rollout], rows: Tensor, pad_token_id: int) -> Rollout:
    """The rollout of `rows` (indices into the parts' rows, concatenated in order) of `parts`."""
    rows = rows.to(parts[0].completion_ids.device)
    P = max(r.prompt_ids.shape[1] for r in parts)
    C = max(r.completion_ids.shape[1] for r in parts)

    def joined(key: str, width: int, value, left: bool = False) -> Tensor:
        return torch.cat([_pad_to(getattr(r, key), width, value, left) for r in parts])[rows]

    tool_mask = None
    if any(r.tool_mask is not None for r in parts):  # rounds without fed tokens: a mask of 0s
        tool_mask = torch.cat([_pad_to(r.tool_mask if r.tool_mask is not None else torch.zeros_like(
            r.completion_mask), C, 0) for r in parts])[rows]
    return Rollout(prompt_ids=joined("prompt_ids", P, pad_token_id, left=True),
                   prompt_mask=joined("prompt_mask", P, 0, left=True),
                   completion_ids=joined("completion_ids", C, pad_token_id),
                   completion_mask=joined("completion_mask", C, 0), logprobs=joined("logprobs", C, 0.0),
                   is_truncated=torch.cat([r.is_truncated for r in parts])[rows], tool_mask=tool_mask)
