"""Dynamic sampling (DAPO: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
§3.2): a prompt whose `num_generations` samples all got the same reward has advantage 0 under a group-relative
estimator (GRPO's, RLOO's), so it adds nothing to the gradient but dilutes the batch. Such groups are dropped,
and more prompts are sampled until the batch holds as many groups whose rewards differ as it is meant to.

The engine draws whole generation batches (`max_num_gen_batches` at most), marks each group with
`informative_groups` and trains on the first groups kept, in the order they were drawn (`kept_rows`); the
surplus of the last batch drawn is discarded, as in verl.

Departure: a group is dropped when its rewards are exactly equal (max == min), not when a floating-point std
is below a threshold: rewards computed the same way are bit-equal, and a tiny real difference still orders the
samples.
"""

from __future__ import annotations

import torch
from torch import Tensor


def informative_groups(scores: Tensor, group_size: int) -> Tensor:
    """(P,) bool: whether the rewards of each group of `group_size` consecutive rows (prompt-major) differ.
    scores (P * group_size,); a NaN anywhere in a group makes it informative (the caller's reward decides)."""
    if scores.dim() != 1 or scores.numel() % group_size:
        raise ValueError(f"scores must have shape (P * {group_size},), whole groups of num_generations={group_size} "
                         f"consecutive rows; got {tuple(scores.shape)}")
    groups = scores.view(-1, group_size)
    return ~(groups == groups[:, :1]).all(1)


def kept_rows(informative: Tensor, group_size: int, groups: int) -> Tensor:
    """The row indices (groups * group_size,) of the first `groups` informative groups, each group's rows in
    order. informative (P,) bool over the groups drawn so far, in drawing order; ValueError if fewer are."""
    chosen = informative.nonzero().flatten()[:groups]
    if chosen.numel() < groups:
        raise ValueError(f"{int(informative.sum())} informative groups of {informative.numel()}; {groups} are needed")
    return (chosen[:, None] * group_size + torch.arange(group_size, device=chosen.device)).flatten()
