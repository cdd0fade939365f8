"""A run never trains on or saves NaN/infinite gradients or weights, holds its output_dir against a second run,
and never writes the hub token to disk."""

import copy
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from tests.helpers.preference import TINY, config_kwargs

from posttrain import cli
from posttrain.tasks.builtin import zen
from posttrain.trainers.guards import NonFiniteError, OutputDirInUseError, output_dir_lock
from posttrain.trainers.sft import SFTConfig, SFTTrainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def sft(output_dir, optimizers=(None, None), **overrides) -> SFTTrainer:
    fields = config_kwargs(output_dir, per_device_train_batch_size=2, learning_rate=1e-3, save_strategy="steps",
                           save_steps=1, max_steps=3)
    return SFTTrainer(TINY, args=SFTConfig(**{**fields, **overrides}), train_dataset=zen(), optimizers=optimizers)


def all_finite(trainer) -> bool:
    return all(torch.isfinite(p).all() for p in trainer.model.parameters())


# ------------------------------------------------------------------ non-finite gradients and weights

def test_a_nan_gradient_stops_the_run_before_the_optimizer_step(tmp_path):
    trainer = sft(tmp_path)
    weight = dict(trainer.model.named_parameters())["model.norm.weight"]
    calls = []

    def poison(grad):  # the second step's gradient is NaN (as after an overflowing loss); the norm, then
        # transformers' clipping by it, spreads the NaN to every gradient
        calls.append(1)
        return grad * float("nan") if len(calls) == 2 else grad

    weight.register_hook(poison)
    with pytest.raises(NonFiniteError, match=r"step 2: the gradient of model\.\S+ is NaN or infinite.*"
                                             r"newest checkpoint, .*checkpoint-1, holds weights from before it"):
        trainer.train()
    assert all_finite(trainer) and trainer.state.global_step == 1
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint")) == ["checkpoint-1"]


def test_weights_that_overflow_in_the_optimizer_step_stop_the_run_unsaved(tmp_path):
    trainer = sft(tmp_path, save_steps=10)
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    class Overflowing(torch.optim.SGD):  # a user optimizer whose update overflows float32
        @torch.no_grad()
        def step(self, closure=None):
            super().step(closure)
            params[-1].mul_(1e30).mul_(1e30)

    trainer.optimizer = Overflowing(params, lr=1e-3)
    trainer.create_optimizer = lambda *a, **k: trainer.optimizer
    with pytest.raises(NonFiniteError, match="step 1: after the optimizer step, .* holds NaN or infinite values.*"
                                             "No checkpoint was saved"):
        trainer.train()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("checkpoint") or n.endswith(".safetensors")]


# ------------------------------------------------------------------ the output_dir lock

def lock_from_another_process(folder) -> str:
    """What another process trying to lock `folder` reports: "locked", or the refusal."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from posttrain.trainers.dir_lock import output_dir_lock, OutputDirInUseError
        try:
            with output_dir_lock({str(folder)!r}):
                print("locked")
        except OutputDirInUseError as err:
            print(err)
        """)], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    return done.stdout.strip()


def test_a_second_run_into_a_locked_output_dir_is_refused(tmp_path):
    first = sft(tmp_path, max_steps=1)
    with output_dir_lock(str(tmp_path)):  # what the first run holds while it trains
        refused = lock_from_another_process(tmp_path)
        assert "is in use by another run (pid " in refused and f"pid {os.getpid()})" in refused
        first.train()  # the same process may nest (the CLI holds the lock around train and save_model)
        assert "is in use by another run" in lock_from_another_process(tmp_path)
    assert lock_from_another_process(tmp_path) == "locked"  # let go when the run ends
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]  # no lock file: the lock is on the folder itself


def test_the_lock_of_a_killed_run_is_not_stale(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from posttrain.trainers.dir_lock import output_dir_lock
        with output_dir_lock({str(tmp_path)!r}):
            print("locked", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(OutputDirInUseError, match=rf"\(pid {holder.pid}\)"):
        sft(tmp_path, max_steps=1).train()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert os.listdir(tmp_path) == []  # nothing written: the lock is on the folder itself
    sft(tmp_path, max_steps=1, overwrite_output_dir=True).train()


def test_the_cli_says_in_one_line_that_output_dir_is_in_use(tmp_path, capsys):
    argv = ["sft", "--model_name_or_path", TINY, "--dataset_name", "zen", "--output_dir", str(tmp_path),
            "--max_steps", "1", "--per_device_train_batch_size", "2", "--disable_tqdm", "true"]
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from posttrain.trainers.dir_lock import output_dir_lock
        with output_dir_lock({str(tmp_path)!r}):
            print("locked", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert "is in use by another run" in err and "Traceback" not in err
        assert not os.path.exists(tmp_path / "model.safetensors")
    finally:
        holder.kill()
        holder.wait()


# ------------------------------------------------------------------ secrets

def test_the_hub_token_is_never_written_to_disk(tmp_path):
    secret = "hf_NotARealTokenButSecret123"
    trainer = sft(tmp_path, max_steps=1, hub_token=secret)
    trainer.train()
    trainer.save_model()
    written = [os.path.join(root, name) for root, _, names in os.walk(tmp_path) for name in names]
    assert any(p.endswith("training_args.bin") for p in written)
    for path in written:
        with open(path, "rb") as f:
            assert secret.encode() not in f.read(), path
    assert trainer.args.hub_token == secret  # the live config keeps it, for push_to_hub
    assert copy.deepcopy(trainer.args).hub_token == secret and copy.copy(trainer.args).hub_token == secret
    assert pickle.loads(pickle.dumps(trainer.args)).hub_token is None


# ------------------------------------------------------------------ a full disk

def test_a_full_disk_while_writing_the_optimizer_is_said_with_the_path(tmp_path, monkeypatch):
    from collections import namedtuple

    import transformers.trainer

    from posttrain.trainers import guards as base

    real_save = torch.save

    def full_disk_save(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            with open(path, "wb") as f:  # what a write that ran out of room leaves
                f.write(b"\0" * 100)
            raise RuntimeError("basic_ios::clear: iostream error")
        return real_save(obj, path, *args, **kwargs)

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(transformers.trainer.torch, "save", full_disk_save)
    monkeypatch.setattr(base.shutil, "disk_usage", lambda path: usage(10 * 2**30, 10 * 2**30 - 2**20, 2**20))
    trainer = sft(tmp_path, max_steps=1)
    with pytest.raises(base.SaveError, match=r"the disk is full while writing .*tmp-checkpoint-1/checkpoint-1/"
                                             r"optimizer.pt \(1 MiB free on that disk\)"):
        trainer.train()
    assert not os.path.exists(tmp_path / "checkpoint-1")

