"""Distillation between two tokenizers: text alignment of two tokenisations and the Universal Logit Distillation loss.

  align_by_text   Two tokenisations of the same text (each token's end as a character offset) are cut into
                  groups where both have a token boundary at the same character: group g holds the student
                  tokens and the teacher tokens that together spell the same piece of text. One token per side
                  per group where the tokenizers agree; where one splits a word the other keeps whole, the
                  group holds several tokens of one side and one (or several) of the other. Text one side has
                  and the other lacks ends in a last group of whatever is left. (The alignment of TRL's GOLD,
                  "Unlocking On-Policy Distillation for Any Model Family", Hugging Face 2025.)
  merge_groups    One distribution per group from the group's per-token distributions: their product,
                  renormalised (log-probs summed, then log-softmax), as TRL's GOLD merges split tokens. It is a
                  pooling rule, not a probability of the group's text: each token's distribution is over a
                  different next piece of text; the product keeps every token of the group in the loss.
  uld_distance    Universal Logit Distillation (Boizard et al. 2024, "Towards Cross-Tokenizer Distillation:
                  the Universal Logit Distillation Loss for LLMs"): each probability vector sorted in
                  descending order, the smaller vocabulary padded with zeros, and the L1 distance between them,
                  a closed form of the Wasserstein distance when every pair of tokens is one unit apart. It
                  needs no token correspondence, so it compares distributions over different vocabularies,
                  and is blind to which token holds which mass (a permutation of either vocabulary leaves it
                  unchanged): the distribution's shape, not its argmax, is what it teaches.
  hybrid_uld      GOLD's hybrid: tokens both vocabularies spell the same (`matched_vocabulary`) are compared one
                  to one (a generalised JSD over them plus one outcome for the rest of the mass: TRL compares the
                  unnormalised sub-vectors), the others by `uld_distance`: this teaches which token, where it can.

Pure tensor and string-offset code: nothing of posttrain outside core/ is imported here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.core.divergences import generalized_jsd, on_support


def align_by_text(student_ends: list[int], teacher_ends: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """(student groups, teacher groups): token indices of each side per group, in order, cut where both sides end a
    token at the same character offset. `*_ends[i]`: the character offset where token i's text ends (non-decreasing;
    a token that adds no text, e.g. a special token decoded to nothing, ends where the one before it does)."""
    common = sorted((set(student_ends) & set(teacher_ends)) - {0})
    s_groups, t_groups = [], []
    i = j = 0
    for boundary in common:
        s, t = [], []
        while i < len(student_ends) and student_ends[i] <= boundary:
            s.append(i)
            i += 1
        while j < len(teacher_ends) and teacher_ends[j] <= boundary:
            t.append(j)
            j += 1
        s_groups.append(s)  # both non-empty: each side has a token ending at `boundary`
        t_groups.append(t)
    if i < len(student_ends) or j < len(teacher_ends):  # texts that differ at the end: one last group of the rest
        s_rest, t_rest = list(range(i, len(student_ends))), list(range(j, len(teacher_ends)))
        if s_rest and t_rest:
            s_groups.append(s_rest)
            t_groups.append(t_rest)
        elif s_groups:
            s_groups[-1] += s_rest
            t_groups[-1] += t_rest
    return s_groups, t_groups


def positional_groups(student_len: int, teacher_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """The original ULD's alignment: token i with token i, the longer side cut to the shorter."""
    n = min(student_len, teacher_len)
    return [[i] for i in range(n)], [[i] for i in range(n)]


def merge_groups(logp: Tensor, groups: list[list[int]]) -> Tensor:
    """(T, V) per-token log-probs -> (G, V): each group's distributions multiplied and renormalised."""
    index = torch.tensor([g for group in groups for g in group], device=logp.device)
    which = torch.tensor([k for k, group in enumerate(groups) for _ in group], device=logp.device)
    summed = torch.zeros(len(groups), logp.shape[-1], dtype=logp.dtype, device=logp.device)
    summed = summed.index_add(0, which, logp.index_select(0, index))
    return summed.log_softmax(-1)


def uld_distance(student_probs: Tensor, teacher_probs: Tensor) -> Tensor:
    """(R,) L1 distance between the two (R, V_s) and (R, V_t) probability vectors of each row, each sorted in
    descending order and the shorter padded with zeros."""
    s = student_probs.sort(-1, descending=True).values
    t = teacher_probs.sort(-1, descending=True).values
    width = max(s.shape[-1], t.shape[-1])
    s = torch.nn.functional.pad(s, (0, width - s.shape[-1]))
    t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    return (s - t).abs().sum(-1)


def matched_vocabulary(student_vocab: dict[str, int], teacher_vocab: dict[str, int], student_size: int,
                       teacher_size: int) -> tuple[list[int], list[int]]:
    """(student ids, teacher ids) of the tokens both vocabularies spell the same (below each model's output size), in
    the teacher's id order: the tokens a hybrid loss compares one to one."""
    pairs = sorted((t, student_vocab[text]) for text, t in teacher_vocab.items()
                   if text in student_vocab and t < teacher_size and student_vocab[text] < student_size)
    return [s for _, s in pairs], [t for t, _ in pairs]


def hybrid_uld(student_logp: Tensor, teacher_logp: Tensor, student_ids: list[int], teacher_ids: list[int], *,
               beta: float, matched_weight: float, unmatched_weight: float) -> Tensor:
    """(R,) GOLD's hybrid loss between (R, V_s) and (R, V_t) log-probs: on the tokens both vocabularies share
    (`student_ids[i]` is `teacher_ids[i]`), the generalised JSD(beta) between the two distributions over those
    tokens plus one outcome for the rest of the mass; on the other tokens, `uld_distance` of their probabilities."""
    s_index = torch.tensor(student_ids, dtype=torch.long, device=student_logp.device)
    t_index = torch.tensor(teacher_ids, dtype=torch.long, device=teacher_logp.device)
    matched = generalized_jsd(on_support(student_logp.index_select(-1, s_index), True),
                              on_support(teacher_logp.index_select(-1, t_index), True), beta=beta)
    s_rest = student_logp.exp().index_fill(-1, s_index, 0.0)  # zeros sort last: as if left out
    t_rest = teacher_logp.exp().index_fill(-1, t_index, 0.0)
    return matched_weight * matched + unmatched_weight * uld_distance(s_rest, t_rest)
