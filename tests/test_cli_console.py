"""The installed `posttrain` console script, run as a user runs it: exit status, and resuming a run."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

POSTTRAIN = os.path.join(os.path.dirname(sys.executable), "posttrain")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
SFT = ["sft", "--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "reverse", "--max_steps", "4",
       "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1", "--seed", "0",
       "--learning_rate", "1e-3", "--disable_tqdm", "true", "--report_to", "none"]


def posttrain(*argv, cwd):
    return subprocess.run([POSTTRAIN, *argv], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=300)


def logged_losses(stdout: str) -> list[str]:
    """The per-step losses the trainer printed (one dict per logging step)."""
    return [line for line in stdout.splitlines() if line.startswith("{'loss'")]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """An uninterrupted 4-step SFT run that saves checkpoint-2 and checkpoint-4."""
    out = tmp_path_factory.mktemp("full")
    result = posttrain(*SFT, "--output_dir", str(out), cwd=out)
    return out, result


def weights(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def test_a_successful_run_exits_0_and_prints_no_trainer(full_run):
    out, result = full_run
    assert result.returncode == 0, result.stderr[-2000:]
    assert "object at 0x" not in result.stderr
    assert len(logged_losses(result.stdout)) == 4
    assert os.path.exists(out / "model.safetensors") and os.path.isdir(out / "checkpoint-2")


def test_a_failed_run_exits_non_zero(tmp_path):
    result = posttrain("sft", "--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "reverse",
                       "--max_steps", "x", cwd=tmp_path)
    assert result.returncode == 2 and "invalid int value: 'x'" in result.stderr


@pytest.mark.parametrize("resume", ["true", "path"])
def test_resume_from_checkpoint_continues_the_run(full_run, tmp_path, resume):
    """Resumed from checkpoint-2 of a copy, the run trains steps 3-4 only and ends bit-identical to the
    uninterrupted run; the checkpoint it resumed from is left as it was."""
    full, _ = full_run
    shutil.copytree(full / "checkpoint-2", tmp_path / "checkpoint-2")
    state_before = (tmp_path / "checkpoint-2" / "trainer_state.json").read_bytes()
    target = "true" if resume == "true" else str(tmp_path / "checkpoint-2")
    result = posttrain(*SFT, "--output_dir", str(tmp_path), "--resume_from_checkpoint", target, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]

    full_history = json.loads((full / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    resumed_history = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    printed = logged_losses(result.stdout)
    assert len(printed) == 2  # steps 3 and 4; a restart from step 1 prints 4
    assert [h for h in resumed_history if "loss" in h] == [h for h in full_history if "loss" in h]
    resumed, expected = weights(tmp_path), weights(full)
    assert resumed.keys() == expected.keys()
    assert all(torch.equal(resumed[k], expected[k]) for k in expected)
    assert (tmp_path / "checkpoint-2" / "trainer_state.json").read_bytes() == state_before


def test_a_finished_run_says_where_it_saved_the_model(full_run):
    out, result = full_run
    assert f"posttrain sft: model saved to {out}" in result.stdout
