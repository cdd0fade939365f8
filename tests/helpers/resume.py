"""Kill-or-stop-and-resume checks shared by the trainer tests.

A run stopped after step k and resumed from `checkpoint-k` must end with the same weights and log the
same numbers as the run that was never interrupted: bit-identical on CPU.
"""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback


class StopAfter(TrainerCallback):
    """Stop training at the end of step `step` (after its checkpoint is written), as a kill would."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def run_fields(output_dir, max_steps: int, stop_at: int) -> dict:
    """Config fields of a resumable run: a checkpoint every `stop_at` steps, a log line every step."""
    return {"output_dir": str(output_dir), "max_steps": max_steps, "save_strategy": "steps", "save_steps": stop_at,
            "logging_steps": 1, "report_to": "none", "disable_tqdm": True}


def trained_state(trainer) -> dict[str, torch.Tensor]:
    """Every tensor that training changes: the model's and, when the trainer has them, the value model's
    and a reference model's that moves (sync_ref_model)."""
    state = {f"model.{k}": v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}
    for name in ("value_model", "ref_model"):
        extra = getattr(trainer, name, None)
        if isinstance(extra, torch.nn.Module):
            state.update({f"{name}.{k}": v.detach().clone() for k, v in extra.state_dict().items()})
    return state


def logged_numbers(trainer, after_step: int) -> list[tuple[int, str, float]]:
    """(step, key, value) of every number logged after `after_step`, run timings left out."""
    skip = ("runtime", "per_second", "total_flos", "train_loss")
    timings = {"eps", "rollout/wait_time", "teacher/request_time"}  # the online trainers' episodes per second, waits
    # for the background sampler, teacher servers' answer times
    rows = []
    for entry in trainer.state.log_history:
        step = entry.get("step", 0)
        if step <= after_step:
            continue
        for key, value in entry.items():
            if (key != "step" and key not in timings and isinstance(value, (int, float))
                    and not any(s in key for s in skip)):
                rows.append((step, key, value))
    return rows


def assert_resumes_identically(make_trainer, tmp_path, *, max_steps: int = 4, stop_at: int = 2):
    """`make_trainer(**fields)` builds a fresh trainer whose config takes `fields` (see `run_fields`).

    Trains once straight through, once stopped after `stop_at` steps and resumed from its checkpoint
    in a new trainer; asserts equal final tensors and equal logged numbers after the stop.
    """
    full = make_trainer(**run_fields(tmp_path / "full", max_steps, stop_at))
    full.train()
    expected_state, expected_logs = trained_state(full), logged_numbers(full, stop_at)
    del full

    stopped = make_trainer(**run_fields(tmp_path / "stopped", max_steps, stop_at))
    stopped.add_callback(StopAfter(stop_at))
    stopped.train()
    assert stopped.state.global_step == stop_at
    del stopped
    checkpoint = os.path.join(tmp_path, "stopped", f"checkpoint-{stop_at}")
    assert os.path.isdir(checkpoint)

    resumed = make_trainer(**run_fields(tmp_path / "stopped", max_steps, stop_at))
    resumed.train(resume_from_checkpoint=checkpoint)
    assert_same_run(resumed, expected_state, expected_logs, max_steps=max_steps, stop_at=stop_at)
    return resumed


def assert_same_run(resumed, expected_state: dict, expected_logs: list, *, max_steps: int, stop_at: int):
    """`resumed` (resumed from checkpoint-`stop_at`) ended as the uninterrupted run: the same tensors
    (`trained_state`) and the same numbers logged after the stop (`logged_numbers`)."""
    assert resumed.state.global_step == max_steps
    state, logs = trained_state(resumed), logged_numbers(resumed, stop_at)
    assert sorted(state) == sorted(expected_state)
    different = [k for k in state if not torch.equal(state[k], expected_state[k])]
    assert not different, f"tensors that differ after resuming: {different[:8]}"
    assert [(s, k) for s, k, _ in logs] == [(s, k) for s, k, _ in expected_logs]
    mismatched = [(s, k, a, b) for (s, k, a), (_, _, b) in zip(logs, expected_logs)
                  if not (a == b or (math.isnan(a) and math.isnan(b)))]
    assert not mismatched, f"logged numbers that differ after resuming (step, key, resumed, uninterrupted): {mismatched[:8]}"


KILLED_AT_SAVE = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {root!r}]
import torch
torch.set_num_threads({threads})
from transformers import TrainerCallback
from tests.helpers.resume import run_fields
{imports}


class KillOnSave(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == {step}:
            os.kill(os.getpid(), signal.SIGKILL)


trainer = {build}
trainer.add_callback(KillOnSave())
trainer.train()
"""


def killed_at_save(tmp_path, tests_dir: str, imports: str, build: str, step: int = 2) -> Path:
    """Run `build` (an expression that may use `output_dir` and the names `imports` brings from the test module in
    `tests_dir`) in a child process that SIGKILLs itself right after writing checkpoint-`step`; assert it died so
    with that checkpoint complete, and return its output_dir to resume from."""
    root = str(Path(__file__).resolve().parents[2])
    output_dir = tmp_path / "killed"
    script = tmp_path / "killed_run.py"
    script.write_text(KILLED_AT_SAVE.format(tests=tests_dir, root=root, threads=torch.get_num_threads(), step=step,
                                            imports=imports, build=build.replace("output_dir", repr(str(output_dir)))))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    state = json.loads((output_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
    assert state["global_step"] == step
    return output_dir
