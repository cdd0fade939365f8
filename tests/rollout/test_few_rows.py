"""The decoding-step kernel: y = x W^T + b for a few rows, against a float64 reference; the
fallbacks; and the context that routes a model's linears through it."""

import math
import shutil

import pytest
import torch

from posttrain.accel import few_rows
from posttrain.accel.few_rows import MAX_ROWS, few_rows_linear, few_rows_linears
from posttrain.models.loading import load_causal_lm

can_build = shutil.which("cc") is not None and few_rows._cpu_has_avx2_fma()
needs_kernel = pytest.mark.skipif(not can_build, reason="no C compiler or no AVX2/FMA CPU: decoding uses F.linear")


@needs_kernel
def test_kernel_builds_where_it_can():
    assert few_rows.available()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 13, 16])
@pytest.mark.parametrize("features", [(576, 96), (37, 45), (8, 1), (1536, 70), (1300, 33), (641, 17)])
# (in, out): K a multiple of 8 or not; K > 640 is cut into column blocks (of 512, 440 + 440 + 420, 328 + 313)
def test_matches_a_float64_reference(rows, features):
    K, N = features
    g = torch.Generator().manual_seed(rows * 1000 + K)
    x, w, b = torch.randn(rows, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    reference = x.double() @ w.double().T
    torch.testing.assert_close(few_rows_linear(x, w).double(), reference, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(few_rows_linear(x, w, b).double(), reference + b.double(), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_strided_and_batched_inputs():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g)
    wide = torch.randn(6, 50, generator=g)
    x = wide[:, 3:27]  # rows 50 floats apart, last dim contiguous
    torch.testing.assert_close(few_rows_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    cols = torch.randn(24, 5, generator=g).T  # last dim strided: copied first
    torch.testing.assert_close(few_rows_linear(cols, w), cols @ w.T, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 4, 24, generator=g)  # (batch, 1-token steps, hidden) like a decoding step
    out = few_rows_linear(x3, w)
    assert out.shape == (2, 4, 40)
    torch.testing.assert_close(out, x3 @ w.T, rtol=1e-5, atol=1e-5)


def test_falls_back_to_torch_for_many_rows_grad_and_other_dtypes():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 8, generator=g)
    many = torch.randn(MAX_ROWS + 1, 8, generator=g)
    torch.testing.assert_close(few_rows_linear(many, w), many @ w.T)
    x = torch.randn(2, 8, generator=g, requires_grad=True)
    y = few_rows_linear(x, w)
    assert y.grad_fn is not None  # autograd needs torch's op
    y.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 8))
    wide = few_rows_linear(x.detach().double(), w.double())  # not float32: torch's op
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide, x.detach().double() @ w.double().T)


def test_switch_off_by_environment(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_NO_KERNELS", "1")
    few_rows.kernels.cache_clear(), few_rows.few_rows_kernel.cache_clear()
    try:
        assert not few_rows.available()
        x, w = torch.randn(2, 8), torch.randn(3, 8)
        torch.testing.assert_close(few_rows_linear(x, w), x @ w.T)
    finally:
        monkeypatch.delenv("POSTTRAIN_NO_KERNELS")
        few_rows.kernels.cache_clear(), few_rows.few_rows_kernel.cache_clear()


@needs_kernel
def test_model_linears_routed_through_the_kernel_and_restored(monkeypatch):
    kernel, calls = few_rows.few_rows_kernel(), []
    monkeypatch.setattr(few_rows, "few_rows_kernel", lambda: lambda *a: calls.append(a[6]) or kernel(*a))
    model = load_causal_lm("posttrain/tiny-llama").eval()
    ids = torch.randint(0, 1000, (4, 3))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with few_rows_linears(model) as used:
            patched = [m for m in model.modules() if "forward" in m.__dict__]
            routed = model(input_ids=ids).logits  # 12 rows per linear: the kernel
    assert used and model.get_output_embeddings() in patched
    assert len(calls) == len(patched) and set(calls) == {12}  # each linear once, through the kernel, 12 rows
    assert len(patched) == sum(type(m) is torch.nn.Linear for m in model.modules())
    assert all("forward" not in m.__dict__ for m in model.modules())
    torch.testing.assert_close(routed, plain, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_vectorised_exp_of_the_decoding_step():
    """The lean step's exp (attention softmax, SiLU) against float64 exp: within about one float ulp
    over the finite range; 0 below the smallest normal (masked scores), inf above, NaN kept."""
    import ctypes

    fn = few_rows.kernels().vector_exp
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ssize_t], None
    x = torch.cat([torch.linspace(-87.0, 88.72, 200_003), torch.tensor([0.0, 1.0, -1.0, 1e-7, -1e-7])])
    y = torch.empty_like(x)
    fn(x.data_ptr(), y.data_ptr(), x.numel())  # 200_008 values: the last 8 through the tail path too
    reference = torch.exp(x.double())
    assert ((y.double() - reference).abs() / reference).max() < 1.5e-7
    assert y[-5].item() == 1.0
    special = torch.tensor([float("-inf"), -3.4e38, -88.0, float("nan"), 89.0, float("inf"), 88.7])
    out = torch.empty_like(special)
    fn(special.data_ptr(), out.data_ptr(), special.numel())
    assert out[:3].tolist() == [0.0, 0.0, 0.0] and out[3].isnan() and out[4:6].isinf().all()
    assert abs(out[6].item() / math.exp(special[6].item()) - 1) < 1.5e-7  # e^88.7 is finite: no early overflow


BUILDS = ["avx2", "avx512"]


@needs_kernel
@pytest.mark.parametrize("isa", BUILDS)
def test_each_build_matches_a_float64_reference_and_every_thread_count(isa):
    """Both builds of the kernels (AVX2; AVX-512 where the CPU has it): every row count 1..16 (a register-blocked
    pass over several weight rows for up to 8 rows, two passes above), weight-row counts that leave a remainder to
    the one-row pass, K a multiple of 16, of 8 only, or neither, and cut into column blocks; with and without bias.
    A build gives the same bits on 1 and 2 threads (each output is summed by one thread in a fixed order)."""
    if isa == "avx512" and "avx512f" not in few_rows._cpu_flags():
        pytest.skip("no AVX-512F on this CPU")
    lib = few_rows.build(isa)
    assert lib is not None
    fn = few_rows.linear_function(lib)
    g = torch.Generator().manual_seed(7)
    for rows in range(1, MAX_ROWS + 1):
        K, N = [(576, 17), (40, 7), (37, 5), (1300, 13), (8, 2), (641, 33)][rows % 6]
        x, w, b = torch.randn(rows, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
        outs = {}
        for threads in (1, 2):
            for bias in (None, b):
                y = torch.empty(rows, N)
                fn(x.data_ptr(), K, w.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), N, rows, N,
                   K, threads)
                outs[threads, bias is None] = y
        reference = x.double() @ w.double().T
        torch.testing.assert_close(outs[1, True].double(), reference, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(outs[1, False].double(), reference + b.double(), rtol=1e-5, atol=1e-4)
        assert torch.equal(outs[1, True], outs[2, True]) and torch.equal(outs[1, False], outs[2, False])


@needs_kernel
def test_the_environment_keeps_the_avx2_build(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_KERNELS_ISA", "avx2")
    assert few_rows.variant() == "avx2"
    monkeypatch.delenv("POSTTRAIN_KERNELS_ISA")
    assert few_rows.variant() == ("avx512" if "avx512f" in few_rows._cpu_flags() else "avx2")
