"""TRL's reward functions (`trl.rewards`), with TRL's names and call signatures, for `reward_funcs=`.

GRPO/RLOO call a reward function with the keyword arguments its signature names (`completions`,
`completion_ids`, `prompts`, every dataset column such as `solution`, and the trainer's `log_extra` /
`log_metric`); all of these take `**kwargs`, so they receive everything. A completion may be a
string (standard prompts) or a list of messages (conversational prompts, TRL's form); the text read
is the string, or the content of the list's last message (TRL reads the first: the same for the
one-message completions a single-turn rollout gives).

* `accuracy_reward`, `reasoning_accuracy_reward`: 1.0 when the completion's final answer equals the
  gold `solution` as math, 0.0 when not, None (abstain) when the gold cannot be read. Answers are read
  and compared by `posttrain.tasks.math_answers` (SymPy) rather than TRL's `math-verify`: no extra to install.
* `think_format_reward`: 1.0 when the completion opens with one `<think>...</think>` block.
* `get_cosine_scaled_reward` (Yeo et al. 2025, "Demystifying Long Chain-of-Thought Reasoning in
  LLMs", App. C.1): correctness scaled by length along a cosine, short correct answers best.
* `get_repetition_penalty_reward` (same paper, App. C.2): minus the share of repeated token n-grams.
* `get_soft_overlong_punishment` (DAPO, Yu et al. 2025, Eq. 13): a linear penalty over the last
  `soft_punish_cache` tokens before `max_completion_len`, -1 beyond it.

The factories return small callable objects (picklable, named like TRL's inner functions).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

from posttrain.tasks.math_answers import answers_equal, extract_answer, parse_answer

__all__ = ["accuracy_reward", "get_cosine_scaled_reward", "get_repetition_penalty_reward",
           "get_soft_overlong_punishment", "reasoning_accuracy_reward", "think_format_reward"]


def completion_text(completion) -> str:
    """A completion's text: the string itself, or the content of a message list's last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return completion[-1].get("content") or ""
    raise TypeError(f"a completion must be a string or a list of messages, got {type(completion).__name__}")


def _check_lengths(completions: Sequence, solution: Sequence) -> None:
    if len(completions) != len(solution):
        raise ValueError(f"{len(completions)} completions but {len(solution)} solutions; give one solution per "
                         f"completion (a 'solution' dataset column)")


def _score(text: str | None, gold) -> tuple[float | None, str]:
    """(reward, what was read from the answer) against a parsed gold answer (None: abstain)."""
    if gold is None:
        return None, "[skipped]"
    answer = extract_answer(text) if text is not None else None
    parsed = parse_answer(answer) if answer is not None else None
    return float(answers_equal(gold, parsed)), str(list(parsed)) if parsed else "[unparseable]"


def _math_rewards(texts: list[str | None], solution: Sequence[str], log_extra) -> list[float | None]:
    golds = [parse_answer(extract_answer(str(s), anchored=False)) for s in solution]
    scored = [_score(t, g) if t is not None else (0.0, "[incomplete reasoning]") for t, g in zip(texts, golds)]
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", [str(list(g)) if g else "[unparseable]" for g in golds])
        log_extra("answer_parsed", [read for _, read in scored])
    return [reward for reward, _ in scored]


def accuracy_reward(completions: list, solution: list[str], log_extra: Callable[[str, list], None] | None = None,
                    **kwargs) -> list[float | None]:
    """1.0 where the completion's answer (its last \\boxed{...} or math span) equals `solution` as math, else
    0.0; None where the solution cannot be read. `log_extra` (given by the trainer) receives the solution, the
    gold as read and the answer as read, as extra completion-table columns."""
    _check_lengths(completions, solution)
    return _math_rewards([completion_text(c) for c in completions], solution, log_extra)


def reasoning_accuracy_reward(completions: list, solution: list[str], reasoning_delimiters: list[str] | None = None,
                              log_extra: Callable[[str, list], None] | None = None, **kwargs) -> list[float | None]:
    """`accuracy_reward` on what follows the reasoning: the text after the last occurrence of the first of
    `reasoning_delimiters` (default ["</think>"]) found in the completion; 0.0 when none is found (the
    reasoning never ended), so an answer inside unfinished reasoning earns nothing."""
    _check_lengths(completions, solution)
    delimiters = ["</think>"] if reasoning_delimiters is None else reasoning_delimiters
    texts = []
    for completion in completions:
        text = completion_text(completion)
        delimiter = next((d for d in delimiters if d in text), None)
        texts.append(text.split(delimiter)[-1] if delimiter is not None else None)
    return _math_rewards(texts, solution, log_extra)


_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 where the completion starts with `<think>`, closes it with `</think>` and opens no second `<think>`;
    else 0.0."""
    return [1.0 if _THINK.match(completion_text(c)) else 0.0 for c in completions]


class _CosineScaledReward:
    __name__ = "cosine_scaled_reward"

    def __init__(self, max_len: int, min_value_wrong: float, max_value_wrong: float, min_value_correct: float,
                 max_value_correct: float):
        self.max_len = max_len
        self.wrong = (max_value_wrong, min_value_wrong)  # (at max_len, at length 0): short wrong answers cost most
        self.correct = (min_value_correct, max_value_correct)  # short correct answers earn most

    def __call__(self, completions: list, solution: list[str], completion_ids: list[list[int]],
                 **kwargs) -> list[float | None]:
        rewards = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids):
            if correct is None:
                rewards.append(None)
                continue
            low, high = self.correct if correct else self.wrong
            cosine = math.cos(min(len(ids) / self.max_len, 1.0) * math.pi)  # held at -1 past max_len
            rewards.append(low + 0.5 * (high - low) * (1.0 + cosine))
        return rewards


def get_cosine_scaled_reward(max_len: int, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0) -> Callable:
    """A reward function (completions, solution, completion_ids) -> v_min + (v_max - v_min)(1 + cos(pi L /
    max_len)) / 2, L the completion's token count (capped at max_len). Correct answers (as `accuracy_reward`
    judges) go from max_value_correct (L = 0) to min_value_correct (L >= max_len); wrong ones from
    min_value_wrong to max_value_wrong, so a long wrong answer is penalised less; None where the solution
    cannot be read."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    return _CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)


class _RepetitionPenalty:
    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float):
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            ngrams = [tuple(ids[i:i + self.ngram_size]) for i in range(len(ids) - self.ngram_size + 1)]
            repeated = 1 - len(set(ngrams)) / len(ngrams) if ngrams else 0.0
            rewards.append(repeated * self.max_penalty if repeated else 0.0)
        return rewards


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> Callable:
    """A reward function (completion_ids) -> (1 - unique n-grams / n-grams) * max_penalty over the completion's
    token n-grams: 0.0 without repeats (or with fewer than `ngram_size` tokens), near `max_penalty` when
    everything repeats."""
    if ngram_size <= 0:
        raise ValueError(f"ngram_size must be greater than 0, got {ngram_size}")
    if max_penalty > 0:
        raise ValueError(f"max_penalty {max_penalty} should not be positive")
    return _RepetitionPenalty(ngram_size, max_penalty)


class _SoftOverlongPunishment:
    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        self.max_completion_len, self.soft_punish_cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        free = self.max_completion_len - self.soft_punish_cache  # lengths up to here cost nothing
        return [0.0 if len(ids) <= free else -1.0 if len(ids) > self.max_completion_len
                else (free - len(ids)) / self.soft_punish_cache for ids in completion_ids]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """A reward function (completion_ids) -> 0 for L <= max_completion_len - soft_punish_cache, falling linearly
    to -1 at L = max_completion_len, -1 beyond (L the completion's token count)."""
    if soft_punish_cache < 0 or soft_punish_cache > max_completion_len:
        raise ValueError(f"soft_punish_cache must be in [0, max_completion_len={max_completion_len}], "
                         f"got {soft_punish_cache}")
    return _SoftOverlongPunishment(max_completion_len, soft_punish_cache)
