"""Divergences between a student's and a teacher's next-token distributions, for distillation.

  forward_kl       KL(teacher || student) = sum_v p_T(v) (log p_T(v) - log p_S(v)): mean-seeking, the
                   supervised-KD loss (Hinton et al. 2015; sequence-level KD, Kim & Rush 2016).
  reverse_kl       KL(student || teacher) = sum_v p_S(v) (log p_S(v) - log p_T(v)): mode-seeking
                   (MiniLLM, Gu et al. 2024; on-policy distillation, Agarwal et al. 2024).
  generalized_jsd  GKD's generalised Jensen-Shannon divergence (Agarwal et al. 2024, eq. 1), with
                   M = beta p_T + (1 - beta) p_S:  JSD(beta) = beta KL(p_T || M) + (1 - beta) KL(p_S || M).
                   As TRL (its `beta`), the end points are the KLs themselves: beta = 0 is forward_kl and
                   beta = 1 is reverse_kl (the formula tends to 0 there; divided by beta, resp. 1 - beta, it
                   tends to them, which the tests check).

Every divergence has one signature, `fn(student_logp, teacher_logp, *, options) -> (R,)`: two (R, K)
tensors of log-probabilities over the same K outcomes (the vocabulary, or a top-k support with a tail
bucket), one value per row. `token_divergence` is the driver the trainers call (`sparse_teacher_divergence` its
form for a teacher known only on a support, a teacher server's): from the two models'
logits, or from their final hidden states and output layers (`LinearLogits`: the logits are made a block of
rows at a time and never exist whole), it computes the log-softmax of both models a block of rows at a
time, optionally restricts them to a top-k support, and returns the per-token divergence (B, T), 0 on
padding. With gradients, each block but the last is recomputed in the backward pass (activation checkpointing),
so the temporaries are bounded by two blocks of `chunk_rows` x V whatever the batch; the last block, which the
backward meets first, keeps its own (a batch of one block is never recomputed). The sequence-level form is the
per-token divergence summed over each completion (`sequence_divergence`). `sampled_reverse_kl` is the reverse KL
estimated on the sampled tokens alone (the self-distillation trainers' "sampled_token" mode).

Top-k support (`top_k > 0`), as TRL's `loss_top_k` describes it: the teacher's k most likely tokens for
forward KL, the student's for reverse KL, the union of both for the JSD in between (a token in both lists
counted once); with `top_k == 1` and `sampled_ids` given, the student's side is the sampled token (TRL's
`reverse_kl_top_1_mode="sampled"`). With `add_tail`, one more outcome holds each model's remaining mass
1 - sum_support p; without it, both distributions are renormalised over the support.

Departure: when the two vocabularies differ in size (padded embedding tables of one tokenizer), both are
cut to the smaller one before the softmax: the tokenizer's ids are below both sizes, and the padding rows
are never sampled.

Pure tensor code: nothing of posttrain outside core/ is imported here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from posttrain.core.registry import Registry

CHUNK_ROWS = 256  # positions per block: the block's temporaries are a few CHUNK_ROWS x V float32 tensors

DivergenceFn = Callable[..., Tensor]


@dataclass(frozen=True)
class Divergence:
    """A registered divergence and the facts its callers read from it."""

    fn: DivergenceFn  # fn(student_logp (R, K), teacher_logp (R, K), **options) -> (R,)
    support: str  # whose top-k tokens form a top-k support: "teacher", "student" or "both" (beta decides)
    options: tuple[str, ...]  # fn's keyword-only parameters, each read from the config field of that name


DIVERGENCES = Registry("divergence", Divergence, positional=("student_logp", "teacher_logp"))
DIVERGENCES.option("beta", 0.5, "generalized_jsd's interpolation: 0 = KL(teacher || student), 1 = KL(student || "
                   "teacher).", bound=(0.0, 1.0))


def register_divergence(name: str, *, support: str) -> Callable[[DivergenceFn], DivergenceFn]:
    """Register `fn` as divergence `name`; `support` says whose top-k tokens a top-k support takes."""
    if support not in ("teacher", "student", "both"):
        raise ValueError(f"register_divergence({name!r}): support={support!r} must be 'teacher', 'student' or 'both'")
    return DIVERGENCES.register(name, support=support)


def _kl(p_logp: Tensor, q_logp: Tensor) -> Tensor:
    """KL(p || q) per row of (R, K) log-probs; outcomes with p = 0 add nothing (0 log 0 = 0)."""
    live = p_logp > -math.inf
    # the empty outcomes' terms are made from 0s, not -inf: their 0 * nan would poison the gradient through where
    p_logp, q_logp = torch.where(live, p_logp, 0.0), torch.where(live, q_logp, 0.0)
    return torch.where(live, p_logp.exp() * (p_logp - q_logp), 0.0).sum(-1)


@register_divergence("forward_kl", support="teacher")
def forward_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(teacher || student) per row."""
    return _kl(teacher_logp, student_logp)


@register_divergence("reverse_kl", support="student")
def reverse_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(student || teacher) per row."""
    return _kl(student_logp, teacher_logp)


@register_divergence("generalized_jsd", support="both")
def generalized_jsd(student_logp: Tensor, teacher_logp: Tensor, *, beta: float = 0.5) -> Tensor:
    """beta KL(T || M) + (1 - beta) KL(S || M), M = beta T + (1 - beta) S; forward KL at beta = 0, reverse at 1."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta={beta} must be in [0, 1] (0: forward KL, 1: reverse KL)")
    if beta == 0.0:
        return forward_kl(student_logp, teacher_logp)
    if beta == 1.0:
        return reverse_kl(student_logp, teacher_logp)
    live = (teacher_logp > -math.inf) | (student_logp > -math.inf)  # an empty outcome of both: its log is -inf
    mixture = torch.logaddexp(torch.where(live, teacher_logp, 0.0) + math.log(beta),
                              torch.where(live, student_logp, 0.0) + math.log1p(-beta))
    mixture = torch.where(live, mixture, -math.inf)  # (logaddexp(-inf, -inf)'s gradient is nan)
    return beta * _kl(teacher_logp, mixture) + (1.0 - beta) * _kl(student_logp, mixture)


@dataclass
class LinearLogits:
    """Logits given as `hidden @ weight.T` (a plain output layer), made a block of rows at a time.

    hidden: (B, T, H) final hidden states at the scored positions; weight: (V, H) the output layer."""

    hidden: Tensor
    weight: Tensor


def _flat_rows(source, index: Tensor):
    """The rows `index` of a logit source, flattened over (B, T): (N, V) logits or LinearLogits((N, H), weight)."""
    if isinstance(source, LinearLogits):
        return LinearLogits(source.hidden.reshape(-1, source.hidden.shape[-1])[index], source.weight)
    return source.reshape(-1, source.shape[-1])[index]


def _logits(source, rows: slice, dtype: torch.dtype) -> Tensor:
    if isinstance(source, LinearLogits):
        return (source.hidden[rows] @ source.weight.t()).to(dtype)
    return source[rows].to(dtype)


def _support(student_logp: Tensor, teacher_logp: Tensor, side: str, k: int, sampled: Tensor | None):
    """(indices (R, K'), valid (R, K') bool): the top-k support; a token in both lists of a union counts once."""
    teacher_top = teacher_logp.topk(k, dim=-1).indices
    if side == "teacher":
        return teacher_top, torch.ones_like(teacher_top, dtype=torch.bool)
    student_top = sampled[:, None] if (k == 1 and sampled is not None) else student_logp.topk(k, dim=-1).indices
    if side == "student":
        return student_top, torch.ones_like(student_top, dtype=torch.bool)
    again = (student_top[:, :, None] == teacher_top[:, None, :]).any(-1)  # already in the teacher's list
    return torch.cat([teacher_top, student_top], 1), torch.cat([torch.ones_like(again), ~again], 1)


def restrict_to_support(logp: Tensor, index: Tensor, valid: Tensor, add_tail: bool) -> Tensor:
    """(R, V) log-probs -> (R, K'(+1)) over the support: renormalised, or with a tail bucket of the rest."""
    return on_support(torch.where(valid, logp.gather(-1, index), -math.inf), add_tail)


def on_support(picked: Tensor, add_tail: bool) -> Tensor:
    """(R, K') log-probs of the support's tokens (-inf where a slot is empty) -> renormalised over the support, or
    (R, K' + 1) with a tail bucket holding the rest of the mass, log(1 - sum p)."""
    if not add_tail:
        return picked.log_softmax(-1)
    # log(1 - sum p) computed as log(-expm1(logsumexp)) keeps precision when the support holds most of the mass;
    # the rest is clamped before the log (a support holding all of it: log 0, whose gradient 0 * inf is nan)
    total = torch.logsumexp(picked, -1, keepdim=True).clamp(max=0.0)
    tail = torch.log((-torch.expm1(total)).clamp(min=torch.finfo(picked.dtype).tiny))
    return torch.cat([picked, tail], -1)


class _WholeVocabulary(torch.autograd.Function):
    """The generalised JSD(beta) (forward KL at beta = 0, reverse KL at 1) over the whole vocabulary, from the
    student's logits (R, V) and the teacher's log-probs (R, V): (R,) values, equal to `generalized_jsd` of the two
    log-softmaxes up to float rounding. Its gradient with respect to the logits is made in the forward and is all
    it keeps (one (R, V) tensor instead of what autograd keeps through log_softmax, where, exp and the products).

    The gradient is made as autograd makes it: G, the gradient with respect to the student's log-probs, then
    log_softmax's backward G - p_S sum(G), divided by the temperature. G is -p_T for forward KL, p_S (log p_S -
    log p_T + 1) for reverse KL and (1 - beta) p_S (log p_S - log M + 1) for the JSD (M = beta p_T + (1 - beta) p_S;
    the +1 terms cancel through the softmax, as the teacher's terms of the JSD do, up to the rounding that autograd's
    gradient has too: where both models are the same, the gradient is that rounding, not an exact 0)."""

    @staticmethod
    def forward(ctx, logits: Tensor, teacher_logp: Tensor, beta: float, temperature: float) -> Tensor:
        s_logp = (logits if temperature == 1.0 else logits / temperature).log_softmax(-1)
        s = s_logp.exp()
        if beta == 0.0:  # KL(T || S)
            t = teacher_logp.exp()
            values = (t * (teacher_logp - s_logp)).sum(-1)
            grad = t.neg_() if ctx.needs_input_grad[0] else None
        else:
            if beta == 1.0:  # KL(S || T)
                gap = s_logp.sub_(teacher_logp)  # log p_S - log M, M = p_T
                values = (s * gap).sum(-1)
            else:  # log M = logaddexp(log p_T + log beta, log p_S + log(1 - beta))
                mixture = torch.logaddexp(teacher_logp + math.log(beta), s_logp + math.log1p(-beta))
                kl_t = (teacher_logp.exp() * (teacher_logp - mixture)).sum(-1)
                gap = s_logp.sub_(mixture)
                values = beta * kl_t + (1.0 - beta) * (s * gap).sum(-1)
            grad = gap.add_(1.0).mul_(s) if ctx.needs_input_grad[0] else None
            if grad is not None and beta != 1.0:
                grad.mul_(1.0 - beta)
        if grad is not None:  # log_softmax's backward: G - p_S sum(G)
            grad.sub_(s.mul_(grad.sum(-1, keepdim=True)))
            ctx.save_for_backward(grad if temperature == 1.0 else grad.div_(temperature))
        return values

    @staticmethod
    def backward(ctx, grad_values: Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_values[:, None], None, None, None


def _block(fn, options, support, top_k, add_tail, temperature, dtype, student, teacher, sampled):
    """The divergence of one block of rows: log-softmax of both models at `temperature`, the support, fn."""
    rows = slice(0, None)
    s_logits, t_logits = _logits(student, rows, dtype), _logits(teacher, rows, dtype).detach()
    V = min(s_logits.shape[-1], t_logits.shape[-1])
    t_logits = t_logits[:, :V]
    t_logp = (t_logits if temperature == 1.0 and t_logits.is_contiguous() else t_logits / temperature).log_softmax(-1)
    beta = _whole_vocabulary_beta(fn, options) if not top_k else None
    if beta is not None:  # the builtin KLs and JSD over the whole vocabulary: fused, one (R, V) tensor kept
        values = _WholeVocabulary.apply(s_logits[:, :V], t_logp, beta, temperature)
        if bool(values.isfinite().all()):  # an infinite log-prob (a -inf logit) goes the general way below
            return values
    s_logp = (s_logits[:, :V] / temperature).log_softmax(-1)
    if top_k:
        index, valid = _support(s_logp.detach(), t_logp, support, min(top_k, V), sampled)
        s_logp = restrict_to_support(s_logp, index, valid, add_tail)
        t_logp = restrict_to_support(t_logp, index, valid, add_tail)
    return fn(s_logp, t_logp, **options)


def _whole_vocabulary_beta(fn, options) -> float | None:
    """The JSD's beta that `fn` is (0 forward KL, 1 reverse KL), or None for another divergence."""
    for name, beta in (("forward_kl", 0.0), ("reverse_kl", 1.0), ("generalized_jsd", options.get("beta"))):
        if fn is DIVERGENCES[name].fn:
            return beta
    return None


def _part(rows, part: slice):
    if rows is None:
        return None
    return LinearLogits(rows.hidden[part], rows.weight) if isinstance(rows, LinearLogits) else rows[part]


def _chunked(block, student, mask: Tensor, others: tuple, chunk_rows: int) -> Tensor:
    """(B, T), 0 off the mask: `block(student_rows, *other_rows)` -> (R,) over the masked-in positions of `student`
    (logits (B, T, V) or LinearLogits) and of each (B, T, ...) tensor in `others` (None passes as None), `chunk_rows`
    positions at a time. With gradients, each block but the last is recomputed in backward instead of keeping its
    (rows, V) temporaries (activation checkpointing); the last one's backward comes first, so it keeps them."""
    where = mask.reshape(-1).bool().nonzero().squeeze(-1)
    s_rows = _flat_rows(student, where)
    o_rows = [None if o is None else _flat_rows(o, where) if isinstance(o, LinearLogits)
              else o.reshape(-1, *o.shape[2:])[where] for o in others]
    probe = student.hidden if isinstance(student, LinearLogits) else student
    dtype = torch.float64 if probe.dtype == torch.float64 else torch.float32
    grad = torch.is_grad_enabled() and (probe.requires_grad or (isinstance(student, LinearLogits)
                                                                and student.weight.requires_grad))
    values = []
    starts = range(0, where.numel(), chunk_rows)
    for start in starts:
        part = slice(start, start + chunk_rows)
        args = (_part(s_rows, part), *(_part(o, part) for o in o_rows))
        # the last block is the backward's first: recomputing it would only re-make what it keeps until then, so
        # it keeps its temporaries (at most two blocks' are held at once); one block of rows is never recomputed
        recompute = grad and start != starts[-1]
        values.append(checkpoint(block, *args, use_reentrant=False) if recompute else block(*args))
    out = torch.zeros(mask.numel(), dtype=dtype, device=mask.device)
    if values:
        out = out.index_put((where,), torch.cat(values).to(dtype))
    return out.view(mask.shape)


def _entry(name: str, beta: float):
    """(the registered divergence, its options, whose top-k forms the support: beta decides for the JSD)."""
    entry = DIVERGENCES[name]
    options = {"beta": beta} if "beta" in entry.options else {}
    support = entry.support if entry.support != "both" else (
        "teacher" if beta == 0.0 else "student" if beta == 1.0 else "both")
    return entry, options, support


def _dtype(source) -> torch.dtype:
    probe = source.hidden if isinstance(source, LinearLogits) else source
    return torch.float64 if probe.dtype == torch.float64 else torch.float32


def token_divergence(student, teacher, mask: Tensor, name: str = "generalized_jsd", *, beta: float = 0.5,
                     temperature: float = 1.0, top_k: int = 0, add_tail: bool = True, sampled_ids: Tensor | None = None,
                     chunk_rows: int = CHUNK_ROWS) -> Tensor:
    """Per-token divergence `DIVERGENCES[name]` between two models' next-token distributions, (B, T), 0 on padding.

    student, teacher: (B, T, V) logits, or `LinearLogits` (hidden (B, T, H), weight (V, H)); the teacher gets
    no gradient. mask: (B, T), 1 where a token is scored. beta: generalized_jsd's option (the others take
    none). top_k: 0 for the whole vocabulary, else the top-k support (module docstring), `sampled_ids`
    (B, T) the sampled tokens for a top-1 student side. The float64 inputs are computed in float64, others
    in float32. Only masked-in positions are computed, `chunk_rows` at a time."""
    entry, options, support = _entry(name, beta)
    block = functools.partial(_block, entry.fn, options, support, top_k, add_tail, temperature, _dtype(student))
    return _chunked(block, student, mask, (teacher, sampled_ids), chunk_rows)


def _sparse_block(fn, options, add_tail, temperature, dtype, student, index, valid, teacher_picked):
    s_logp = (_logits(student, slice(0, None), dtype) / temperature).log_softmax(-1)
    s_logp = restrict_to_support(s_logp, torch.where(valid, index, 0), valid, add_tail)  # empty slots: any id
    t_logp = on_support(torch.where(valid, teacher_picked.to(dtype), -math.inf), add_tail)
    return fn(s_logp, t_logp, **options)


def sparse_teacher_divergence(student, mask: Tensor, index: Tensor, valid: Tensor, teacher_logp: Tensor,
                              name: str = "generalized_jsd", *, beta: float = 0.5, temperature: float = 1.0,
                              add_tail: bool = True, chunk_rows: int = CHUNK_ROWS) -> Tensor:
    """Per-token divergence (B, T) on a support given with the teacher's log-probs on it, for a teacher known only
    there (a teacher server's top-k and sampled-token log-probs): index (B, T, K) token ids of the support, valid
    (B, T, K) which slots count (a token listed twice counts once), teacher_logp (B, T, K) the teacher's log-probs
    of those tokens at `temperature`. The student's log-softmax over its vocabulary at `temperature`, restricted to
    the support as `token_divergence` restricts a top-k support (tail bucket or renormalised)."""
    entry, options, _ = _entry(name, beta)
    block = functools.partial(_sparse_block, entry.fn, options, add_tail, temperature, _dtype(student))
    return _chunked(block, student, mask, (index, valid, teacher_logp), chunk_rows)


def sequence_divergence(per_token: Tensor, mask: Tensor) -> Tensor:
    """The sequence-level divergence (B,): each completion's per-token divergences summed (the KL between the two
    models' distributions over whole sequences, by the chain rule, where the tokens are the student's samples)."""
    return (per_token * mask).sum(-1)



def sampled_reverse_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """The reverse KL on the sampled tokens only (TRL's `distillation_mode="sampled_token"`): per token, the value is
    the single-sample estimate log p_S(y_t) - log p_T(y_t) of KL(student || teacher) at that position, and the
    gradient is the score-function one, (log p_S(y_t) - log p_T(y_t)) grad log p_S(y_t), as TRL's loss
    `(log p_S - log p_T).detach() * log p_S` has (the two differ in value only). (B, T) in, (B, T) out; the
    teacher's side has no gradient."""
    gap = (student_logp - teacher_logp).detach()
    return gap + gap * (student_logp - student_logp.detach())
