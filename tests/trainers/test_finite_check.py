"""guards.first_non_finite, which FiniteGuard runs on every step's gradients and weights: its cheap 2-norm pass
must never call a finite tensor non-finite (a 2-norm overflows on large finite values) nor miss a NaN or an
infinity; the answer is checked against torch.isfinite element by element."""

import pytest
import torch

from posttrain.trainers.guards import first_non_finite


def _expected(named):
    return next((n for n, t in named if not bool(torch.isfinite(t).all())), None)


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_names_the_first_non_finite_tensor_even_beside_overflowing_finite_values(bad):
    huge = torch.full((4, 4), 3e38)  # finite, but its 2-norm is infinite in float32
    named = [("a", torch.randn(3)), ("huge", huge), ("b", torch.randn(2, 5)), ("c", torch.randn(7))]
    if bad is not None:
        named[2][1][1, 3] = bad
        named[3][1][0] = bad
    assert first_non_finite(named) == _expected(named) == (None if bad is None else "b")


def test_random_tensors_agree_with_isfinite():
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        named = [(f"t{i}", torch.randn(int(torch.randint(1, 40, (1,), generator=gen)), generator=gen)
                  * 10 ** float(torch.randint(0, 39, (1,), generator=gen))) for i in range(4)]
        if trial % 3 == 0:
            name, t = named[int(torch.randint(0, 4, (1,), generator=gen))]
            t[int(torch.randint(0, len(t), (1,), generator=gen))] = float("nan") if trial % 2 else float("inf")
        assert first_non_finite(named) == _expected(named), trial
    assert first_non_finite([("empty", torch.zeros(0)), ("none", None)]) is None
