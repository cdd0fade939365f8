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
from tests.helpers.launch import free_port, run_launch

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed_grpo.py")
_run = functools.partial(run_launch, timeout=240, path=os.path.dirname(__file__))


@pytest.mark.parametrize("mode", ["replay", "plain"])  # the training forward replays the sampler's, or computes
def test_two_processes_match_one(tmp_path, mode):
    pytest.importorskip("accelerate")
    one, two = str(tmp_path / "one.json"), str(tmp_path / "two.json")
    # 1 process x 8 completions (2 prompts) vs 2 processes x 4 completions (1 prompt each)
    _run([sys.executable, SCRIPT, one, "8", mode], tmp_path)
    _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
          SCRIPT, two, "4", mode], tmp_path)
    a, b = (json.load(open(p)) for p in (one, two))
    assert (a["processes"], b["processes"]) == (1, 2)
    assert (a["replayed"] > 0, b["replayed"] > 0) == ((mode == "replay",) * 2)
    assert b["reward"] == pytest.approx(a["reward"], abs=1e-6)  # the same completions were sampled
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    for name, value in a["weights"].items():
        assert b["weights"][name] == pytest.approx(value, rel=1e-5, abs=1e-5), name
