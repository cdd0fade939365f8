"""CPU kernels for the sampler's decoding step, and y = x W^T + b when x has only a few rows.

A one-token decoding step multiplies every weight matrix by a handful of rows (2 prompts x 4
samples: 8), so it is bound by streaming the weights from memory. PyTorch's float32 GEMM packs
the weight into panels on each call and is tuned for many rows; it streams weights well below
what the memory gives. `decode_kernels.c` loads each weight element once and multiplies it with
all rows held in L1 (figures in benchmarks/README.md, "Where time goes in the sampler").

The C file is compiled on first use with the system C compiler (`$CC`, else `cc`) into the
posttrain cache folder, and loaded with ctypes; its OpenMP threads come from the runtime
PyTorch already loaded. Without a compiler, on a CPU without AVX2 and FMA, or with
POSTTRAIN_NO_KERNELS=1, `available()` is False and decoding uses `F.linear` as before. The same
library holds the whole lean decoding step of `accel/decode.py`.

Two builds of the one source (`variant()`): "avx2", and "avx512" (also -mavx512f: the products take 16
floats per instruction) where the CPU has AVX-512F; POSTTRAIN_KERNELS_ISA=avx2 keeps the AVX2 build there.
The two give the same values up to float rounding (16 partial sums per output instead of 8); each build
gives the same values at every thread count.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from posttrain.accel import products

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("decode_kernels.c")
MAX_ROWS = 16  # beyond this PyTorch's GEMM is about as fast (benchmarks/README.md)
BASE_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]
ISA_FLAGS = {"avx2": [], "avx512": ["-mavx512f"]}
LIBS = ["-lm"]  # expf: the library then loads outside Python too


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(flags.split(":", 1)[1].split())


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= _cpu_flags()


def variant() -> str:
    """The build the kernels use here: "avx512" where the CPU has AVX-512F, unless POSTTRAIN_KERNELS_ISA=avx2;
    else "avx2"."""
    if os.environ.get("POSTTRAIN_KERNELS_ISA", "").lower() == "avx2" or "avx512f" not in _cpu_flags():
        return "avx2"
    return "avx512"


def _compile(target: Path, flags: list[str]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
    os.close(fd)
    try:
        compiler = os.environ.get("CC") or "cc"
        subprocess.run([compiler, *flags, "-o", tmp, str(SOURCE), *LIBS], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, target)  # atomic: a concurrent builder never loads half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def kernels():
    """The compiled kernels of `variant()`, or None where they cannot be built here (the reason is logged once);
    where the AVX-512 build fails, the AVX2 one."""
    if os.environ.get("POSTTRAIN_NO_KERNELS") == "1":
        return None
    return build(variant())


@functools.cache
def build(isa: str):
    """The kernels built for `isa` ("avx2" or "avx512"), or None where this CPU or compiler cannot."""
    if not _cpu_has_avx2_fma() or (isa == "avx512" and "avx512f" not in _cpu_flags()):
        logger.info("decoding kernels (%s) off: the CPU lacks %s", isa, "AVX-512F" if _cpu_has_avx2_fma() else
                    "AVX2/FMA")
        return None
    from posttrain.cache import cache_dir

    flags = BASE_FLAGS + ISA_FLAGS[isa]
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags + LIBS).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"decode_kernels-{key}.so"
    try:
        if not target.exists():
            _compile(target, flags)
        try:
            return ctypes.CDLL(str(target))
        except OSError as e:  # a damaged cache entry (a truncated copy, a full disk): compiled again, once
            logger.warning("cached decoding kernels %s cannot be loaded (%s): compiling them again", target, e)
            target.unlink(missing_ok=True)
            _compile(target, flags)
            return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("decoding kernels (%s) not built: %s", isa, detail.strip()[-500:])
        return build("avx2") if isa != "avx2" else None


@functools.cache
def few_rows_kernel():
    """The few-rows linear kernel (a ctypes function), or None."""
    return linear_function(kernels())


def linear_function(lib):
    """`few_rows_linear` of a kernels library (a ctypes function), or None without one."""
    if lib is None:
        return None
    fn = lib.few_rows_linear
    fn.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_ssize_t, ctypes.c_int, ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.c_int]
    fn.restype = None
    return fn


def available() -> bool:
    return few_rows_kernel() is not None


def whole(t: Tensor | None, shape: tuple[int, ...] | None = None) -> bool:
    """Whether a kernel may read `t` through its raw pointer: a plain tensor (not a DTensor, an FSDP flat
    parameter or a ZeRO-3 partitioned one), CPU, float32, strided and contiguous, of `shape` when given,
    whose storage holds every element. A sharded parameter keeps its full shape but holds a slice of the
    data, and FSDP frees a gathered weight's storage after each forward: a pointer taken from either reads
    memory the process does not own."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or hasattr(t, "ds_id"):  # ds_id: DeepSpeed ZeRO-3
        return False
    if not t.is_cpu or t.dtype != torch.float32 or t.layout != torch.strided or not t.is_contiguous():
        return False
    if shape is not None and t.shape != shape:
        return False
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def _usable(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    if type(x) is not torch.Tensor or weight.dim() != 2 or x.dim() < 1:
        return False
    N, K = weight.shape[0], x.shape[-1]
    return (x.device.type == "cpu" and x.dtype == torch.float32 and whole(weight, (N, K))
            and (bias is None or whole(bias, (N,))) and x.numel() <= MAX_ROWS * K
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def few_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`, through the kernel when x has at most MAX_ROWS rows (float32, CPU,
    no autograd), the weight and bias are `whole` and of x's width, and the kernel is available;
    otherwise through `F.linear`."""
    fn = few_rows_kernel()
    if fn is None or not _usable(x, weight, bias):
        return products.linear(x, weight, bias)
    K, N = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, K)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape[0], N, dtype=torch.float32)
    fn(flat.data_ptr(), flat.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
       N, flat.shape[0], N, K, torch.get_num_threads())
    return out.view(*x.shape[:-1], N)


def _forward(module: torch.nn.Linear, x: Tensor) -> Tensor:
    # the weight is looked up on each call: FSDP puts the gathered weight on the module only for the
    # duration of a forward, and the sharded one back after it
    return few_rows_linear(x, module.weight, module.bias)


@contextlib.contextmanager
def few_rows_linears(model):
    """Within the block, every CPU float32 `nn.Linear` of `model` (the output layer included) computes
    through `few_rows_linear`: the kernel for inputs of at most MAX_ROWS rows, `F.linear` otherwise.
    Yields whether the kernel is in use. For no-grad decoding (the products keep no autograd graph);
    a module whose forward is already replaced is left alone, and forward hooks still run. A weight that
    is not `whole` when the layer runs (sharded, non-contiguous, of another shape) goes through `F.linear`."""
    linears = [m for m in model.modules() if products.is_linear(m) and m.weight.device.type == "cpu"
               and m.weight.dtype == torch.float32 and "forward" not in m.__dict__]
    if not linears or not available() or torch.is_autocast_enabled("cpu"):
        yield False
        return
    try:
        for m in linears:
            m.forward = functools.partial(_forward, m)
        yield True
    finally:
        for m in linears:
            m.__dict__.pop("forward", None)


@functools.cache
def _sort_kernel():
    lib = kernels()
    if lib is None:
        return None
    fn = lib.sort_rows_descending
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _top_p_kernel():
    lib = kernels()
    if lib is None:
        return None
    fn = lib.top_p_filter_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_ssize_t, ctypes.c_float, ctypes.c_float,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def top_p_filter(logits: Tensor, top_p: float, band: float = 1e-5) -> tuple[Tensor, Tensor] | None:
    """(filtered, undecided): `logits` (..., V) with -inf outside each row's top-p support, the shortest prefix of the
    row sorted in descending order whose mass before each token stays below `top_p` (the cut of
    `generate.filter_logits`), found by the kernels without sorting the whole row (`top_p_filter_rows` in
    decode_kernels.c: a histogram of the values, then a sort of the largest ones only), and (...,) bool the rows it
    left as they were, for the caller to cut by sorting. The masses are those of `logits.softmax(-1)` summed as
    `cumsum` sums them over the sorted row; the softmax of the sorted row sums its normaliser in another order, so
    a row is cut here only where the masses on both sides of its cut lie more than `band` away from top_p (that
    rounding is a few 1e-6 at most on 49152 logits), and then its cut is the sort's. Undecided too: a row with a NaN
    or +inf, or equal logits on both sides of its cut. None where the kernel cannot take `logits` (not CPU float32,
    under autograd, no kernels)."""
    fn = _top_p_kernel()
    if (fn is None or type(logits) is not torch.Tensor or logits.device.type != "cpu" or logits.dtype != torch.float32
            or logits.dim() < 1 or logits.numel() == 0 or logits.requires_grad or logits.shape[-1] >= 2**31):
        return None
    flat = logits.reshape(-1, logits.shape[-1]).contiguous()
    probs = flat.softmax(-1)
    out, undecided = torch.empty_like(flat), torch.empty(flat.shape[0], dtype=torch.bool)
    fn(flat.data_ptr(), probs.data_ptr(), flat.shape[0], flat.shape[1], top_p, band, out.data_ptr(),
       undecided.data_ptr(), torch.get_num_threads())
    return out.view(logits.shape), undecided.view(logits.shape[:-1])


def stable_sort_descending(x: Tensor) -> tuple[Tensor, Tensor] | None:
    """(values, indices) of `x` (..., V) sorted in descending order along its last dimension, equal values in the
    order of their indices (a stable sort), by the kernels' radix sort: about 20 times cheaper than
    `torch.sort` on a few rows of a vocabulary. None where the kernel cannot take `x` (not CPU float32, under
    autograd, a NaN in it, no kernels): the caller sorts with torch. The values are those `torch.sort` gives
    (a comparison sort may order equal values, +0 and -0 included, otherwise)."""
    fn = _sort_kernel()
    if (fn is None or type(x) is not torch.Tensor or x.device.type != "cpu" or x.dtype != torch.float32
            or x.dim() < 1 or x.numel() == 0 or x.requires_grad or x.shape[-1] >= 2**31):
        return None
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    values, indices = torch.empty_like(flat), torch.empty(flat.shape, dtype=torch.long)
    if fn(flat.data_ptr(), flat.shape[0], flat.shape[1], values.data_ptr(), indices.data_ptr(),
          torch.get_num_threads()):
        return None
    return values.view(x.shape), indices.view(x.shape)
