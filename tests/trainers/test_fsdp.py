"""GRPO, RLOO and PPO with the policy sharded by FSDP2 (`fully_shard`) on 2 CPU processes (gloo).

accelerate 1.15 runs no FSDP on the CPU (with `use_cpu=True` an FSDP launch becomes DDP), so the script
(`fsdp_grpo.py`) is launched by torchrun and shards the policy itself, as accelerate's FSDP2 path does.
Under FSDP2 every forward gathers weights from both processes: generation must run the same number of
forwards on each (lock-step decoding), and the CPU kernels must not read the sharded weights.
"""

import functools
import json
import os
import sys

import pytest
from tests.helpers.launch import free_port, joined, run_launch

SCRIPT = os.path.join(os.path.dirname(__file__), "fsdp_grpo.py")
_run = functools.partial(run_launch, timeout=480, path=os.path.dirname(__file__))


def _two_processes(tmp_path, out, *args, **env):
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
          "--master_port", str(free_port()), SCRIPT, out, *args], tmp_path, **env)
    return [json.load(open(f"{out}.{rank}")) for rank in (0, 1)]


ALGORITHMS = ["grpo", "ppo"]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """Each algorithm's result from 1 plain process x 8 completions (GRPO: 2 prompts, PPO: 8) and from 2 FSDP2
    processes x 4 completions, with each rank's: both algorithms in one launch each (worker_jobs.py)."""
    pytest.importorskip("accelerate")
    folder = tmp_path_factory.mktemp("fsdp")
    _run([sys.executable, SCRIPT, *joined(*([folder / f"one_{a}.json", 8, "even", a] for a in ALGORITHMS))], folder)
    _two_processes(folder, *joined(*([folder / f"two_{a}.json", 4, "even", a] for a in ALGORITHMS)))
    return {a: [json.load(open(folder / f"{n}_{a}.json")) for n in ("one", "two")]
            + [[json.load(open(folder / f"two_{a}.json.{rank}")) for rank in (0, 1)]] for a in ALGORITHMS}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_two_sharded_processes_match_one(sharded_runs, algorithm):
    """PPO: the sharded module is the policy with its value head, and the sampler calls the policy alone
    (`loading.route_through_fsdp_root`); its weights include the value head's."""
    a, b, ranks = sharded_runs[algorithm]
    assert (a["processes"], b["processes"]) == (1, 2)
    assert all(r["sharded"] for r in ranks)
    assert ranks[0]["forwards"] == ranks[1]["forwards"] > 0
    assert b["reward"] == pytest.approx(a["reward"], abs=1e-6)  # the same completions were sampled
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    # one SGD step at lr 1: each weight moved by its gradient; FSDP2 reduce-scatters the gradients (another
    # summation order than one process), so the moves are equal up to float rounding
    moves = {name: a["weights"][name] - a["start"][name] for name in a["weights"]}
    assert any(name.startswith("v_head.") for name in moves) == (algorithm == "ppo")
    assert all(abs(m) > 1e-5 for m in moves.values()), moves  # every parameter moved, by more than the tolerance
    for name, move in moves.items():
        assert b["weights"][name] - b["start"][name] == pytest.approx(move, rel=1e-4, abs=1e-6), name


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,kernels", [("grpo", "kernels"), ("rloo", "torch ops")])
def test_ranks_that_stop_decoding_at_different_steps_keep_pace(tmp_path, algorithm, kernels):
    pytest.importorskip("accelerate")
    env = {"POSTTRAIN_NO_KERNELS": "1"} if kernels == "torch ops" else {}  # the decoding path without C kernels
    ranks = _two_processes(tmp_path, str(tmp_path / "uneven.json"), "4", "uneven", algorithm, **env)
    # rank 0's completions stop at their first token, rank 1's run to max_completion_length (6) ...
    assert [r["widths"] for r in ranks] == [[1], [6]]
    # ... and both ran the prefill and 5 one-token forwards, rank 0 discarding its last 5
    assert ranks[0]["forwards"] == ranks[1]["forwards"] == 6
