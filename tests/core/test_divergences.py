"""core.divergences: hand numbers, the JSD's end points against the KLs, zero when the models agree, the chunked
driver against a direct float64 computation (values and gradients), the fused (hidden, weight) form, top-k."""

import math

import pytest
import torch

from posttrain.core.divergences import (DIVERGENCES, LinearLogits, forward_kl, generalized_jsd, restrict_to_support,
                                        reverse_kl, sequence_divergence, token_divergence)


def logp(*probs):
    return torch.tensor([probs], dtype=torch.float64).log()


S, T = logp(0.5, 0.5), logp(0.9, 0.1)  # student, teacher


def test_hand_numbers():
    # KL(T||S) = 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5); KL(S||T) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1)
    assert forward_kl(S, T).item() == pytest.approx(0.3680642071684971, abs=1e-12)
    assert reverse_kl(S, T).item() == pytest.approx(0.5108256237659907, abs=1e-12)
    # M = (0.7, 0.3): 0.5 [0.9 ln(0.9/0.7) + 0.1 ln(0.1/0.3)] + 0.5 [0.5 ln(0.5/0.7) + 0.5 ln(0.5/0.3)]
    assert generalized_jsd(S, T, beta=0.5).item() == pytest.approx(0.10174922507919676, abs=1e-12)


def test_jsd_end_points_are_trls_kls():
    # TRL: beta = 0 is the forward KL(teacher || student), beta = 1 the reverse KL(student || teacher)
    assert generalized_jsd(S, T, beta=0.0).item() == forward_kl(S, T).item()
    assert generalized_jsd(S, T, beta=1.0).item() == reverse_kl(S, T).item()
    # ... and the limits of the formula, scaled: JSD(b) / b -> KL(T||S), JSD(1 - b) / b -> KL(S||T)
    b = 1e-6
    assert (generalized_jsd(S, T, beta=b) / b).item() == pytest.approx(forward_kl(S, T).item(), rel=1e-4)
    assert (generalized_jsd(S, T, beta=1 - b) / b).item() == pytest.approx(reverse_kl(S, T).item(), rel=1e-4)


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_zero_when_models_agree_and_positive_otherwise(name):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5)
    assert token_divergence(a, a.clone(), mask, name, beta=0.3).abs().max().item() < 1e-12
    assert (token_divergence(a, torch.randn(a.shape, generator=g, dtype=torch.float64), mask, name, beta=0.3) > 0).all()


def direct(student_logits, teacher_logits, name, beta, temperature):
    """The per-token divergence from one full log-softmax of each model, written out (no core code)."""
    s = (student_logits / temperature).log_softmax(-1)
    t = (teacher_logits / temperature).log_softmax(-1)
    kl = lambda p, q: (p.exp() * (p - q)).sum(-1)  # noqa: E731
    if name == "forward_kl" or (name == "generalized_jsd" and beta == 0):
        return kl(t, s)
    if name == "reverse_kl" or beta == 1:
        return kl(s, t)
    m = (beta * t.exp() + (1 - beta) * s.exp()).log()
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


@pytest.mark.parametrize("name, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("generalized_jsd", 0.0),
                                        ("generalized_jsd", 0.3), ("generalized_jsd", 1.0)])
def test_chunked_values_and_gradients_match_direct_float64(name, beta):
    g = torch.Generator().manual_seed(1)
    student = torch.randn(2, 7, 13, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 7, 13, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 7)
    mask[0, 5:] = 0
    mask[1, 2:] = 0
    got = token_divergence(student, teacher, mask, name, beta=beta, temperature=0.7, chunk_rows=3)
    want = direct(student, teacher, name, beta, 0.7) * mask
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    w = torch.randn(2, 7, generator=g, dtype=torch.float64)
    (grad_got,) = torch.autograd.grad((got * w).sum(), student)
    (grad_want,) = torch.autograd.grad((want * w).sum(), student)
    torch.testing.assert_close(grad_got, grad_want, rtol=0, atol=1e-12)
    assert grad_got[0, 5:].abs().max() == 0  # padding gets no gradient


def test_linear_logits_match_logits_and_give_hidden_and_weight_gradients():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    th, tw = torch.randn(2, 4, 5, generator=g, dtype=torch.float64), torch.randn(9, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    fused = token_divergence(LinearLogits(h, w), LinearLogits(th, tw), mask, beta=0.4, chunk_rows=2)
    plain = token_divergence(h @ w.t(), th @ tw.t(), mask, beta=0.4)
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-12)
    grads_fused = torch.autograd.grad(fused.sum(), (h, w))
    grads_plain = torch.autograd.grad(plain.sum(), (h, w))
    for a, b in zip(grads_fused, grads_plain):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_vocabularies_of_different_sizes_are_cut_to_the_smaller():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(1, 3, 8, generator=g, dtype=torch.float64)
    b = torch.randn(1, 3, 10, generator=g, dtype=torch.float64)
    mask = torch.ones(1, 3)
    torch.testing.assert_close(token_divergence(a, b, mask, "forward_kl"),
                               token_divergence(a, b[..., :8], mask, "forward_kl"))


def test_top_k_support_with_tail_and_renormalised():
    # teacher (0.6, 0.3, 0.1), student (0.2, 0.2, 0.6); forward KL over the teacher's top-1 {0} plus a tail
    t, s = logp(0.6, 0.3, 0.1), logp(0.2, 0.2, 0.6)
    mask = torch.ones(1, 1)
    got = token_divergence(s[None], t[None], mask, "forward_kl", top_k=1, add_tail=True)
    want = 0.6 * math.log(0.6 / 0.2) + 0.4 * math.log(0.4 / 0.8)
    assert got.item() == pytest.approx(want, abs=1e-12)
    # renormalised over the teacher's top-2 {0, 1}: both models' masses there, (2/3, 1/3) and (1/2, 1/2)
    got = token_divergence(s[None], t[None], mask, "forward_kl", top_k=2, add_tail=False)
    assert got.item() == pytest.approx(2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3), abs=1e-12)
    # reverse KL, top-1 on the student's side = the sampled token (TRL's "sampled" mode): token 1, plus the tail
    got = token_divergence(s[None], t[None], mask, "reverse_kl", top_k=1, sampled_ids=torch.tensor([[1]]))
    assert got.item() == pytest.approx(0.2 * math.log(0.2 / 0.3) + 0.8 * math.log(0.8 / 0.7), abs=1e-12)
    # JSD's union: teacher's top-1 {0} and student's top-1 {2}; a shared token is counted once
    r = restrict_to_support(t, torch.tensor([[0, 0]]), torch.tensor([[True, False]]), add_tail=True)
    torch.testing.assert_close(r.exp(), torch.tensor([[0.6, 0.0, 0.4]], dtype=torch.float64))


def test_sequence_level_form_sums_each_completion():
    per_token = torch.tensor([[0.5, 0.25, 9.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert sequence_divergence(per_token, mask).tolist() == [0.75, 1.0]


def test_beta_out_of_range_is_refused():
    with pytest.raises(ValueError, match="beta=1.5 must be in"):
        generalized_jsd(S, T, beta=1.5)


@pytest.mark.parametrize("rows, recomputed", [(4, 0), (10, 2)])
def test_only_blocks_before_the_last_are_recomputed_in_backward(rows, recomputed):
    """With gradients, a block's output-layer products are made again in backward (activation checkpointing) for
    every block but the last, which the backward reaches first: a batch of one block makes each model's logits once."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(4)
    h = torch.randn(1, rows, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    th, tw = torch.randn(1, rows, 5, generator=g, dtype=torch.float64), torch.randn(9, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(1, rows)
    blocks = -(-rows // 4)
    with Products() as forward:
        values = token_divergence(LinearLogits(h, w), LinearLogits(th, tw), mask, beta=0.5, chunk_rows=4)
    assert forward.count == 2 * blocks  # the student's and the teacher's logits of each block
    with Products() as backward:
        values.sum().backward()
    # per block: the gradients of the hidden states and of the weight (2 products); per recomputed block, both
    # models' logits again
    assert backward.count == 2 * blocks + 2 * recomputed
    plain = token_divergence(h.detach() @ w.detach().t(), th @ tw.t(), mask, beta=0.5)
    torch.testing.assert_close(values.detach(), plain, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_whole_vocabulary_fused_path_equals_the_general_one_and_takes_infinite_logits(beta, monkeypatch):
    """Over the whole vocabulary the KLs and the JSD run fused (`_WholeVocabulary`: the logits' gradient made in the
    forward); values and gradients equal the general path's (the registered function on two log-softmaxes), float32
    here, and a row with -inf logits (a token the model rules out) goes the general way and gets its finite value."""
    from posttrain.core import divergences

    g = torch.Generator().manual_seed(5)
    student = (3 * torch.randn(2, 6, 50, generator=g)).requires_grad_()
    teacher = 3 * torch.randn(2, 6, 50, generator=g)
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    w = torch.randn(2, 6, generator=g)
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(divergences, "_whole_vocabulary_beta", lambda fn, options: None)
        got = token_divergence(student, teacher, mask, beta=beta, temperature=0.8, chunk_rows=5)
        results.append((got.detach(), torch.autograd.grad((got * w).sum(), student)[0]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    ruled_out = student.detach().clone()
    ruled_out[0, 1, :10] = -math.inf  # no mass there: the KL terms of those tokens are 0, not nan
    other = teacher if beta > 0 else ruled_out + 0.5  # forward KL: the teacher rules them out too (else infinite)
    got = token_divergence(ruled_out, other, mask, beta=beta)
    assert bool(got.isfinite().all())
    s, t = ruled_out[0, 1].double().log_softmax(-1), other[0, 1].double().log_softmax(-1)
    kl = lambda p, q: torch.where(p > -math.inf, p.exp() * (p - q), 0.0).sum()  # noqa: E731  (0 log 0 = 0)
    m = (beta * t.exp() + (1 - beta) * s.exp()).log()
    want = kl(t, s) if beta == 0 else kl(s, t) if beta == 1 else beta * kl(t, m) + (1 - beta) * kl(s, m)
    torch.testing.assert_close(got[0, 1].double(), want, rtol=1e-5, atol=1e-6)
