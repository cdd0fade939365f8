"""The CPU kernels read weights through raw pointers: they must never be handed a weight whose pointer does
not lead to the whole matrix (a DTensor shard, an FSDP-freed gathered weight, a transposed view, a weight
of another shape or dtype). Each such weight goes through torch's own op, with torch's result or error.

DTensors and `fully_shard` run here in a 1-process gloo group: the parameters are then DTensors (whose
`data_ptr()` is 0) although each holds the whole matrix.
"""

import copy
import shutil
import socket
import types

import pytest
import torch
from tests.helpers.rollout import varied

from posttrain.accel import few_rows, products
from posttrain.accel.decode import lean_decoder
from posttrain.accel.few_rows import few_rows_linear, whole
from posttrain.accel.replay import LinearRecord, replaying
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.rollout.generate import SamplingConfig, generate

can_build = shutil.which("cc") is not None and few_rows._cpu_has_avx2_fma()
needs_kernel = pytest.mark.skipif(not can_build, reason="no C compiler or no AVX2/FMA CPU: no kernel to guard")


@pytest.fixture(scope="module")
def mesh():
    """A 1-process gloo group and its device mesh, for DTensors and fully_shard."""
    dist = torch.distributed
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Replaces the few-rows kernel by one that only records its calls (the row count)."""
    calls = []
    monkeypatch.setattr(few_rows, "few_rows_kernel", lambda: lambda *args: calls.append(args[6]))
    return calls


def _freed(t):
    t.untyped_storage().resize_(0)  # what FSDP does to a gathered weight after the forward
    return t


def test_whole_takes_only_what_a_pointer_can_read():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    assert whole(w) and whole(w, (6, 4)) and whole(torch.nn.Parameter(w), (6, 4))
    assert whole(torch.randn(10, 4, generator=g)[2:8], (6, 4))  # an offset slice that its storage holds
    assert not whole(w, (4, 6)) and not whole(w, (6, 5))
    assert not whole(torch.randn(4, 6, generator=g).t())  # transposed view
    assert not whole(w.double()) and not whole(w.half())
    assert not whole(torch.empty(6, 4, device="meta"))
    assert not whole(_freed(torch.randn(6, 4, generator=g)), (6, 4))
    zero3 = torch.nn.Parameter(torch.randn(6, 4, generator=g))
    zero3.ds_id = 0  # DeepSpeed ZeRO-3 marks its partitioned parameters so
    assert not whole(zero3)
    assert not whole(None)


def test_a_whole_weight_reaches_the_kernel(kernel_calls):
    # the control for the tests below: the recording kernel does see a plain weight
    few_rows_linear(torch.randn(3, 4), torch.randn(5, 4), torch.randn(5))
    assert kernel_calls == [3]


@pytest.mark.parametrize("case", ["transposed", "narrow", "float64", "short bias"])
def test_odd_weights_go_through_torch(kernel_calls, case):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=g)
    w, b = torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    if case == "transposed":
        w = w.t().contiguous().t()
    if case == "narrow":  # x has 4 features, the weight 3: torch refuses, the kernel would read past the end
        with pytest.raises(RuntimeError) as torch_error:
            torch.nn.functional.linear(x, w[:, :3].contiguous(), b)
        with pytest.raises(RuntimeError) as ours:
            few_rows_linear(x, w[:, :3].contiguous(), b)
        assert str(ours.value) == str(torch_error.value) and kernel_calls == []
        return
    if case == "float64":
        x, w, b = x.double(), w.double(), b.double()
    if case == "short bias":  # torch broadcasts a 1-element bias; the kernel would read 5
        b = b[:1].clone()
    out = few_rows_linear(x, w, b)
    assert kernel_calls == []
    # torch's product (through oneDNN where products.backend() says so: the same call as every other layer's)
    torch.testing.assert_close(out, products.linear(x, w, b), rtol=0, atol=0)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-6, atol=1e-6)


def test_a_freed_weight_goes_through_torch(kernel_calls):
    w = _freed(torch.randn(5, 4))
    with pytest.raises(RuntimeError, match="out of bounds"):  # torch's own refusal, not a crash
        few_rows_linear(torch.randn(3, 4), w)
    assert kernel_calls == []


def test_a_dtensor_weight_goes_through_torch(kernel_calls, mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    dw, db = distribute_tensor(w, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)])
    assert dw.data_ptr() == 0  # what the kernel would have read from
    dx = distribute_tensor(x, mesh, [Replicate()])
    out = few_rows_linear(dx, dw, db)
    assert kernel_calls == []
    torch.testing.assert_close(out.full_tensor(), torch.nn.functional.linear(x, w, b), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):  # as F.linear says it
        few_rows_linear(x, dw, db)
    assert kernel_calls == []


def _sharded(model):
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(model)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def test_the_lean_step_refuses_sharded_or_odd_weights(mesh):
    model = load_causal_lm("posttrain/tiny-qwen2").eval()
    assert lean_decoder(model) is not None  # the control
    assert lean_decoder(_sharded(model)) is None
    odd = copy.deepcopy(model)
    up = odd.model.layers[1].mlp.up_proj
    up.weight = torch.nn.Parameter(up.weight.detach().t().contiguous().t())
    assert lean_decoder(odd) is None


@needs_kernel
def test_the_compiled_step_is_not_bound_to_odd_tensors():
    model = load_causal_lm("posttrain/tiny-qwen2").eval()
    lean = lean_decoder(model)
    A, cap = 2, 8

    def cache(shape):
        return types.SimpleNamespace(layers=[types.SimpleNamespace(key_buffer=torch.zeros(shape), value_buffer=torch.zeros(shape))
                                             for _ in lean.layers])

    right = (A, lean.kv_heads, cap, lean.head_dim)
    lean.bind(cache(right))
    assert lean._c is not None  # the control
    lean.bind(cache((A, lean.kv_heads, cap, lean.head_dim // 2)))  # buffers too small for the step's writes
    assert lean._c is None
    weight, bias = lean.layers[0]["down"]
    lean.layers[0]["down"] = (weight.t().contiguous().t(), bias)
    lean.bind(cache(right))
    assert lean._c is None
    lean.layers[0]["down"] = (weight[:, :-8].contiguous(), bias)  # the intermediate size the step assumes is wider
    lean.bind(cache(right))
    assert lean._c is None


def test_generate_with_fully_sharded_weights_matches_plain_weights(mesh, monkeypatch):
    """In one process the sharded model's forward gathers each layer's weight: the kernels may run then (on
    the gathered weight, looked up per call), and the rollout equals the plain model's."""
    tok = load_tokenizer("posttrain/tiny-qwen2")
    plain = varied("posttrain/tiny-qwen2")
    sharded = _sharded(plain)
    calls = []
    if few_rows.available():
        kernel = few_rows.few_rows_kernel()
        monkeypatch.setattr(few_rows, "few_rows_kernel", lambda: lambda *a: calls.append(a[6]) or kernel(*a))
    ids = [tok(p)["input_ids"] for p in ["reverse 1234 =", "a"]]
    sampling = SamplingConfig(max_new_tokens=5, num_generations=3)
    args = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    a = generate(plain, ids, sampling, generator=torch.Generator().manual_seed(3), **args)
    b = generate(sharded, ids, sampling, generator=torch.Generator().manual_seed(3), **args)
    assert all(type(p).__name__ == "DTensor" for p in sharded.model.layers.parameters())  # resharded after each forward
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)
    assert bool(calls) == few_rows.available()


def test_replay_computes_a_layer_whose_weight_it_cannot_take():
    g = torch.Generator().manual_seed(4)
    linear = torch.nn.Linear(4, 5)
    record = LinearRecord([[linear]], prompts=1, prompt_length=2, rows=1, steps=1, group=1)
    record.layers[0].fill_(7.0)  # not what the layer computes: shows which path ran
    record.fed[:] = True  # written by hand: no position for the record to zero as never fed
    layout = record.layout(torch.tensor([[0]]), 2, 1)  # (1, 3): 2 prompt positions and 1 completion position
    x = torch.randn(1, 3, 4, generator=g)
    with replaying(record, layout):
        assert torch.equal(linear(x), torch.full((1, 3, 5), 7.0))  # the control: replayed
    linear.weight = torch.nn.Parameter(linear.weight.detach().t().contiguous().t())
    with replaying(record, layout):
        torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    linear.weight = torch.nn.Parameter(torch.randn(5, 3, generator=g))  # x has 4 features: torch refuses
    with replaying(record, layout), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        linear(x)
