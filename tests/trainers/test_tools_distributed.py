"""GRPO with tools on 2 CPU processes (accelerate launch, gloo) equals 1 process with the same global batch:
a tool function (`tools=`) and an environment (`environment_factory=GuessNumberEnv`), each rollout with tool
turns fed into the KV cache. Launched as in test_distributed.py (`--multi_gpu`, the script sets `use_cpu=True`).

tiny-qwen2 is first fitted on tool-call traces (test_agentic.fit_caller), so its rollouts call the tools.
"""

import functools
import json
import os
import sys

import pytest
import torch
from tests.helpers.launch import accelerate_on_two, joined, run_launch

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed_tools.py")
_run = functools.partial(run_launch, timeout=600, path=os.path.dirname(__file__))


@pytest.fixture(scope="module")
def caller_weights(tmp_path_factory):
    from tests.trainers.test_agentic import fit_caller

    path = tmp_path_factory.mktemp("caller") / "weights.pt"
    torch.save(fit_caller(), path)
    return str(path)


KINDS = ["tool", "env"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, caller_weights):
    """Each kind's result from 1 process and from 2, both kinds in one launch each (worker_jobs.py):
    1 process x 8 episodes (2 prompts) vs 2 processes x 4 episodes (1 prompt each)."""
    pytest.importorskip("accelerate")
    folder = tmp_path_factory.mktemp("tools")
    _run([sys.executable, SCRIPT, *joined(*([folder / f"one_{k}.json", 8, k, caller_weights] for k in KINDS))], folder)
    _run([*accelerate_on_two(SCRIPT), *joined(*([folder / f"two_{k}.json", 4, k, caller_weights] for k in KINDS))],
         folder)
    return {k: [json.load(open(folder / f"{n}_{k}.json")) for n in ("one", "two")] for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_two_processes_match_one_with_tools(runs, kind):
    a, b = runs[kind]
    assert (a["processes"], b["processes"]) == (1, 2)
    assert a["calls"] > 0 and a["turns"] > 1  # the episodes had tool turns
    assert a["reward_std"] > 0  # and advantages that are not all 0, so the update depends on them
    assert a["replayed"] > 0 and b["replayed"] > 0  # the training forward replayed the multi-turn sampler's
    # the same episodes were sampled and scored
    assert (b["calls"], b["turns"]) == pytest.approx((a["calls"], a["turns"]), abs=1e-6)
    assert (b["reward"], b["reward_std"]) == pytest.approx((a["reward"], a["reward_std"]), abs=1e-6)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    # the same update of every parameter: plain SGD, so the update is the learning rate times the gradient
    # averaged over all 8 episodes (Adam's first step, lr * sign(gradient), would turn float32 rounding in
    # near-zero gradients into whole steps and hide a wrongly scaled gradient); within float32 rounding of
    # the gradient's terms, summed in another order over two processes (measured: at most 1.8e-5 of an
    # update with MKL's products, 6.4e-7 with oneDNN's; a norm weight's gradient sums terms of both signs)
    assert all(norm > 0 for _, norm in a["weights"].values())  # every parameter moved
    for name, (total, norm) in a["weights"].items():
        other_total, other_norm = b["weights"][name]
        assert other_norm == pytest.approx(norm, rel=1e-4), name
        assert abs(other_total - total) <= 1e-4 * norm, name
