"""Log-prob core against an independent float64 reference."""

import copy
import math

import pytest
import torch

from posttrain.core.log_softmax import entropy_from_logits, selective_log_softmax, sequence_logprobs
from posttrain.forward.logprobs import token_logprobs


def reference_logprob(row, index):
    # float64, plain Python: log softmax(row)[index]
    m = max(row)
    lse = m + math.log(sum(math.exp(v - m) for v in row))
    return row[index] - lse


def test_selective_log_softmax_matches_float64_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 4
    index = torch.randint(0, 11, (3, 5))
    got = selective_log_softmax(logits, index, chunk_rows=4)  # chunks that do not divide 15 rows
    for b in range(3):
        for t in range(5):
            want = reference_logprob(logits[b, t].double().tolist(), index[b, t].item())
            assert got[b, t].item() == pytest.approx(want, abs=1e-5)


def test_selective_log_softmax_hand_numbers():
    # logits [0, ln 3] -> probs [1/4, 3/4]
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert selective_log_softmax(logits, torch.tensor([1])).item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert selective_log_softmax(logits, torch.tensor([0])).item() == pytest.approx(math.log(0.25), abs=1e-6)


def test_entropy_hand_numbers_and_reference():
    # uniform over 4 -> ln 4; probs [1/4, 3/4] -> -(1/4 ln 1/4 + 3/4 ln 3/4)
    assert entropy_from_logits(torch.zeros(1, 4)).item() == pytest.approx(math.log(4), abs=1e-6)
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert entropy_from_logits(torch.tensor([[0.0, math.log(3.0)]])).item() == pytest.approx(h, abs=1e-6)
    torch.manual_seed(1)
    logits = torch.randn(7, 9, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    assert torch.allclose(entropy_from_logits(logits, chunk_rows=3), -(p * p.log()).sum(-1), atol=1e-10)


def test_gradient_matches_full_log_softmax():
    torch.manual_seed(2)
    a = torch.randn(2, 3, 7, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    index = torch.randint(0, 7, (2, 3))
    selective_log_softmax(a, index, chunk_rows=2).sum().backward()
    torch.log_softmax(b, -1).gather(-1, index[..., None]).sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


class LookupLM(torch.nn.Module):
    """A 'model' whose logits at position t depend only on token t: makes padding invariance checkable."""

    def __init__(self, vocab=13):
        super().__init__()
        torch.manual_seed(3)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab))

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0, use_cache=False, **kw):
        logits = self.table[input_ids]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return type("Out", (), {"logits": logits})()


def test_token_logprobs_scores_last_tokens_and_ignores_padding():
    model = LookupLM()
    ids = torch.tensor([[1, 2, 3, 4]])
    logps, ent, _ = token_logprobs(model, ids, torch.ones_like(ids), num_scored=2, with_entropy=True)
    # token 3 scored by logits at token 2; token 4 by logits at token 3
    want = [reference_logprob(model.table[2].double().tolist(), 3), reference_logprob(model.table[3].double().tolist(), 4)]
    assert logps[0].tolist() == pytest.approx(want, abs=1e-5)
    assert ent.shape == (1, 2)
    # the same row left-padded: the scored tokens' log-probs do not change
    padded = torch.tensor([[0, 0, 1, 2, 3, 4]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    logps_padded, _, _ = token_logprobs(model, padded, mask, num_scored=2)
    assert torch.allclose(logps_padded, logps)
    assert sequence_logprobs(logps, torch.tensor([[1, 0]])).item() == pytest.approx(want[0], abs=1e-5)


def test_token_logprobs_real_model_padding_invariance(tiny_lm):
    model, tok = tiny_lm
    a = tok("Beautiful is better than ugly.")["input_ids"]
    b = tok("Flat is better")["input_ids"]
    width = max(len(a), len(b))
    ids = torch.tensor([a + [tok.pad_token_id] * (width - len(a)), b + [tok.pad_token_id] * (width - len(b))])
    mask = (torch.arange(width)[None] < torch.tensor([[len(a)], [len(b)]])).long()
    with torch.no_grad():
        logps, _, _ = token_logprobs(model, ids, mask)
        alone, _, _ = token_logprobs(model, torch.tensor([b]), torch.ones(1, len(b), dtype=torch.long))
    assert torch.allclose(logps[1, : len(b) - 1], alone[0], atol=1e-5)
    # and against a float64 reference of the full logits
    with torch.no_grad():
        full = model(input_ids=torch.tensor([b])).logits[0].double()
    ref = torch.log_softmax(full[:-1], -1).gather(-1, torch.tensor(b[1:])[:, None]).squeeze(-1)
    assert torch.allclose(alone[0].double(), ref, atol=1e-5)


def test_token_logprobs_exact_positions_matches_the_default(tiny_lm):
    model, tok = tiny_lm
    ids = torch.tensor([tok("Beautiful is better than ugly.")["input_ids"]] * 2)
    mask = torch.ones_like(ids)
    default, _, logits = token_logprobs(model, ids, mask, num_scored=4)
    exact, _, exact_logits = token_logprobs(model, ids, mask, num_scored=4, exact_positions=True)
    assert exact_logits.is_contiguous() and exact_logits.shape == logits.shape
    torch.testing.assert_close(exact, default, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(exact_logits, logits, rtol=1e-5, atol=1e-5)


def test_token_logprobs_with_the_fused_head_matches_the_model_logits(tiny_lm):
    """head=: log-probs, entropies and gradients of the left-padded rows equal those of the model's own logits
    (float64 copy of the model: the same numbers up to float64 rounding), and no logits are made."""
    from posttrain.forward.logprobs import plain_lm_head

    model, tok = tiny_lm
    model = copy.deepcopy(model).double()
    a, b = tok("Beautiful is better than ugly.")["input_ids"], tok("Flat is")["input_ids"]
    width = max(len(a), len(b))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in (a, b)])  # left-padded
    mask = (torch.arange(width)[None] >= torch.tensor([[width - len(a)], [width - len(b)]])).long()
    head = plain_lm_head(model, ids)
    assert head is model.get_output_embeddings()
    results = []
    for fused in (None, head):
        logps, entropy, logits = token_logprobs(model, ids, mask, num_scored=3, temperature=0.7, with_entropy=True,
                                                head=fused)
        assert (logits is None) == (fused is not None)
        (logps * torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)).sum().backward()
        results.append((logps.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad(set_to_none=True)
    (l0, e0, g0), (l1, e1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(e1, e0, rtol=1e-10, atol=1e-10)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-9, atol=1e-10, msg=lambda m, n=n: f"{n}: {m}")
    with pytest.raises(ValueError, match="returns no model outputs"):
        token_logprobs(model, ids, mask, head=head, return_outputs=True)


def test_a_zero3_partitioned_head_is_never_plain(tiny_lm):
    """A DeepSpeed ZeRO-3 weight (marked by `ds_id`) is whole only inside its module's forward: even when a
    generation left it gathered, the fused head must not take it (its gradient would be the (0,) partition)."""
    from posttrain.forward.logprobs import plain_lm_head

    model, tok = tiny_lm
    model = copy.deepcopy(model)
    ids = torch.tensor([tok("Simple is better than complex.")["input_ids"]])
    assert plain_lm_head(model, ids) is model.get_output_embeddings()
    model = copy.deepcopy(model)
    model.get_output_embeddings().weight.ds_id = 7
    assert plain_lm_head(model, ids) is None


def test_custom_gradient_and_stats_match_float64_reference():
    from posttrain.core.log_softmax import selective_log_softmax_stats

    torch.manual_seed(4)
    x = torch.randn(5, 3, 11, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 11, (5, 3))
    assert torch.autograd.gradcheck(lambda t: selective_log_softmax(t, index, chunk_rows=4), (x,))
    assert torch.autograd.gradcheck(lambda t: selective_log_softmax_stats(t, index, chunk_rows=4)[0], (x,))
    logps, entropy, argmax = selective_log_softmax_stats(x, index, chunk_rows=4)
    logp_all = torch.log_softmax(x.detach(), -1)
    assert torch.allclose(logps, logp_all.gather(-1, index[..., None]).squeeze(-1), atol=1e-12)
    assert torch.allclose(entropy, -(logp_all.exp() * logp_all).sum(-1), atol=1e-12)
    assert torch.equal(argmax, x.argmax(-1)) and not entropy.requires_grad
    # bf16 logits: float32 results, gradient in bf16
    xb = x.detach()[0].to(torch.bfloat16).requires_grad_(True)
    selective_log_softmax_stats(xb, index[0])[0].sum().backward()
    ref = xb.detach().float().requires_grad_(True)
    torch.log_softmax(ref, -1).gather(-1, index[0][:, None]).sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and torch.allclose(xb.grad.float(), ref.grad, atol=1e-2)


def test_fused_head_matches_plain_cross_entropy_and_its_gradients():
    """linear_selective_log_softmax == -cross_entropy(hidden @ W.T): values, stats, gradients to the
    hidden states and to a weight tied to an embedding (both gradients land in the one weight)."""
    from posttrain.forward.logprobs import linear_selective_log_softmax

    torch.manual_seed(5)
    N, H, V = 13, 6, 37  # a vocabulary block of 8 does not divide V
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        hidden0 = torch.randn(N, H, dtype=torch.float64) * 2
        weight0 = torch.randn(V, H, dtype=torch.float64)
        ids = torch.randint(0, V, (N,))
        index = torch.randint(0, V, (N,))
        upstream = torch.randn(N, dtype=torch.float64)  # any per-token gradient, not only a mean
        results = []
        for fused in (False, True):
            hidden = hidden0.to(dtype).requires_grad_(True)
            weight = weight0.to(dtype).requires_grad_(True)
            h = hidden + torch.nn.functional.embedding(ids, weight)  # tied: the weight is the embedding too
            if fused:
                logps, entropy, argmax = linear_selective_log_softmax(h, weight, index, with_stats=True, vocab_chunk=8)
            else:
                logits = h @ weight.t()
                logps = -torch.nn.functional.cross_entropy(logits, index, reduction="none")
                entropy, argmax = entropy_from_logits(logits.detach()), logits.argmax(-1)
            (logps * upstream.to(dtype)).sum().backward()
            results.append((logps, entropy, argmax, hidden.grad, weight.grad))
        for name, plain, fused in zip(("logps", "entropy", "argmax", "d hidden", "d weight"), *results):
            assert torch.allclose(fused.double(), plain.double(), atol=tol, rtol=tol), (dtype, name)
        assert results[1][0].dtype == dtype and not results[1][1].requires_grad
    hidden = hidden0.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h, w: linear_selective_log_softmax(h, w, index, vocab_chunk=8)[0],
                                    (hidden, weight0.clone().requires_grad_(True)))
    with torch.no_grad():  # the no-grad path gives the same numbers
        assert torch.allclose(linear_selective_log_softmax(hidden0, weight0, index, vocab_chunk=8)[0],
                              torch.log_softmax(hidden0 @ weight0.t(), -1).gather(-1, index[:, None]).squeeze(-1))


def test_fused_head_under_bf16_autocast_matches_the_autocast_head():
    from posttrain.forward.logprobs import linear_selective_log_softmax

    torch.manual_seed(6)
    hidden0, weight0, index = torch.randn(9, 16), torch.randn(70, 16) * 0.3, torch.randint(0, 70, (9,))
    grads = []
    for fused in (False, True):
        hidden, weight = hidden0.clone().requires_grad_(True), weight0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                logps = linear_selective_log_softmax(hidden, weight, index, vocab_chunk=32)[0]
            else:
                logps = selective_log_softmax(torch.nn.functional.linear(hidden, weight), index)
        logps.sum().backward()
        grads.append((logps, hidden.grad, weight.grad))
    for plain, fused in zip(*grads):
        assert fused.dtype == plain.dtype and torch.allclose(fused, plain, atol=2e-2, rtol=2e-2)


def test_one_row_inputs_put_the_groups_side_by_side_under_their_own_block_masks():
    """Two preference pairs of 2 + 1 + 2 and 3 + 2 + 1 tokens: one row of 11 tokens, the pairs' bounds
    (0, 5, 11), each diagonal block the pair's own mask over its real tokens, nothing across pairs."""
    from posttrain.forward.logprobs import pack_pairs

    rows = [([5, 6], [7], [8, 9]), ([10, 11, 12], [13, 14], [15])]
    T = 6
    ids, mask, cmask = (torch.zeros(4, T, dtype=torch.long) for _ in range(3))
    for i, (prompt, chosen, rejected) in enumerate(rows):
        for r, completion in ((i, chosen), (2 + i, rejected)):
            seq = prompt + completion
            ids[r, :len(seq)], mask[r, :len(seq)] = torch.tensor(seq), 1
            cmask[r, len(prompt):len(seq)] = 1
    packed = pack_pairs(ids, mask, cmask)
    inputs, where = packed.one_row_inputs()
    assert inputs["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 2, 3, 0, 1, 2, 3, 4, 3]]
    assert inputs["cu_seq_lens_q"].tolist() == [0, 5, 11] and inputs["max_length_q"] == 6
    valid = packed.valid.bool()
    blocks = packed.attention_mask()
    flat = inputs["attention_mask"][0, 0]
    for g, (start, end) in enumerate(((0, 5), (5, 11))):
        keep = valid[g].nonzero().flatten()
        assert torch.equal(flat[start:end, start:end], blocks[g, 0][keep][:, keep])
        assert torch.equal(where[g, keep], torch.arange(start, end))
    assert not flat[:5, 5:].any() and not flat[5:, :5].any()
    assert flat[3].tolist()[:5] == [True, True, False, True, False]  # the rejected token sees the prompt, not chosen
