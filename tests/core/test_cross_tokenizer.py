"""core.cross_tokenizer: the text alignment of two tokenisations, the merge of split tokens, ULD and the hybrid,
against hand numbers, their limits and autograd in float64; IW-OPD's advantage by hand; the sparse (teacher-server)
divergence against the dense driver."""

import math

import pytest
import torch

from posttrain.core.advantages import AdvantageInput, compute_advantages, iw_opd_weights
from posttrain.core.cross_tokenizer import (align_by_text, hybrid_uld, matched_vocabulary, merge_groups,
                                            positional_groups, uld_distance)
from posttrain.core.divergences import generalized_jsd, sparse_teacher_divergence, token_divergence


def probs(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_uld_hand_numbers_and_limits():
    # sorted: (0.5, 0.3, 0.2, 0) against (0.6, 0.2, 0.1, 0.1): |0.1| + |0.1| + |0.1| + |0.1|
    s, t = probs([0.2, 0.5, 0.3]), probs([0.1, 0.1, 0.6, 0.2])
    assert uld_distance(s, t).item() == pytest.approx(0.4, abs=1e-12)
    assert uld_distance(s, s[:, [2, 0, 1]]).item() == 0.0  # blind to which token holds the mass
    assert uld_distance(t, t).item() == 0.0
    one_hot, uniform = probs([1.0, 0.0]), probs([0.5, 0.5])
    assert uld_distance(one_hot, uniform).item() == pytest.approx(1.0)  # 0.5 + 0.5


def test_uld_gradient_matches_autograd_in_float64():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(3, 7, generator=g, dtype=torch.float64).softmax(-1)
    assert torch.autograd.gradcheck(lambda x: uld_distance(x.softmax(-1), t), (s,))


def test_alignment_by_text_hand_cases():
    # student "ab|c|de" (ends 2, 3, 5), teacher "a|bc|d|e" (ends 1, 3, 4, 5): common boundaries at 3 and 5
    assert align_by_text([2, 3, 5], [1, 3, 4, 5]) == ([[0, 1], [2]], [[0, 1], [2, 3]])
    # the same tokenisation: one token each per group
    assert align_by_text([1, 2, 4], [1, 2, 4]) == ([[0], [1], [2]], [[0], [1], [2]])
    # a token that adds no text (ends where the one before it does) stays with it
    assert align_by_text([1, 1, 2], [2]) == ([[0, 1, 2]], [[0]])
    # texts that part at the end: the rest is one last group
    assert align_by_text([1, 2], [1, 3]) == ([[0], [1]], [[0], [1]])
    assert align_by_text([1, 2, 3], [1]) == ([[0, 1, 2]], [[0]])
    assert positional_groups(3, 2) == ([[0], [1]], [[0], [1]])


def test_merge_groups_multiplies_and_renormalises():
    logp = probs([0.5, 0.5], [0.8, 0.2], [0.3, 0.7]).log()
    merged = merge_groups(logp, [[0, 1], [2]]).exp()
    # (0.5 * 0.8, 0.5 * 0.2) / 0.5 = (0.8, 0.2); a group of one is its token's distribution
    assert torch.allclose(merged, probs([0.8, 0.2], [0.3, 0.7]), atol=1e-12)


def test_hybrid_limits():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(4, 6, generator=g, dtype=torch.float64).log_softmax(-1)
    t = torch.randn(4, 6, generator=g, dtype=torch.float64).log_softmax(-1)
    every = list(range(6))
    # every token matched: the JSD over the whole vocabulary (the rest-of-the-mass outcome holds nothing)
    full = hybrid_uld(s, t, every, every, beta=0.5, matched_weight=1.0, unmatched_weight=0.0)
    assert torch.allclose(full, generalized_jsd(s, t, beta=0.5), atol=1e-9)
    # none matched: ULD
    none = hybrid_uld(s, t, [], [], beta=0.5, matched_weight=0.0, unmatched_weight=1.0)
    assert torch.allclose(none, uld_distance(s.exp(), t.exp()), atol=1e-12)
    assert (hybrid_uld(s, s, [0, 2], [0, 2], beta=0.5, matched_weight=0.6, unmatched_weight=0.4).abs() < 1e-9).all()


def test_matched_vocabulary():
    student, teacher = {"a": 0, "b": 1, "ab": 2, "<pad>": 3}, {"<pad>": 0, "a": 1, "c": 2, "b": 3, "zz": 9}
    # in the teacher's id order; ids at or past a model's output size are left out
    assert matched_vocabulary(student, teacher, 4, 4) == ([3, 0, 1], [0, 1, 3])
    assert matched_vocabulary(student, teacher, 3, 4) == ([0, 1], [1, 3])


def test_iw_opd_advantage_hand_numbers():
    # a = (0.5, -1, 0.5, pad): |a| sums to 2; before = (0, 0.5, 1.5); w = 1 + 0.5 (1 - before / 2)
    signal = torch.tensor([[0.5, -1.0, 0.5, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, returns = compute_advantages("iw_opd", AdvantageInput(scores=torch.zeros(1), mask=mask, token_rewards=signal),
                                      iw_opd_gamma=0.5, iw_opd_epsilon=1e-8)
    assert returns is None
    assert torch.allclose(adv, torch.tensor([[1.5 * 0.5, 1.375 * -1.0, 1.125 * 0.5, 0.0]], dtype=torch.float64))
    # gamma = 0: the plain sampled-token signal; a completion that agrees everywhere: weights 1 + gamma, no signal
    adv0, _ = compute_advantages("iw_opd", AdvantageInput(scores=torch.zeros(1), mask=mask, token_rewards=signal),
                                 iw_opd_gamma=0.0, iw_opd_epsilon=1e-8)
    assert torch.equal(adv0, signal * mask)
    assert torch.allclose(iw_opd_weights(torch.zeros(1, 3), torch.ones(1, 3), 0.5, 1e-8), torch.full((1, 3), 1.5))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_sparse_teacher_divergence_is_the_dense_top1_divergence(beta):
    # a teacher known on TRL's top-1 support (its top-1 and/or the sampled token) gives the dense driver's value
    g = torch.Generator().manual_seed(2)
    B, T, V = 2, 5, 11
    student = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    sampled = torch.randint(V, (B, T), generator=g)
    sampled[0, 0] = teacher[0, 0].argmax()  # a sampled token that is the teacher's top-1: counted once
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    dense = token_divergence(student, teacher, mask, beta=beta, temperature=0.8, top_k=1, sampled_ids=sampled)
    t_logp = (teacher / 0.8).log_softmax(-1)
    top = t_logp.argmax(-1, keepdim=True)
    if beta == 0.0:
        index = top
    elif beta == 1.0:
        index = sampled[..., None]
    else:
        index = torch.cat([top, sampled[..., None]], -1)
    valid = torch.ones_like(index, dtype=torch.bool)
    if index.shape[-1] == 2:
        valid[..., 1] = index[..., 1] != index[..., 0]
    sparse = sparse_teacher_divergence(student, mask, index, valid, t_logp.gather(-1, index), beta=beta,
                                       temperature=0.8, chunk_rows=3)
    assert torch.allclose(sparse, dense, atol=1e-12)
    (g1,) = torch.autograd.grad(sparse.sum(), student)
    (g2,) = torch.autograd.grad(dense.sum(), student)
    assert torch.allclose(g1, g2, atol=1e-12) and math.isfinite(float(g1.abs().sum()))


def test_renormalised_top_k_support_with_a_repeated_token_has_finite_gradients():
    # the JSD's union support lists a token twice (an empty slot, -inf); renormalised (no tail bucket), the empty
    # slot's 0 * log 0 terms must leave the gradient finite
    g = torch.Generator().manual_seed(3)
    student = torch.randn(2, 4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = student.detach().clone()
    teacher[..., 0] += 5.0  # the teacher's and the student's top-1 agree: the union holds a repeated token
    loss = token_divergence(student, teacher, torch.ones(2, 4), beta=0.5, top_k=3, add_tail=False)
    (grad,) = torch.autograd.grad(loss.sum(), student)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_a_support_holding_all_the_mass_has_finite_gradients():
    # the tail bucket of a support that holds every token is empty: log 0 must not reach the gradient
    g = torch.Generator().manual_seed(4)
    s = torch.randn(3, 5, generator=g, dtype=torch.float32, requires_grad=True)
    t = torch.randn(3, 5, generator=g, dtype=torch.float32)
    every = list(range(5))
    loss = hybrid_uld(s.log_softmax(-1), t.log_softmax(-1), every, every, beta=0.5, matched_weight=0.7,
                      unmatched_weight=0.3)
    (grad,) = torch.autograd.grad(loss.sum(), s)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all() and grad.abs().sum() > 0
