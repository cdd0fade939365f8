"""DeepSpeed ZeRO-2 and ZeRO-3 (the shipped accelerate configs) on 2 CPU processes (gloo) against a plain
process with the same global batch: SFT, DPO, GRPO with beta > 0 (a reference model), distillation (a teacher)
and PPO (a critic trained
with the policy, a reference, and a reward model).

Skipped when deepspeed is not installed (`pip install 'posttrain[deepspeed]'`; on a machine without CUDA
`DS_BUILD_OPS=0 pip install deepspeed`); CI installs it (.ci/run). Marked slow: the three launches
(one plain process, ZeRO-2, ZeRO-3; each runs its trainers one after the other) take about 2 minutes on a
2-core machine.
"""

import functools
import json
import os
import sys

import pytest
from tests.helpers.launch import free_port, run_launch

SCRIPT = os.path.join(os.path.dirname(__file__), "deepspeed_run.py")
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "posttrain", "accelerate_configs")
_run = functools.partial(run_launch, timeout=600, path=os.path.dirname(__file__))


# GRPO with a reward model loaded by name (partitioned under ZeRO-3); DPO whose reference moves towards the policy
# after every step (sync_ref_model); distillation: the teacher (loaded by name) partitioned as a reference; PPO: a
# value head on the policy; a separate value model and a reward model by name
CASES = {2: ("sft", "dpo", "grpo", "ppo_critic"),
         3: ("sft", "dpo", "grpo", "grpo_rm", "dpo_sync", "distillation", "ppo", "ppo_critic")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each launch's results by algorithm: the plain one-process run ("plain", shared by both stages) and each
    ZeRO stage's 2-process run, every trainer of a launch run one after the other in its processes."""
    done = {}

    def run(launch):
        if launch not in done:
            folder = tmp_path_factory.mktemp(f"ds_{launch}")
            names = sorted(set().union(*CASES.values())) if launch == "plain" else CASES[launch]
            if launch == "plain":
                _run([sys.executable, SCRIPT, str(folder), ",".join(names), "1"], folder)
            else:
                _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                      os.path.join(CONFIGS, f"deepspeed_zero{launch}.yaml"), "--num_processes", "2",
                      "--main_process_port", str(free_port()), SCRIPT, str(folder), ",".join(names), "2"], folder)
            done[launch] = {name: json.load(open(folder / f"{name}.json")) for name in names}
        return done[launch]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,stage", [(a, stage) for stage, names in CASES.items() for a in names])
def test_two_zero_processes_match_one_plain_process(runs, algorithm, stage):
    pytest.importorskip("deepspeed")
    zero, plain = runs(stage)[algorithm], runs("plain")[algorithm]
    assert (zero["engine"], zero["processes"], plain["engine"], plain["processes"]) == ("DEEPSPEED", 2, "NO", 1)
    assert zero["policy_partitioned"] == (stage == 3) and not plain["policy_partitioned"]
    # ZeRO-3 partitions the reference (DPO, GRPO with beta > 0) like the policy; ZeRO-2 keeps whole weights
    assert zero["ref_partitioned"] == (stage == 3 and algorithm != "sft")
    assert zero["critic_partitioned"] == (stage == 3 and algorithm.startswith("ppo"))  # trained with the policy
    if algorithm == "dpo_sync":  # the synced reference changed the second loss
        assert plain["loss"][1] != pytest.approx(runs("plain")["dpo"]["loss"][1], rel=1e-4)
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
