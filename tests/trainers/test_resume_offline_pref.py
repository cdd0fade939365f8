"""ORPO, CPO, TPO and PRM stopped after step 2 and resumed from checkpoint-2 end as the uninterrupted run:
same weights, same logged numbers, bit for bit on CPU. ORPO and PRM are also killed for real (SIGKILL)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from tests.helpers.preference import TINY, config_kwargs
from tests.helpers.resume import assert_resumes_identically, logged_numbers, run_fields, trained_state

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# name: (module, config, trainer, train data expression); the data is rebuilt in the killed process
RUNS = {
    "orpo": ("posttrain.trainers.orpo", "ORPOConfig", "ORPOTrainer", "zen('preference')"),
    "cpo": ("posttrain.trainers.cpo", "CPOConfig", "CPOTrainer", "zen('preference')"),
    "tpo": ("posttrain.trainers.tpo", "TPOConfig", "TPOTrainer", "task_preference_dataset('reverse', 'train', 24, "
                                                                 "reference=True)"),
    "prm": ("posttrain.trainers.prm", "PRMConfig", "PRMTrainer", "task_stepwise_dataset('add', 'train', 24)"),
}
IMPORTS = "from posttrain.tasks.builtin import zen, task_preference_dataset, task_stepwise_dataset"


def fields(run: dict) -> dict:
    return {**config_kwargs(run["output_dir"], per_device_train_batch_size=2, learning_rate=1e-3,
                            lr_scheduler_type="linear", seed=3), **run}


def maker(name):
    import importlib

    from posttrain.tasks import builtin

    module, config, trainer, data = RUNS[name]
    module = importlib.import_module(module)
    return lambda **run: getattr(module, trainer)(TINY, args=getattr(module, config)(**fields(run)),
                                                  train_dataset=eval(data, vars(builtin)))


@pytest.mark.parametrize("name", list(RUNS))
def test_resumes_identically(tmp_path, name):
    assert_resumes_identically(maker(name), tmp_path)


KILLED_RUN = textwrap.dedent("""
    import os
    import torch
    from transformers import TrainerCallback
    from {module} import {config}, {trainer}
    {imports}

    torch.set_num_threads(1)

    class Kill(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), 9)  # SIGKILL: no cleanup, no atexit, as a preempted job dies

    trainer = {trainer}("posttrain/tiny-qwen2", args={config}(**{fields}), train_dataset={data})
    trainer.add_callback(Kill())
    trainer.train()
""")


@pytest.mark.parametrize("name", ["orpo", "prm"])
def test_killed_by_sigkill_after_its_checkpoint_resumes_identically(tmp_path, name):
    make = maker(name)
    full = make(**run_fields(tmp_path / "full", 4, 2))
    full.train()
    expected_state, expected_logs = trained_state(full), logged_numbers(full, 2)

    module, config, trainer, data = RUNS[name]
    script = KILLED_RUN.format(module=module, config=config, trainer=trainer, imports=IMPORTS, data=data,
                               fields=repr(fields(run_fields(tmp_path / "killed", 4, 2))))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "killed")) == ["checkpoint-2"]

    resumed = make(**run_fields(tmp_path / "killed", 4, 2))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    state = trained_state(resumed)
    assert [k for k in state if not torch.equal(state[k], expected_state[k])] == []
    assert logged_numbers(resumed, 2) == expected_logs
