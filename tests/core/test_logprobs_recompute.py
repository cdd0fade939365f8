"""The fused head (`linear_selective_log_softmax`) above `KEEP_LOGITS_BYTES`: it keeps no logits for the
backward and recomputes them there, with the same values and gradients as when it keeps them."""

import pytest
import torch

from posttrain.forward import logprobs
from posttrain.forward.logprobs import linear_selective_log_softmax


def _run(dtype, autocast):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 24, 16, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(40, 16, generator=gen, dtype=dtype, requires_grad=True)
    index = torch.randint(0, 40, (2, 24), generator=gen)
    grad = torch.randn(2, 24, generator=gen, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logps, entropy, argmax = linear_selective_log_softmax(hidden, weight, index, with_stats=True, vocab_chunk=8)
    saved = len(logps.grad_fn.saved_tensors)
    logps.backward(grad)
    return (logps, entropy, argmax, hidden.grad, weight.grad), saved


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.float64, False), (torch.float32, True)])
def test_recomputed_logits_give_the_same_values_and_gradients(monkeypatch, dtype, autocast):
    kept, saved_kept = _run(dtype, autocast)
    monkeypatch.setattr(logprobs, "KEEP_LOGITS_BYTES", 0)
    again, saved_again = _run(dtype, autocast)
    assert saved_kept == 4 + 5 and saved_again == 4  # hidden, weight, index, lse (+ 5 logit blocks of 8 columns)
    for a, b in zip(kept, again):
        assert torch.equal(a, b)


def test_the_size_limit_is_the_logits_bytes(monkeypatch):
    # 48 positions x 40 columns x 4 bytes = 7680 bytes of float32 logits
    monkeypatch.setattr(logprobs, "KEEP_LOGITS_BYTES", 7680)
    assert _run(torch.float32, False)[1] == 9
    monkeypatch.setattr(logprobs, "KEEP_LOGITS_BYTES", 7679)
    assert _run(torch.float32, False)[1] == 4
