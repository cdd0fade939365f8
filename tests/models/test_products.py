"""posttrain.accel.products: float32 CPU products through oneDNN, checked against float64 and against torch.

The backend is forced with POSTTRAIN_CPU_MATMUL in each test (the default depends on the CPU's vendor), so the
oneDNN path is tested on every machine whose PyTorch has oneDNN, and the torch path everywhere."""

import copy
import pickle

import pytest
import torch

from posttrain.accel import products

HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
needs_onednn = pytest.mark.skipif(not HAS_ONEDNN, reason="this PyTorch build has no oneDNN linear kernel")


@pytest.fixture
def backend(monkeypatch):
    """Set the backend for one test: backend("onednn") / backend("torch")."""
    def choose(name):
        monkeypatch.setenv("POSTTRAIN_CPU_MATMUL", name)
        products.backend.cache_clear()
        assert products.backend() == name

    yield choose
    monkeypatch.delenv("POSTTRAIN_CPU_MATMUL", raising=False)
    products.backend.cache_clear()


def test_backend_choice(monkeypatch):
    try:
        monkeypatch.setenv("POSTTRAIN_CPU_MATMUL", "blas")
        products.backend.cache_clear()
        with pytest.raises(ValueError, match="POSTTRAIN_CPU_MATMUL must be 'onednn' or 'torch', got 'blas'"):
            products.backend()
        monkeypatch.delenv("POSTTRAIN_CPU_MATMUL")
        monkeypatch.setenv("POSTTRAIN_NO_KERNELS", "1")
        products.backend.cache_clear()
        assert products.backend() == "torch"
        monkeypatch.delenv("POSTTRAIN_NO_KERNELS")
        products.backend.cache_clear()
        vendor = products._cpu_vendor()
        expected = "onednn" if HAS_ONEDNN and torch.backends.mkl.is_available() and vendor not in ("GenuineIntel", "") \
            else "torch"
        assert products.backend() == expected
    finally:
        products.backend.cache_clear()


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 33), (2, 5, 33), (33,)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_float64_forward_and_backward(backend, shape, bias):
    backend("onednn")
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    weight = torch.randn(19, 33, requires_grad=True)
    b = torch.randn(19, requires_grad=True) if bias else None
    dy = torch.randn(*shape[:-1], 19)
    y = products.linear(x, weight, b)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "_LinearBackward"  # the oneDNN function ran
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    y64 = torch.nn.functional.linear(x64, w64, b64)
    y64.backward(dy.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(b.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_frozen_weight_and_strided_input(backend):
    """A frozen weight (PEFT's base layer, a reference model) gets no gradient; a transposed input is read as is."""
    backend("onednn")
    torch.manual_seed(1)
    x = torch.randn(24, 10).t().requires_grad_()  # (10, 24), not contiguous
    weight = torch.randn(6, 24)
    y = products.linear(x, weight)
    y.sum().backward()
    torch.testing.assert_close(y, x.detach() @ weight.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, torch.ones(10, 6) @ weight, rtol=1e-5, atol=1e-5)
    assert weight.grad is None


@needs_onednn
def test_deterministic_and_row_independent(backend):
    """Same inputs, same bits (a resumed run repeats the uninterrupted one); and a row's result does not
    depend on the other rows of the product, from two rows up (one row runs a matrix-vector kernel)."""
    backend("onednn")
    torch.manual_seed(2)
    x, weight = torch.randn(300, 576), torch.randn(1536, 576)
    full = products.linear(x, weight)
    assert torch.equal(full, products.linear(x, weight))
    for rows in (2, 7, 64, 129):
        assert torch.equal(products.linear(x[:rows], weight), full[:rows]), rows
    a, b = torch.randn(40, 300), torch.randn(300, 70)
    assert torch.equal(products.mm(a, b), products.mm(a, b))


@needs_onednn
def test_mm_and_in_place_forms(backend):
    backend("onednn")
    torch.manual_seed(3)
    a, b = torch.randn(13, 40), torch.randn(40, 21)
    ref = a.double() @ b.double()
    torch.testing.assert_close(products.mm(a, b).double(), ref, rtol=1e-5, atol=1e-5)
    # transposed operands (the weight-gradient product dW = dy^T x multiplies two of them)
    a_strided, b_strided = a.t().contiguous().t(), b.t().contiguous().t()
    assert not a_strided.is_contiguous() and not b_strided.is_contiguous()
    torch.testing.assert_close(products.mm(a_strided, b_strided).double(), ref, rtol=1e-5, atol=1e-5)
    out = torch.ones(13, 21)
    products.addmm_(out, a, b)
    torch.testing.assert_close(out.double(), ref + 1, rtol=1e-5, atol=1e-5)
    into = torch.full((26, 21), -5.0)
    products.mm_into(into[13:], a, b)
    torch.testing.assert_close(into[13:].double(), ref, rtol=1e-5, atol=1e-5)
    assert (into[:13] == -5).all()  # only the view was written


@pytest.mark.parametrize("case", ["float64", "bf16 autocast", "torch backend"])
def test_other_cases_are_exactly_torch(backend, case):
    """Everything the oneDNN path does not take computes exactly as F.linear / torch.mm."""
    backend("torch" if case == "torch backend" or not HAS_ONEDNN else "onednn")
    torch.manual_seed(4)
    dtype = torch.float64 if case == "float64" else torch.float32
    x, weight, b = torch.randn(9, 16, dtype=dtype), torch.randn(5, 16, dtype=dtype), torch.randn(5, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16 autocast"):
        got, want = products.linear(x, weight, b), torch.nn.functional.linear(x, weight, b)
        got_mm, want_mm = products.mm(x, weight.t()), torch.mm(x, weight.t())
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(got_mm, want_mm)


def _identity(x):
    return x


@needs_onednn
def test_enable_swaps_linear_layers_only(backend):
    backend("onednn")
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3, bias=False))
    replaced = torch.nn.Linear(3, 3)
    replaced.forward = _identity  # a forward replaced on the instance is left alone
    model.append(replaced)
    x = torch.randn(4, 8)
    before = model(x)
    assert products.enable(model) == 2
    assert [type(m) for m in model] == [products.Linear, torch.nn.ReLU, products.Linear, torch.nn.Linear]
    assert all(products.is_linear(m) for m in (model[0], model[2], model[3])) and not products.is_linear(model[1])
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # frozen copies keep the class
        assert type(other[0]) is products.Linear
        torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)
    assert products.disable(model) == 2
    assert type(model[0]) is torch.nn.Linear and torch.equal(model(x), before)


def test_enable_does_nothing_with_the_torch_backend(backend):
    backend("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert products.enable(model) == 0 and type(model[0]) is torch.nn.Linear


@needs_onednn
def test_trainer_patches_the_model_by_backend(backend, tiny_lm, tmp_path):
    from datasets import Dataset

    from posttrain import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"text": "a b c d e f"}] * 4)
    for name in ("onednn", "torch"):
        backend(name)
        model = copy.deepcopy(tiny_lm[0]).train()
        before = {k: v.clone() for k, v in model.named_parameters()}
        args = SFTConfig(output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=2,
                         learning_rate=1e-2, report_to="none", save_strategy="no", use_cpu=True)
        trainer = SFTTrainer(model, args=args, train_dataset=data, processing_class=tiny_lm[1])
        linears = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(type(m) is (products.Linear if name == "onednn" else torch.nn.Linear) for m in linears)
        trainer.train()
        changed = {k for k, v in trainer.model.named_parameters() if not torch.equal(v, before[k])}
        assert changed == set(before), set(before) - changed  # every trained parameter moved
