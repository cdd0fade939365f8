"""DeepSpeed ZeRO-2 and ZeRO-3 (the shipped accelerate configs) on 2 CPU processes (gloo) against a plain
process with the same global batch: SFT, DPO, GRPO with beta > 0 (a reference model), distillation (a teacher)
and PPO (a critic trained
with the policy, a reference, and a reward model).

Skipped when deepspeed is not installed (`pip install 'posttrain[deepspeed]'`; on a machine without CUDA
`DS_BUILD_OPS=0 pip install deepspeed`); CI installs it (.ci/run). Marked slow: each
launch takes 20-60 s on a 2-core machine.
"""

import functools
import json
import os
import sys

import pytest
from tests.helpers.launch import free_port, run_launch

SCRIPT = os.path.join(os.path.dirname(__file__), "deepspeed_run.py")
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "posttrain", "accelerate_configs")
_run = functools.partial(run_launch, timeout=300, path=os.path.dirname(__file__))


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    """The plain one-process run of each trainer, shared by both ZeRO stages."""
    folder, runs = tmp_path_factory.mktemp("plain"), {}

    def run(algorithm):
        if algorithm not in runs:
            out = str(folder / f"{algorithm}.json")
            _run([sys.executable, SCRIPT, out, algorithm, "1"], folder)
            runs[algorithm] = json.load(open(out))
        return runs[algorithm]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,stage", [(a, stage) for stage in (2, 3) for a in ("sft", "dpo", "grpo")]
                         # GRPO with a reward model loaded by name (partitioned under ZeRO-3); DPO whose
                         # reference moves towards the policy after every step (sync_ref_model)
                         + [("grpo_rm", 3), ("dpo_sync", 3)]
                         # distillation: the teacher (loaded by name) partitioned as a reference
                         + [("distillation", 3)]
                         # PPO: a value head on the policy; a separate value model and a reward model by name
                         + [("ppo", 3), ("ppo_critic", 2), ("ppo_critic", 3)])
def test_two_zero_processes_match_one_plain_process(tmp_path, plain_runs, algorithm, stage):
    pytest.importorskip("deepspeed")
    out = str(tmp_path / "zero.json")
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
          os.path.join(CONFIGS, f"deepspeed_zero{stage}.yaml"), "--num_processes", "2",
          "--main_process_port", str(free_port()), SCRIPT, out, algorithm, "2"], tmp_path)
    zero, plain = json.load(open(out)), plain_runs(algorithm)
    assert (zero["engine"], zero["processes"], plain["engine"], plain["processes"]) == ("DEEPSPEED", 2, "NO", 1)
    assert zero["policy_partitioned"] == (stage == 3) and not plain["policy_partitioned"]
    # ZeRO-3 partitions the reference (DPO, GRPO with beta > 0) like the policy; ZeRO-2 keeps whole weights
    assert zero["ref_partitioned"] == (stage == 3 and algorithm != "sft")
    assert zero["critic_partitioned"] == (stage == 3 and algorithm.startswith("ppo"))  # trained with the policy
    if algorithm == "dpo_sync":  # the synced reference changed the second loss
        assert plain["loss"][1] != pytest.approx(plain_runs("dpo")["loss"][1], rel=1e-4)
    assert zero["reward_models_partitioned"] == ([stage == 3] if algorithm in ("grpo_rm", "ppo_critic") else [])
    if algorithm.startswith("dpo"):
        assert plain["loss"][0] == pytest.approx(0.693147, abs=1e-5)  # policy == reference at the first step
    if algorithm.startswith(("grpo", "ppo")):
        assert plain["kl"][0] == pytest.approx(0.0, abs=1e-5) and abs(plain["kl"][1]) > 1e-3
    assert len(zero["loss"]) == len(plain["loss"]) == 2
    # both steps: the second one shows the first update was the same (SGD: the update is the gradient itself)
    assert zero["loss"] == pytest.approx(plain["loss"], rel=1e-4, abs=1e-6)
    assert zero["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4, abs=1e-6)
    if algorithm.startswith(("grpo", "ppo")):  # the same completions, and the reference scores them as in the plain run
        assert zero["reward"] == pytest.approx(plain["reward"], abs=1e-6)
        assert zero["kl"] == pytest.approx(plain["kl"], rel=1e-3, abs=1e-6)
    if algorithm.startswith("ppo"):  # every weight of the policy and the critic moved as in the plain run
        critic = "v_head." if algorithm == "ppo" else "value_model."
        assert set(zero["moves"]) == set(plain["moves"]) and any(name.startswith(critic) for name in plain["moves"])
        for name, (total, norm) in plain["moves"].items():
            assert norm > 0, name
            # the sum of a move can nearly cancel: its tolerance is a part of the move's size
            assert zero["moves"][name] == pytest.approx([total, norm], rel=1e-3, abs=1e-3 * norm), name
