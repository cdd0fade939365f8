"""`keep_freed_memory`: a large block freed and allocated again reuses the heap instead of
faulting in fresh pages from the OS (checked by counting minor page faults, in fresh processes)."""

import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from posttrain.trainers.base import keep_freed_memory
    assert keep_freed_memory()
x = torch.ones(64 * 2**20)  # 256 MiB
del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(64 * 2**20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_freed_blocks_are_reused_without_page_faults():
    faults = {}
    for mode in ("default", "keep"):
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
        faults[mode] = int(out.stdout.strip().splitlines()[-1])
    pages = 256 * 2**20 // 4096
    assert faults["default"] > pages // 2  # glibc mapped the 256 MiB afresh: a fault per page (or huge page)
    assert faults["keep"] < pages // 20, faults  # the freed heap memory was reused
