"""Asynchronous rollouts with several processes (DDP on 2 CPU processes, gloo; tests/trainers/distributed_async.py):
max_staleness=0 is bit-identical to the synchronous engine, and max_staleness=1 (each process's background
sampler running tool episodes, whose metrics it gathers on its own process group while training all-reduces
gradients) trains, keeps a batch in flight at a checkpoint and resumes bit-identically from it."""

import functools
import json
import os
import sys

import pytest
from tests.helpers.launch import free_port, run_launch

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed_async.py")
_run = functools.partial(run_launch, timeout=420, path=os.path.dirname(__file__))


def test_two_processes_sample_ahead_and_resume(tmp_path):
    pytest.importorskip("accelerate")
    out = str(tmp_path / "out.json")
    _run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
          "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
          SCRIPT, out, str(tmp_path / "runs")], tmp_path)
    results = json.load(open(out))
    assert {r["processes"] for k, r in results.items() if k != "in_flight_on_last_rank"} == {2}
    assert results["zero"]["weights"] == results["sync"]["weights"]  # max_staleness=0: the synchronous engine
    assert results["zero"]["logs"] == results["sync"]["logs"]
    full, resumed = results["full"], results["resumed"]
    assert [v for _, k, v in full["logs"] if k == "rollout/staleness"] == [0.0, 1.0, 1.0, 1.0]
    # gathered over the processes by the background samplers, one per step
    assert [step for step, k, _ in full["logs"] if k == "tools/calls_per_completion"] == [1, 2, 3, 4]
    assert full["weights"] != results["sync"]["weights"]
    assert results["in_flight_on_last_rank"] == [2]  # each process saved its own batch sampled ahead
    assert resumed["weights"] == full["weights"]  # bit-identical after resuming
    assert [row for row in resumed["logs"] if row[0] > 2] == [row for row in full["logs"] if row[0] > 2]
