"""Process memory habits for training on CPU: glibc's allocator, trained weights in the process's own
memory, and Adam's state made up front.

None is trainer logic; `BaseTrainer` copies the trained weights always and applies the other two
when `keep_freed_memory` is set (the default on CPU). `keep_freed_memory()` changes malloc for the
whole process (the user's code included, for the rest of its life), so it can be turned off two
ways: the config field (`keep_freed_memory=False`, CLI `--keep_freed_memory false`) or, for every
trainer of a process without touching code, `POSTTRAIN_KEEP_FREED_MEMORY=0` in the environment.
benchmarks/README.md has what each was measured to save.
"""

from __future__ import annotations

import bisect
import os

import torch

OFF_SWITCH = "POSTTRAIN_KEEP_FREED_MEMORY"  # "0", "false", "no" or "off": malloc is left as it is


def keep_freed_memory() -> bool:
    """Make glibc's malloc serve every block from its heap and never give freed memory back to the OS.

    By default glibc maps each block above 32 MiB (gradients, activations of a training step) fresh
    from the OS and unmaps it on free, so every step pays page faults to zero-fill them again.
    Returns True when the settings took effect (glibc found), False elsewhere or when the environment
    variable POSTTRAIN_KEEP_FREED_MEMORY is 0 / false / no / off.
    """
    import ctypes
    import ctypes.util
    import sys

    if os.environ.get(OFF_SWITCH, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def make_adam_state(optimizer) -> bool:
    """Create an Adam / AdamW optimizer's state (step 0, zero moments) now instead of in its first step.

    With `keep_freed_memory`, memory freed by a training step is reused by the next allocations.
    Moments created lazily in the first `optimizer.step()` take the space the first step's
    activations just left, so the second step's activations need new pages from the OS. Created before
    any step, the moments sit below the steps' memory (`benchmarks/README.md` has the page-fault counts).
    The state is what the first step
    would have made: torch's own initialisation runs in one step with zero gradients and zero
    learning rates (the parameters do not change), after which every state tensor, the step count
    included, is zeroed. Returns True when the state was made; other optimizers, or one that already
    has state, are left alone.
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or optimizer.state:
        return False
    if any(isinstance(group["lr"], torch.Tensor) for group in optimizer.param_groups):
        return False
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad and p.grad is None]
    if not params:
        return False
    rates = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, rates):
            group["lr"] = lr
        for p in params:
            p.grad = None
    with torch.no_grad():
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
    return True


def _file_mapped():
    """A function telling whether an address lies in a mapping of a file (from /proc/self/maps), or None
    where the maps cannot be read or no file is mapped."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    mapped = []  # (start, end) of each mapping of a file
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/"):
            start, end = fields[0].split("-")
            mapped.append((int(start, 16), int(end, 16)))
    if not mapped:
        return None
    mapped.sort()
    starts = [start for start, _ in mapped]

    def in_file(address: int) -> bool:
        i = bisect.bisect_right(starts, address) - 1
        return i >= 0 and address < mapped[i][1]

    return in_file


def _plain_cpu(p: torch.Tensor) -> bool:
    return type(p.data) is torch.Tensor and p.device.type == "cpu" and p.numel() > 0


def own_file_backed(params) -> int:
    """Copy into the process's own memory every CPU parameter of `params` whose bytes lie in a file mapping;
    returns how many were copied (0 where /proc/self/maps cannot be read).

    transformers loads safetensors checkpoints on CPU as private maps of the file: a parameter's pages
    are the file's until the first write to each page copies it (a copy-on-write fault per 4 KiB page).
    The optimizer's first step writes every trained parameter, so a training run would pay one such
    fault per page there. One copy of each parameter first costs a fraction of those faults' time (the
    counts and times are in benchmarks/README.md) and lets the mapping go once no tensor uses it. A
    parameter keeps its identity (the optimizer and tied weights still refer to it): its storage is copied,
    once for all the parameters that share it, and each is set to the same view of the copy.
    """
    in_file = _file_mapped()
    if in_file is None:
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    for p in {id(p): p for p in params}.values():
        if _plain_cpu(p) and in_file(p.data_ptr()):
            by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(p)
    with torch.no_grad():
        for shared in by_storage.values():
            copy = shared[0].untyped_storage().clone()
            for p in shared:
                p.data = torch.empty(0, dtype=p.dtype).set_(copy, p.storage_offset(), p.shape, p.stride())
    return sum(len(shared) for shared in by_storage.values())


def hand_over_file_backed(trained: torch.nn.Module, frozen: torch.nn.Module) -> int:
    """After `frozen = deepcopy(trained)`: give the frozen copy the trained model's file-backed weights and
    the trained model the copy's weights (in the process's own memory, equal values); returns how many
    parameters swapped.

    The trained weights must leave the checkpoint's file mapping before the optimizer writes them
    (`own_file_backed`), and the deep copy has just made a copy of each in process memory: swapping the
    two saves that second copy (a model's size of fresh pages; benchmarks/README.md) and the frozen
    model, never written, reads the file's pages. Parameters are paired by name; a pair swaps only when
    both are plain CPU tensors of the same shape, strides and dtype, the trained one in a file mapping
    and the frozen one not. Identities stay (each keeps its Parameter object), and storage sharing
    (tied weights) is kept on both sides, as deepcopy keeps it.
    """
    in_file = _file_mapped()
    if in_file is None:
        return 0
    copies = dict(frozen.named_parameters(remove_duplicate=False))
    swapped, seen = 0, set()
    with torch.no_grad():
        for name, p in trained.named_parameters(remove_duplicate=False):
            q = copies.get(name)
            if id(p) in seen or q is None or not (_plain_cpu(p) and _plain_cpu(q)):
                continue
            if (p.shape, p.stride(), p.dtype) != (q.shape, q.stride(), q.dtype) or q is p:
                continue
            if in_file(p.data_ptr()) and not in_file(q.data_ptr()):
                seen.add(id(p))
                p.data, q.data = q.data, p.data
                swapped += 1
    return swapped
