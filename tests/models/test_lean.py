"""make_lean: forward bit for bit as transformers', gradients against float64, the saved-tensor bytes it
removes (worked out from the shapes), deepcopy and pickle, LoRA, and the modules it must leave alone."""

import ast
import copy
import importlib
import inspect
import pkgutil
import textwrap

import pytest
import torch
from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from tests.helpers.copies import copied_and_reloaded
from posttrain.accel.lean import RMS_NORMS, SWIGLU_MLPS, RMSNormFunction, SwiGLUFunction, is_lean, make_lean, undo_lean
from posttrain.models import compat
from posttrain.models.loading import load_causal_lm

SHAPE = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2)


def llama(**kw):
    """A float32 Llama with biased MLPs and norm weights away from 1, so every gradient term shows."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "mlp_bias": True, "rms_norm_eps": 1e-5, **kw}))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return model


def model_named(name):
    return llama() if name == "llama" else load_causal_lm(f"posttrain/{name}")


def lean_copy(model):
    lean = copy.deepcopy(model)
    layers = model.config.num_hidden_layers
    assert make_lean(lean) == 3 * layers + 1  # two norms and an MLP per layer, and the final norm
    return lean


def tokens(model, batch=2, length=9, seed=1):
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def grads(model, ids):
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama", "llama"])
def test_forward_is_bit_identical(name):
    plain = model_named(name).train()
    lean = lean_copy(plain)
    ids = tokens(plain)
    a = plain(ids, output_hidden_states=True)
    b = lean(ids, output_hidden_states=True)
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states))
    with torch.no_grad():  # the modules' own forward
        assert torch.equal(plain(ids).logits, lean(ids).logits)


@pytest.mark.parametrize("name", ["tiny-qwen2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gradients_are_the_plain_models_bit_for_bit(name, dtype):
    """The backward takes autograd's own steps, and adds the norm's two gradients of x to the residual
    stream's in autograd's order, so every parameter's gradient is the unpatched model's exactly."""
    plain = model_named(name).to(dtype)
    lean = lean_copy(plain)
    ids = tokens(plain)
    g_plain, g_lean = grads(plain, ids), grads(lean, ids)
    assert g_lean.keys() == g_plain.keys()
    assert all(g.abs().max() > 0 for g in g_plain.values())
    assert [n for n, g in g_plain.items() if not torch.equal(g_lean[n], g)] == []


def test_gradients_match_a_float64_reference():
    plain = llama()
    lean = lean_copy(plain)
    ids = tokens(plain)
    g64, g_lean = grads(copy.deepcopy(plain).double(), ids), grads(lean, ids)
    # embedding, head, final norm; per layer two norms, 7 weights and the MLP's 3 biases
    assert g_lean.keys() == g64.keys() and len(g64) == 3 + 3 * 12
    for name, ref in g64.items():
        scale = ref.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(g_lean[name].double(), ref, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_rms_norm_backward_against_the_float64_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    w = (torch.rand(16, generator=g) + 0.5).requires_grad_()
    upstream = torch.randn(2, 5, 16, generator=g)
    RMSNormFunction.apply(x, x, w, 1e-6).backward(upstream)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (w64 * x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).backward(upstream.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                             (torch.float64, torch.float64)])
def test_rms_norm_values_and_gradients_are_the_modules_in_every_dtype(x_dtype, w_dtype):
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(32, eps=1e-6).to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(32, generator=g) + 0.5)
    x = torch.randn(3, 4, 32, generator=g).to(x_dtype).requires_grad_()
    plain = norm(x)
    upstream = torch.randn(plain.shape, generator=g).to(plain.dtype)
    plain.backward(upstream)
    expected = x.grad, norm.weight.grad
    x.grad = norm.weight.grad = None
    lean = RMSNormFunction.apply(x, x, norm.weight, norm.variance_epsilon)
    assert torch.equal(lean, plain) and lean.dtype == plain.dtype
    lean.backward(upstream)
    for got, want in zip((x.grad, norm.weight.grad), expected):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_swiglu_gradients_are_autograds_and_pass_gradcheck():
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(4, 7, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(SwiGLUFunction.apply, (a, b))
    a32, b32 = (t.detach().float().requires_grad_() for t in (a, b))
    upstream = torch.randn(4, 7, generator=g)
    (torch.nn.functional.silu(a32) * b32).backward(upstream)
    expected = a32.grad, b32.grad
    a32.grad = b32.grad = None
    out = SwiGLUFunction.apply(a32, b32)
    assert torch.equal(out, torch.nn.functional.silu(a32) * b32)
    out.backward(upstream)
    assert torch.equal(a32.grad, expected[0]) and torch.equal(b32.grad, expected[1])  # the same kernels


def saved_bytes(model, ids) -> int:
    """Bytes of the tensors autograd keeps for the backward of a forward, parameters left out (each
    storage counted once: a tensor saved by several operations is kept once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids)
    return sum(s.nbytes() for s in kept.values())


@pytest.mark.parametrize("name", ["tiny-qwen2", "llama"])
def test_saved_tensor_bytes_drop_by_a_norm_input_per_norm_and_a_silu_output_per_mlp(name):
    """Per token: each norm keeps its input and rstd instead of input, normalised input and rstd (hidden
    floats fewer); each MLP keeps gate and up instead of gate, silu(gate) and up (intermediate fewer)."""
    plain = model_named(name).train()
    lean = lean_copy(plain)
    ids = tokens(plain, batch=2, length=11)
    c = plain.config
    per_token = ((2 * c.num_hidden_layers + 1) * c.hidden_size + c.num_hidden_layers * c.intermediate_size) * 4
    before, after = saved_bytes(plain, ids), saved_bytes(lean, ids)
    assert before - after == ids.numel() * per_token
    assert after < 0.85 * before


def test_deepcopy_pickle_and_undo():
    lean = lean_copy(llama())
    ids = tokens(lean)
    expected = grads(lean, ids)
    for other in copied_and_reloaded(lean):
        assert sum(map(is_lean, other.modules())) == 10
        assert isinstance(other.model.norm, LlamaRMSNorm) and isinstance(other.model.layers[0].mlp, LlamaMLP)
        got = grads(other, ids)
        assert all(torch.equal(got[n], g) for n, g in expected.items())
    plain_logits = lean(ids).logits
    assert undo_lean(lean) == 10 and make_lean(lean) == 10 and undo_lean(lean) == 10
    assert type(lean.model.norm) is LlamaRMSNorm and type(lean.model.layers[0].mlp) is LlamaMLP
    assert not any(map(is_lean, lean.modules())) and torch.equal(lean(ids).logits, plain_logits)


class OwnNorm(LlamaRMSNorm):  # defined here, not in transformers: its forward could be anything
    pass


def test_modules_it_does_not_know_are_left_alone():
    torch.manual_seed(0)
    gemma = GemmaForCausalLM(GemmaConfig(**SHAPE, head_dim=12))  # (1 + weight) norms, a GELU MLP
    assert make_lean(gemma) == 0 and not any(map(is_lean, gemma.modules()))
    gelu = llama(hidden_act="gelu")
    assert make_lean(gelu) == 7  # the norms only
    assert not any(is_lean(layer.mlp) for layer in gelu.model.layers)
    odd = llama()
    odd.model.norm = OwnNorm(SHAPE["hidden_size"])
    odd.model.layers[0].input_layernorm.forward = lambda x: x  # replaced on the instance
    assert make_lean(odd) == 8
    assert not is_lean(odd.model.norm) and not is_lean(odd.model.layers[0].input_layernorm)


def test_lora_adapters_train_through_the_lean_mlp():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"],
                             init_lora_weights=False)
    plain = peft.get_peft_model(llama(), config)
    lean = copy.deepcopy(plain)
    assert make_lean(lean) == 10
    ids = tokens(plain)
    assert torch.equal(plain(ids).logits, lean(ids).logits)
    g_plain, g_lean = grads(plain, ids), grads(lean, ids)
    adapters = [n for n, p in plain.named_parameters() if p.requires_grad]
    assert len(adapters) == 2 * 4 * 3 and all("lora_" in n for n in adapters)
    assert all(torch.equal(g_lean[name], g_plain[name]) for name in adapters)


def _transformers_classes(names):
    """{name: class} for the names, from the transformers.models packages their names start with."""
    found = {}
    import transformers.models as models

    for info in pkgutil.iter_modules(models.__path__):
        short = info.name.replace("_", "")
        wanted = [n for n in names if n.lower().replace("_", "").removeprefix(short) in ("rmsnorm", "mlp")]
        if wanted:
            module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
            found.update({n: getattr(module, n) for n in wanted if hasattr(module, n)})
    return found


def _body(function) -> str:
    """A function's statements, without its signature's annotations (which change between releases)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return ast.dump(ast.Module(body=tree.body[0].body, type_ignores=[]))


def test_the_known_classes_compute_what_llamas_do():
    """Every class make_lean knows has LlamaRMSNorm's or LlamaMLP's forward, line for line."""
    classes = _transformers_classes(RMS_NORMS | SWIGLU_MLPS)
    assert set(classes) == RMS_NORMS | SWIGLU_MLPS
    for name, cls in classes.items():
        reference = LlamaRMSNorm if name in RMS_NORMS else LlamaMLP
        assert _body(cls.forward) == _body(reference.forward), name
        assert cls.__module__.startswith("transformers.models.")


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradients_under_gradient_checkpointing_are_the_plain_models(reentrant):
    plain = llama().train()
    compat.enable_activation_checkpointing(plain, {"use_reentrant": reentrant})
    lean = lean_copy(plain)
    ids = tokens(plain)
    g_plain, g_lean = grads(plain, ids), grads(lean, ids)
    assert [n for n, g in g_plain.items() if not torch.equal(g_lean[n], g)] == []
