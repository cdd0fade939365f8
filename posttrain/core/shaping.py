"""Reward shaping: from the reward functions' total per completion to what the advantage estimator reads.

`shape_rewards` is the one place where the order is fixed, since it is where RLHF bugs hide:

  1. missing-EOS penalty   score - p for each completion that stopped without EOS / a stop token;
     registered steps      each step of `SHAPING_STEPS` that the config turns on adds its term to the score
                           (DAPO's overlong penalty), in registration order;
  2. normalise             z-score over the batch: (s - mean) / (std + 1e-8), std with n - 1;
  3. clip                  to [-c, c] or [low, high]; after normalising, so c is in standard deviations;
  4. KL penalty            -kl_coef * KL_t per token (KL in the reward, PPO / RLOO / REINFORCE++). Per-token
                           estimators (`per_token`) keep it per token with `token_level_kl`; otherwise its
                           sum over the completion joins the sequence score;
  5. whiten                divide by the std, keeping the mean: over every masked token of the per-token
                           rewards (score at the last token + the KL) for per-token estimators, else over
                           the sequence scores (each completion once, masked rows included).

The score penalised but not yet normalised is returned too: it is what reward metrics report.
Statistics are over the tensors given; a multi-process caller gathers the batch first.

A registered shaping step is one function `fn(scores, lengths, *, options) -> term (B,)`, the term added to each
completion's score; its options are the config fields of their names (`Registry.option` declares the new ones)
and its `switch` is the option that turns it on (the step runs when that option is not None):

  overlong   DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13): with L = max_completion_length and
             a buffer of b = overlong_buffer_len tokens, a completion of |y| tokens gets
             min(0, (L - b - |y|) / b) * overlong_penalty_factor: 0 up to L - b tokens, then falling linearly
             to -overlong_penalty_factor at L (a truncated completion). verl's `overlong_buffer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from posttrain.core.advantages import per_token_rewards
from posttrain.core.kl import kl_penalty
from posttrain.core.masked import masked_whiten
from posttrain.core.registry import Registry

NORMALIZE_EPS = 1e-8


@dataclass(frozen=True)
class ShapingStep:
    """A registered reward-shaping step and its facts."""

    fn: Callable[..., Tensor]  # fn(scores (B,), lengths (B,), **options) -> the term added to each score (B,)
    switch: str  # the option that turns the step on: it runs when the config's value of it is not None
    options: tuple[str, ...]  # fn's keyword-only parameters, each read from the config field of that name


SHAPING_STEPS = Registry("reward shaping step", ShapingStep, positional=("scores", "lengths"))
SHAPING_STEPS.option("overlong_buffer_len", None, "DAPO's overlong reward shaping: completions longer than "
                     "max_completion_length - overlong_buffer_len tokens lose up to overlong_penalty_factor of "
                     "reward, linearly over this buffer (verl's overlong_buffer.len; None: off).", bound=(1, None),
                     what="tokens of the overlong buffer")
SHAPING_STEPS.option("overlong_penalty_factor", 1.0, "The overlong penalty at max_completion_length (verl's "
                     "overlong_buffer.penalty_factor, >= 0).", bound=(0, None))


@SHAPING_STEPS.register("overlong", switch="overlong_buffer_len")
def overlong_penalty(scores: Tensor, lengths: Tensor, *, overlong_buffer_len: int, max_completion_length: int,
                     overlong_penalty_factor: float = 1.0) -> Tensor:
    """min(0, (L - b - |y|) / b) * factor per completion (B,); L = max_completion_length, b = overlong_buffer_len,
    |y| = lengths (B,) the completion's tokens."""
    expected = max_completion_length - overlong_buffer_len
    excess = lengths.to(scores.dtype) - expected
    return (-excess / overlong_buffer_len).clamp(max=0.0) * overlong_penalty_factor


@dataclass(frozen=True)
class RewardShaping:
    """The switches of `shape_rewards`; the defaults change nothing."""

    missing_eos_penalty: float | None = None  # subtracted from the score of a truncated completion
    normalize: bool = False  # z-score the scores over the batch
    clip_range: float | tuple[float, float] | None = None  # c: [-c, c]; (low, high): [low, high]; None: no clip
    kl_in_reward: bool = False  # -kl_coef * KL goes into the reward (else the KL is the loss's business)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # a core.kl estimator
    steps: tuple[tuple[str, dict], ...] = ()  # (a SHAPING_STEPS name, its options) for each step turned on
    per_token: bool = False  # the advantage estimator reads per-token rewards (gae, reinforce_pp)
    token_level_kl: bool = False  # with per_token: the KL stays at each token instead of joining the score
    whiten: bool = False  # scale to unit variance, keeping the mean


@dataclass(frozen=True)
class ShapedRewards:
    scores: Tensor  # (B,) sequence scores for the advantage estimator (0 after per-token whitening)
    token_rewards: Tensor | None  # (B, T) per-token rewards besides the score, 0 off the mask; None: none
    penalized_scores: Tensor  # (B,) the scores after the missing-EOS penalty and the registered steps (reward metrics)
    terms: dict[str, Tensor]  # each registered step's term (B,), by its name


def normalize_then_sum(per_function: Tensor, weights: Tensor, group_size: int) -> Tensor:
    """GDPO's way of combining several rewards (`multi_objective_aggregation="normalize_then_sum"`), before
    any step of `shape_rewards`: each reward z-scored within its prompt's group (std with k - 1, + 1e-4; a
    reward function's abstention, NaN, counts 0 after), then the weighted sum. `per_function` (N, F) holds
    whole groups of `group_size` consecutive rows; returns (N,)."""
    k = group_size
    groups = per_function.view(-1, k, per_function.shape[1])  # (P, k, F)
    mean = groups.nanmean(1, keepdim=True)
    std = torch.sqrt(((groups - mean) ** 2).nanmean(1, keepdim=True) * k / max(k - 1, 1))
    normalized = torch.nan_to_num((groups - mean) / (std + 1e-4), nan=0.0).view_as(per_function)
    return (normalized * weights.to(normalized.device)).sum(1)


def clip_scores(scores: Tensor, clip_range: float | tuple[float, float] | None) -> Tensor:
    """Scores clipped to `clip_range`: c to [-c, c], a (low, high) pair to [low, high]; None: as they are."""
    if clip_range is None:
        return scores
    low, high = (-clip_range, clip_range) if isinstance(clip_range, (int, float)) else clip_range
    return scores.clamp(low, high)


def shape_rewards(scores: Tensor, mask: Tensor, shaping: RewardShaping, *, truncated: Tensor | None = None,
                  logp: Tensor | None = None, ref_logp: Tensor | None = None,
                  lengths: Tensor | None = None) -> ShapedRewards:
    """Steps 1-5 of the module docstring, in that order. Pure: the inputs are not modified.

    scores (B,) float: the rewards' total per completion.   mask (B, T): 1 on the tokens that are trained on
    (an all-0 row gets no per-token reward and no KL).   truncated (B,) bool: completions without EOS / a stop
    token (needed with missing_eos_penalty).   logp, ref_logp (B, T): log-probs of the sampled tokens under
    the sampling policy and the reference (needed with kl_in_reward and kl_coef > 0).   lengths (B,): each
    completion's tokens (needed with registered steps; the mask may leave rows out of the loss).
    """
    B = scores.shape[0]
    if scores.dim() != 1:
        raise ValueError(f"scores must have shape (B,), one per completion; got {tuple(scores.shape)}")
    if mask.dim() != 2 or mask.shape[0] != B:
        raise ValueError(f"mask must have shape (B, T) with B = {B} (the scores); got {tuple(mask.shape)}")
    if shaping.missing_eos_penalty is not None:
        if truncated is None or truncated.shape != (B,):
            raise ValueError(f"missing_eos_penalty needs truncated of shape ({B},), one flag per completion; got "
                             f"{None if truncated is None else tuple(truncated.shape)}")
        scores = scores - shaping.missing_eos_penalty * truncated.float()
    terms = {}
    for name, options in shaping.steps:
        if lengths is None or lengths.shape != (B,):
            raise ValueError(f"the {name!r} reward shaping step needs lengths of shape ({B},), one per completion; "
                             f"got {None if lengths is None else tuple(lengths.shape)}")
        terms[name] = SHAPING_STEPS.choose(name).fn(scores, lengths, **options)
        scores = scores + terms[name]
    penalized = scores
    if shaping.normalize:
        scores = (scores - scores.mean()) / (scores.std() + NORMALIZE_EPS)
    scores = clip_scores(scores, shaping.clip_range)
    token_rewards = None
    if shaping.kl_in_reward and shaping.kl_coef > 0:
        for name, x in (("logp", logp), ("ref_logp", ref_logp)):
            if x is None or x.shape != mask.shape:
                raise ValueError(f"kl_in_reward with kl_coef={shaping.kl_coef} needs {name} of shape "
                                 f"{tuple(mask.shape)} (as mask); got {None if x is None else tuple(x.shape)}")
        token_rewards = -shaping.kl_coef * torch.where(mask.bool(), kl_penalty(logp, ref_logp, shaping.kl_estimator),
                                                       0.0)
        if not (shaping.per_token and shaping.token_level_kl):  # the summed penalty joins the sequence score
            scores, token_rewards = scores + token_rewards.sum(1), None
    if shaping.whiten and shaping.per_token:
        rewards = per_token_rewards(scores, mask, token_rewards)
        scores, token_rewards = torch.zeros_like(scores), masked_whiten(rewards, mask, shift_mean=False)
    elif shaping.whiten:
        scores = masked_whiten(scores, torch.ones_like(scores), shift_mean=False)
    return ShapedRewards(scores=scores, token_rewards=token_rewards, penalized_scores=penalized, terms=terms)
