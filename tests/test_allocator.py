"""`keep_freed_memory`: in a training-like loop that makes and frees the same large tensors every
step, the later steps reuse the heap instead of faulting in fresh pages from the OS (checked by
counting minor page faults, in fresh processes)."""

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from posttrain.trainers.base import keep_freed_memory
    assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for step in range(12):
    before = faults()
    x = torch.ones(32 * 2**20)  # 128 MiB
    y = x * 2
    loss = float(y.sum())
    del x, y
    counts.append(faults() - before)
print(sum(counts[4:]) // 8)  # page faults per step once warm
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_freed_blocks_are_reused_without_page_faults():
    faults = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        faults[mode] = int(out.stdout.strip().splitlines()[-1])
    pages = 2 * 128 * 2**20 // 4096  # two 128 MiB tensors a step
    assert faults["default"] > pages // 2, faults  # glibc mapped both afresh: a fault per page (or huge page)
    # the freed heap memory was reused (most steps fault nothing; now and then a block that a small
    # allocation split has to be extended)
    assert faults["keep"] < faults["default"] // 3, faults
