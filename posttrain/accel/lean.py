"""Lean activations: RMSNorm and SwiGLU as autograd functions that keep less for the backward.

Written as transformers writes them, a Llama-style RMSNorm (`weight * (x * rsqrt(mean(x^2) + eps))`,
in float32) makes autograd keep its input, the normalised input and the reciprocal RMS, and a
SwiGLU MLP (`down(silu(gate(x)) * up(x))`) keeps the gate's output (SiLU's input), SiLU's output
and the up projection's output, beside what the linear layers keep. The functions here keep only
the norm's input and reciprocal RMS, and the gate's and up's outputs (the rest is recomputed in the
backward): per token and layer 2 x hidden + intermediate floats fewer (2 x 576 + 1536 = 2688 for
SmolLM2-135M, about a quarter of its activations).

The forward runs the same operations in the same order as the transformers modules, so values are
bit for bit those of the unpatched model. The backward is the derivative,

    RMSNorm, n = x rstd, y = w n:   dw = sum_tokens dy n,   dx = rstd (g - n mean(g n)),  g = dy w
    SwiGLU,  y = silu(a) b:         db = dy silu(a),        da = dy b silu'(a)

computed with the steps (and kernels) autograd takes through the modules' operations, in its
order, so the gradients are bit for bit those of the unpatched model too (float32, bfloat16,
float64; tested). Only what autograd keeps changes; without gradients (generation, reference
models) the modules' own forward runs.

`make_lean(model)` patches, in place, the modules known to compute exactly that: each one's class
becomes a subclass whose forward uses the functions (`undo_lean` restores the class). The MLP keeps
calling its gate_proj, up_proj and down_proj modules, so LoRA layers, forward hooks (DeepSpeed
ZeRO-3, FSDP2) and posttrain's replayed linear layers still work; its act_fn module is no longer
called. Patched models deepcopy and pickle as usual.
"""

from __future__ import annotations

import torch
from torch import Tensor

# transformers classes whose forward is LlamaRMSNorm's: weight * normalised, computed in float32
# (not Gemma's `(1 + weight)` nor norms that multiply before casting back)
RMS_NORMS = frozenset({
    "LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "MinistralRMSNorm", "Ministral3RMSNorm", "Qwen2RMSNorm",
    "Qwen2MoeRMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Phi3RMSNorm", "SmolLM3RMSNorm", "GraniteRMSNorm",
    "GraniteMoeRMSNorm", "GlmRMSNorm", "Glm4RMSNorm", "DeepseekV3RMSNorm", "OlmoeRMSNorm", "Ernie4_5RMSNorm",
    "Exaone4RMSNorm", "SeedOssRMSNorm", "ApertusRMSNorm", "ArceeRMSNorm"})
# transformers classes whose forward is LlamaMLP's: down_proj(act_fn(gate_proj(x)) * up_proj(x)); patched
# only with a SiLU act_fn
SWIGLU_MLPS = frozenset({
    "LlamaMLP", "MistralMLP", "MinistralMLP", "Ministral3MLP", "Qwen2MLP", "Qwen2MoeMLP", "Qwen3MLP", "Qwen3MoeMLP",
    "SmolLM3MLP", "GraniteMLP", "DeepseekV3MLP", "OlmoMLP", "Olmo2MLP", "Olmo3MLP", "OlmoeMLP", "Ernie4_5MLP",
    "Exaone4MLP", "Glm4MoeMLP"})


class RMSNormFunction(torch.autograd.Function):
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), in float32 as LlamaRMSNorm; keeps x and rstd.

    Called as apply(x, x, weight, eps): x goes in twice, as it feeds two operations in the
    module (h^2 and h * rstd), so that a float32 x receives their two gradients one after the other,
    as autograd adds them to the other gradients of x (the residual stream's), in the same order.
    """

    @staticmethod
    def forward(ctx, x: Tensor, x_again: Tensor, weight: Tensor, eps: float) -> Tensor:
        h = x.to(torch.float32)
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (h * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # autograd's own steps for the forward's operations, so the gradients are its own bit for bit
        x, weight, rstd = ctx.saved_tensors
        h = x.to(torch.float32)
        n = (h * rstd).to(x.dtype)  # the normalised input, recomputed as the forward made it
        grad_x = grad_x_again = grad_w = None
        if ctx.needs_input_grad[2]:  # y = weight * n
            grad_w = (grad * n).sum(tuple(range(grad.dim() - 1))).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(x.dtype).to(torch.float32)  # through y = weight * n and n's cast
            grad_rstd = (g * h).sum(-1, keepdim=True)  # through h * rstd
            grad_var = -0.5 * grad_rstd * rstd.pow(3)  # rstd = rsqrt(var + eps)
            grad_square = grad_var.expand_as(h) / h.shape[-1]  # var = mean(h^2)
            grad_x, grad_x_again = g * rstd, grad_square * (2.0 * h)  # through h * rstd, through h^2
            if x.dtype != torch.float32:  # h is a cast of x: autograd sums the two before casting back
                grad_x, grad_x_again = (grad_x + grad_x_again).to(x.dtype), None
        return grad_x, grad_x_again, grad_w, None


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up; keeps gate and up and recomputes silu(gate) in the backward."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward((grad * up).to(gate.dtype), gate)
        if ctx.needs_input_grad[1]:
            grad_up = (grad * torch.nn.functional.silu(gate)).to(up.dtype)
        return grad_gate, grad_up


def _recording(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class LeanRMSNorm:
    """Mixed in before a Llama-style RMSNorm class (see `make_lean`)."""

    def forward(self, hidden_states: Tensor) -> Tensor:
        if not _recording(hidden_states, self.weight):
            return super().forward(hidden_states)
        return RMSNormFunction.apply(hidden_states, hidden_states, self.weight, self.variance_epsilon)


class LeanSwiGLU:
    """Mixed in before a Llama-style MLP class with a SiLU act_fn (see `make_lean`)."""

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(SwiGLUFunction.apply(gate, up) if _recording(gate, up)
                              else torch.nn.functional.silu(gate) * up)


_LEAN_CLASSES: dict[type, type] = {}  # plain class -> its lean subclass


def _lean_class(plain: type, mixin: type) -> type:
    if plain not in _LEAN_CLASSES:
        _LEAN_CLASSES[plain] = type(f"Lean{plain.__name__}", (mixin, plain),
                                    {"_plain_class": plain, "__reduce_ex__": _reduce_lean, "__module__": __name__})
    return _LEAN_CLASSES[plain]


def _reduce_lean(module, protocol):
    # the lean class is made at run time, so pickle names the plain class and the mixin, and _new_lean makes it
    lean = _LEAN_CLASSES[module._plain_class]
    reduced = super(lean, module).__reduce_ex__(protocol)
    if type(module) is not lean:  # subclassed again since (FSDP2): that class's own reduction
        return reduced
    mixin = LeanRMSNorm if isinstance(module, LeanRMSNorm) else LeanSwiGLU
    return (_new_lean, (module._plain_class, mixin), *reduced[2:])


def _new_lean(plain: type, mixin: type):
    lean = _lean_class(plain, mixin)
    return lean.__new__(lean)


def _mixin_for(module: torch.nn.Module) -> type | None:
    """The lean mixin for `module`, or None when it is not a module known to compute what the mixin assumes."""
    cls = type(module)
    if not cls.__module__.startswith("transformers.models.") or "forward" in vars(module):
        return None  # a look-alike from elsewhere (remote code), or a forward replaced on the instance
    if cls.__name__ in RMS_NORMS:
        return LeanRMSNorm
    act = getattr(module, "act_fn", None)
    if cls.__name__ in SWIGLU_MLPS and type(act).__name__ in ("SiLUActivation", "SiLU") and \
            not (act._forward_hooks or act._forward_pre_hooks):  # act_fn is no longer called: its hooks would not run
        return LeanSwiGLU
    return None


def is_lean(module: torch.nn.Module) -> bool:
    return isinstance(module, (LeanRMSNorm, LeanSwiGLU))


def make_lean(model: torch.nn.Module) -> int:
    """Patch `model`'s Llama-style RMSNorm and SwiGLU MLP modules in place; returns how many it patched.

    Forward values are unchanged (bit for bit); autograd keeps less (see the module docstring).
    Modules already lean, of other classes (Gemma's norm, a GELU MLP, remote code) or with a forward
    replaced on the instance are left as they are. Not for a model that is compiled with torch.compile.
    """
    patched = 0
    for module in model.modules():
        mixin = None if is_lean(module) else _mixin_for(module)
        if mixin is not None:
            module.__class__ = _lean_class(type(module), mixin)
            patched += 1
    return patched


def undo_lean(model: torch.nn.Module) -> int:
    """Give `make_lean`'s modules their plain class back; returns how many. A lean module that something
    subclassed again since (FSDP2's `fully_shard` does) is left lean."""
    undone = 0
    for module in model.modules():
        if type(module) in _LEAN_CLASSES.values():
            module.__class__ = module._plain_class
            undone += 1
    return undone
