"""Float32 matrix products on CPU through oneDNN where MKL's sgemm does not use the CPU's full vector width.

PyTorch's x86 builds multiply float32 matrices on CPU with MKL's sgemm (`torch.mm`, `F.linear` and their
backward). MKL chooses its code by CPU vendor: on a CPU that is not Intel's it runs its AVX2 code, also
where the CPU has AVX-512. oneDNN, in the same PyTorch build (`torch.ops.mkldnn._linear_pointwise`, what
PyTorch runs for bfloat16 products), chooses its kernels by the instruction sets the CPU reports. On an AMD
EPYC with AVX-512, at SmolLM2-135M's training shapes, sgemm leaves half the vector width unused and oneDNN
does not; held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), oneDNN still matches sgemm (the figures are in
benchmarks/README.md, "Float32 products through oneDNN").

`backend()` says which library posttrain's float32 CPU products use: "onednn" on an x86 CPU that is not
Intel's when the build has both MKL and oneDNN, else "torch" (PyTorch's own choice, unchanged). The
environment variable POSTTRAIN_CPU_MATMUL=onednn or =torch sets it; POSTTRAIN_NO_KERNELS=1 means "torch".
The choice is a rule, not a timing, so a run and its resumption make the same one and compute the same
numbers: oneDNN's products are deterministic for a given thread count, and a row's result does not depend
on the other rows of a product of two rows or more (tested; sgemm's changes below 12 rows, measured), but
they are not bit for bit sgemm's (another summation order, the same float32 accuracy).

`enable(model)` gives every `nn.Linear` of a model the class `Linear` (a subclass whose forward runs
`linear`), in place, when the backend is oneDNN. `linear(x, weight, bias)` is `F.linear` with its
products through oneDNN, the backward's too (dx = dy W, dW = dy^T x, db = sum dy), for plain CPU float32
tensors outside autocast; anything else (a GPU, float64, bf16 autocast, a DTensor, a DeepSpeed ZeRO-3 or
freed FSDP weight) goes through `F.linear` as before. `mm(a, b)` is `torch.mm` under the same rule
(`addmm_` and `mm_into` its in-place forms). Forward hooks, PEFT's adapters (its base layer and adapters
are `nn.Linear`s) and posttrain's replayed and few-rows linear layers (which replace a module's forward on
the instance) work on the subclass as on `nn.Linear`. A model is left patched after training; it saves,
copies and pickles as before (`disable(model)` gives its layers back their class).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


@functools.cache
def backend() -> str:
    """"onednn" or "torch": the library of posttrain's float32 CPU products in this process (see the module)."""
    forced = os.environ.get("POSTTRAIN_CPU_MATMUL", "").strip().lower()
    if forced not in ("", "onednn", "torch"):
        raise ValueError(f"POSTTRAIN_CPU_MATMUL must be 'onednn' or 'torch', got {forced!r}")
    has_onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if forced == "onednn" and not has_onednn:
        raise ValueError("POSTTRAIN_CPU_MATMUL=onednn, but this PyTorch build has no oneDNN linear kernel")
    if forced:
        return forced
    if os.environ.get("POSTTRAIN_NO_KERNELS") == "1" or not has_onednn or not torch.backends.mkl.is_available():
        return "torch"
    vendor = _cpu_vendor()
    choice = "onednn" if vendor not in ("GenuineIntel", "") else "torch"
    logger.info("float32 CPU products: %s (CPU vendor %s)", choice, vendor or "unknown")
    return choice


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _onednn(a: Tensor, b_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """a @ b_t^T (+ bias) through oneDNN; a (M, K), b_t (N, K), any strides."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


def _plain(t: Tensor) -> bool:
    """A CPU float32 strided tensor whose storage holds every element it views: not a DTensor, a DeepSpeed
    ZeRO-3 parameter (ds_id) or a parameter whose storage FSDP freed."""
    if type(t) not in (Tensor, torch.nn.Parameter) or hasattr(t, "ds_id"):
        return False
    if t.device.type != "cpu" or t.dtype != torch.float32 or t.layout != torch.strided:
        return False
    end = t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.numel() == 0 or t.untyped_storage().nbytes() >= end * t.element_size()


def _use_onednn(*tensors: Tensor | None) -> bool:
    if backend() != "onednn" or torch.is_autocast_enabled("cpu"):
        return False
    return all(t is None or _plain(t) for t in tensors)


def mm(a: Tensor, b: Tensor) -> Tensor:
    """`torch.mm(a, b)` (2-D), through oneDNN when the backend is oneDNN and both are plain CPU float32 tensors.
    No autograd: for products inside autograd functions' own forward and backward."""
    if _use_onednn(a, b) and a.shape[0] and b.shape[1] and a.shape[1]:
        return _onednn(a, b.t())
    return torch.mm(a, b)


def addmm_(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """`out.addmm_(a, b)` (out += a @ b), the product through oneDNN under `mm`'s rule."""
    if _use_onednn(out, a, b):
        return out.add_(mm(a, b))
    return out.addmm_(a, b)


def mm_into(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """`torch.mm(a, b, out=out)`, the product through oneDNN under `mm`'s rule."""
    if _use_onednn(out, a, b):
        return out.copy_(mm(a, b))
    return torch.mm(a, b, out=out)


class _Linear(torch.autograd.Function):
    """y = x W^T + b with the forward's and backward's products through oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        want_x, want_w, want_b = ctx.needs_input_grad
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = mm(flat, weight).view(x.shape) if want_x else None
        grad_w = mm(flat.t(), x.reshape(-1, x.shape[-1])) if want_w else None
        grad_b = flat.sum(0) if ctx.has_bias and want_b else None
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`; its products through oneDNN (forward and backward) when the backend is
    oneDNN and x, weight and bias are plain CPU float32 tensors with something to multiply."""
    if (x.dim() >= 1 and weight.dim() == 2 and x.numel() and weight.numel() and x.shape[-1] == weight.shape[1]
            and (bias is None or bias.shape == weight.shape[:1]) and _use_onednn(x, weight, bias)):
        return _Linear.apply(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


class Linear(torch.nn.Linear):
    """nn.Linear whose products go through `linear` (oneDNN on CPU float32; F.linear otherwise)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def is_linear(module) -> bool:
    """Whether `module` is a plain linear layer: an nn.Linear or this module's subclass of it, nothing else."""
    return type(module) in (torch.nn.Linear, Linear)


def enable(model: torch.nn.Module) -> int:
    """Give every nn.Linear of `model` (exactly that class) the class `Linear`, in place, when the backend is
    oneDNN; returns how many. A module whose forward was replaced on the instance is left alone."""
    if backend() != "onednn":
        return 0
    patched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and "forward" not in vars(module):
            module.__class__ = Linear
            patched += 1
    return patched


def disable(model: torch.nn.Module) -> int:
    """Give `enable`'s modules the class nn.Linear back; returns how many."""
    undone = 0
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = torch.nn.Linear
            undone += 1
    return undone
