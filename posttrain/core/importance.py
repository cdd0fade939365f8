"""Importance-sampling corrections for samples drawn by another sampler than the policy the loss calls π_old.

The loss's ratio π/π_old assumes the completions were sampled from π_old. When another sampler drew them, a
behaviour policy μ (vLLM, whose kernels give slightly other numbers than the training forward; or a policy some
steps older, as an asynchronous generator is), each token's policy loss is weighted by an estimate of π_old/μ,
bounded so that a few tokens μ found unlikely cannot dominate the batch. TRL's `vllm_importance_sampling_mode`
names the four corrections registered here, two choices crossed:

  level       token:     w_t = π_old(y_t) / μ(y_t), one weight per token;
              sequence:  w = Π_t π_old(y_t) / μ(y_t) over the completion's tokens, one weight for all of them;
  constraint  truncate:  w -> min(max(w, clip_min), clip_max) (truncated importance sampling, TIS: Yao et al.
                         2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training");
              mask:      w -> 0 where w is outside [clip_min, clip_max], else w unchanged (masked importance
                         sampling, MIS: the token, or the whole sequence, leaves the gradient).

clip_min None means no lower bound. Every entry has one signature, `fn(old_logp, behaviour_logp, mask,
clip_min, clip_max) -> weights (B, T)`: old_logp (B, T) log π_old of the sampled tokens (the training forward's),
behaviour_logp (B, T) the sampler's log-prob of the same tokens, mask (B, T) 1 on the completion tokens; the
weights are 0 on padding and carry no gradient. The engine multiplies each token's policy loss by them.

Departure: the log-ratio is capped at log clip_max before it is exponentiated (and the mask modes test it against
log clip_min, log clip_max), so a long sequence whose summed log-ratio is large gives the cap (or a 0), never
exp(...) = inf.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from posttrain.core.registry import Registry


@dataclass(frozen=True)
class ImportanceCorrection:
    """A registered correction and its facts."""

    fn: Callable[..., Tensor]  # fn(old_logp, behaviour_logp, mask, clip_min, clip_max) -> weights (B, T)
    level: str  # "token": a weight per token; "sequence": one per completion
    constraint: str  # "truncate": clipped into [clip_min, clip_max]; "mask": 0 outside it


IMPORTANCE_CORRECTIONS = Registry("importance-sampling correction", ImportanceCorrection)


def log_importance_ratio(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """log π_old/μ: per token (B, T), 0 on padding; "sequence": its sum over each completion (B, 1)."""
    log_ratio = torch.where(mask.bool(), old_logp.detach() - behaviour_logp.detach(), 0.0)
    return log_ratio.sum(-1, keepdim=True) if level == "sequence" else log_ratio


def importance_weights(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, clip_min: float | None,
                       clip_max: float, *, level: str, constraint: str) -> Tensor:
    """The weights (B, T) of the module docstring for one (level, constraint); clip_max > 0, clip_min None or >= 0."""
    log_ratio = log_importance_ratio(old_logp, behaviour_logp, mask, level).double()
    low = -math.inf if not clip_min else math.log(clip_min)  # clip_min 0 or None: no lower bound
    high = math.log(clip_max)
    ratio = torch.exp(log_ratio.clamp(max=high))  # never inf; the clamp below gives the bounds exactly
    if constraint == "truncate":
        weights = ratio.clamp(min=clip_min or None, max=clip_max)
    else:
        weights = torch.where((log_ratio >= low) & (log_ratio <= high), ratio, 0.0)
    return torch.where(mask.bool(), weights.expand_as(mask).to(old_logp.dtype), 0.0)


for _level in ("token", "sequence"):
    for _constraint in ("truncate", "mask"):
        IMPORTANCE_CORRECTIONS.add(f"{_level}_{_constraint}", functools.partial(
            importance_weights, level=_level, constraint=_constraint), level=_level, constraint=_constraint)
