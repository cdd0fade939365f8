"""The kernels' top-p filter (`few_rows.top_p_filter`, `decode_kernels.c: top_p_filter_rows`): the cut of a whole
sort, found from the largest logits alone, and `filter_logits` equal to the sort's cut whether the kernel decides
a row or leaves it to the sort."""

import pytest
import torch

from posttrain.accel import few_rows
from posttrain.rollout import generate as generate_module
from posttrain.rollout.generate import filter_logits
from tests.rollout.test_generate import torch_sort_top_p

needs_kernel = pytest.mark.skipif(few_rows.top_p_filter(torch.zeros(1, 4), 0.9) is None,
                                  reason="no compiled kernels here: filter_logits sorts with torch.sort itself")


def peaked(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits shaped like a language model's: a few likely tokens over a long, spread tail."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen) * 2
    x[:, :40] += torch.rand(rows, 40, generator=gen) * 14
    return x


@needs_kernel
def test_kernel_cut_equals_the_sorted_cut():
    decided = 0
    for seed in range(6):
        x = peaked(16, 49152 if seed < 3 else 1000, seed)
        for top_p in (0.3, 0.8, 0.95, 0.999):
            out, undecided = few_rows.top_p_filter(x, top_p)
            ref = torch_sort_top_p(x, top_p)
            assert torch.equal(out[~undecided], ref[~undecided])
            assert torch.equal(out[undecided], x[undecided])  # left as they were, for the sort
            assert torch.equal(filter_logits(x, top_p=top_p), ref)
            decided += int((~undecided).sum())
    assert decided >= 0.8 * 6 * 4 * 16  # the kernel, not the sort, cuts most rows


@needs_kernel
def test_kernel_leaves_what_it_cannot_call_to_the_sort():
    x = peaked(4, 5000, 0)
    x[0, 7] = float("nan")
    x[1, 3] = float("inf")
    x[2] = (x[2] * 2).round() / 2  # equal logits on both sides of the cut
    out, undecided = few_rows.top_p_filter(x, 0.9)
    assert undecided[:2].tolist() == [True, True] and not undecided[3]
    ref = torch_sort_top_p(x[2:], 0.9)
    assert torch.equal(filter_logits(x[2:], top_p=0.9), ref)
    # a mass within `band` of top_p: undecided with a wide band, decided (the same cut) without one
    y = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = torch.sort(y, descending=True).values.softmax(-1)
    at = float((probs.cumsum(-1) - probs)[0, 2])  # the mass before the third token
    assert few_rows.top_p_filter(y, at + 1e-7, band=1e-3)[1].item()
    assert torch.equal(few_rows.top_p_filter(y, at, band=0.0)[0], torch_sort_top_p(y, at))
    # top-k first, infinities (-inf from filters), one token, top_p near 1: all cut as the sort cuts them
    z = peaked(8, 3000, 1)
    z[:, ::5] = float("-inf")
    for top_p in (0.5, 0.95, 0.99999):
        assert torch.equal(filter_logits(z, top_k=100, top_p=top_p), torch_sort_top_p(filter_logits(z, top_k=100),
                                                                                       top_p))
        assert torch.equal(filter_logits(z, top_p=top_p), torch_sort_top_p(z, top_p))
    assert torch.equal(filter_logits(torch.tensor([[1.5]]), top_p=0.5), torch.tensor([[1.5]]))


def test_filter_without_the_kernel_is_the_sort(monkeypatch):
    monkeypatch.setattr(generate_module, "top_p_filter", lambda logits, top_p: None)  # POSTTRAIN_NO_KERNELS's path
    x = peaked(8, 4096, 3)
    for top_p in (0.5, 0.95):
        assert torch.equal(filter_logits(x, top_p=top_p), torch_sort_top_p(x, top_p))
    assert few_rows.top_p_filter(x.double(), 0.9) is None  # not float32: the sort
