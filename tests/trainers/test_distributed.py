"""GRPO on 2 CPU processes (accelerate launch, gloo) equals 1 process with the same global batch.

`accelerate launch --cpu --num_processes 2` starts one process unless MPI is installed, so the test
asks for the torch.distributed launcher (`--multi_gpu`) and the script puts the run on the CPU
(`use_cpu=True`) with the gloo backend.
"""

import functools
import json
import os
import sys

import pytest
from tests.helpers.launch import accelerate_on_two, joined, run_launch

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed_grpo.py")
_run = functools.partial(run_launch, timeout=480, path=os.path.dirname(__file__))


MODES = ["replay", "plain"]  # the training forward replays the sampler's, or computes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each mode's result from 1 process and from 2, both modes in one launch each (worker_jobs.py):
    1 process x 8 completions (2 prompts) vs 2 processes x 4 completions (1 prompt each)."""
    pytest.importorskip("accelerate")
    folder = tmp_path_factory.mktemp("grpo")
    _run([sys.executable, SCRIPT, *joined(*([folder / f"one_{m}.json", 8, m] for m in MODES))], folder)
    _run([*accelerate_on_two(SCRIPT), *joined(*([folder / f"two_{m}.json", 4, m] for m in MODES))], folder)
    return {m: [json.load(open(folder / f"{n}_{m}.json")) for n in ("one", "two")] for m in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_two_processes_match_one(runs, mode):
    a, b = runs[mode]
    assert (a["processes"], b["processes"]) == (1, 2)
    assert (a["replayed"] > 0, b["replayed"] > 0) == ((mode == "replay",) * 2)
    assert b["reward"] == pytest.approx(a["reward"], abs=1e-6)  # the same completions were sampled
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    for name, value in a["weights"].items():
        assert b["weights"][name] == pytest.approx(value, rel=1e-5, abs=1e-5), name
