"""Every checkpoint ends with a manifest (each file's size and sha256, the model and the run's settings), checked
before resuming: a damaged, truncated or missing file is named with the newest intact checkpoint, another model's
checkpoint is refused, and settings that changed are said."""

import json
import logging
import os
import shutil

import pytest
from tests.helpers.preference import TINY, config_kwargs

from posttrain.tasks.builtin import zen
from posttrain.trainers.guards import MANIFEST_FILE, STATE_FILE, CheckpointError
from posttrain.trainers.sft import SFTConfig, SFTTrainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def sft(output_dir, model=TINY, rows=None, **overrides) -> SFTTrainer:
    fields = config_kwargs(output_dir, per_device_train_batch_size=2, learning_rate=1e-3, save_strategy="steps",
                           save_steps=1, max_steps=2)
    data = zen() if rows is None else zen().select(range(rows))
    return SFTTrainer(model, args=SFTConfig(**{**fields, **overrides}), train_dataset=data)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    sft(folder).train()
    return folder


@pytest.fixture
def run(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run"


def test_the_manifest_lists_every_file_with_size_and_checksum(saved):
    manifest = json.loads((saved / "checkpoint-2" / MANIFEST_FILE).read_text())
    files = manifest["files"]
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", STATE_FILE, "trainer_state.json"):
        assert files[name]["size"] == os.path.getsize(saved / "checkpoint-2" / name) and len(files[name]["sha256"]) == 64
    assert manifest["run"]["settings"]["gradient_accumulation_steps"] == 1
    assert manifest["run"]["model"]["name"] == TINY


@pytest.mark.parametrize("damage, message", [
    (lambda c: open(c / "optimizer.pt", "r+b").truncate(100), r"optimizer.pt has 100 bytes where \d+ were written"),
    (lambda c: os.remove(c / "optimizer.pt"), "optimizer.pt is missing"),
    (lambda c: os.remove(c / STATE_FILE), f"{STATE_FILE} is missing"),
    (lambda c: (c / "scheduler.pt").write_bytes(b"garbage"), "scheduler.pt has 7 bytes"),
    (lambda c: open(c / "trainer_state.json", "r+b").truncate(50), "trainer_state.json has 50 bytes"),
])
def test_a_damaged_file_is_named_with_the_newest_intact_checkpoint(run, damage, message):
    damage(run / "checkpoint-2")
    with pytest.raises(CheckpointError, match=rf"cannot resume from .*checkpoint-2: {message}.*The newest intact "
                                              rf"checkpoint is .*checkpoint-1"):
        sft(run, max_steps=3).train(resume_from_checkpoint=True)


def test_flipped_bytes_inside_the_weights_are_found(run):
    path = run / "checkpoint-2" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the last tensor: safetensors itself would load it without a word
    path.write_bytes(bytes(data))
    (run / "checkpoint-1" / "optimizer.pt").write_bytes(b"")  # the older one is damaged too
    with pytest.raises(CheckpointError, match="model.safetensors differs from what was written .*No intact "
                                              "checkpoint is left"):
        sft(run, max_steps=3).train(resume_from_checkpoint=str(run / "checkpoint-2"))


def test_another_models_checkpoint_is_refused_by_name(run):
    with pytest.raises(CheckpointError, match="belongs to another model .*tiny-qwen2.* than this run's "
                                              ".*tiny-llama"):
        sft(run, model="posttrain/tiny-llama", max_steps=3).train(resume_from_checkpoint=True)


def test_changed_settings_are_said(run, caplog):
    trainer = sft(run, max_steps=3, gradient_accumulation_steps=2, learning_rate=2e-3, rows=10)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        trainer.train(resume_from_checkpoint=True)
    assert "settings that differ" in caplog.text and "gradient_accumulation_steps: 1 -> 2" in caplog.text
    assert f"train_dataset rows: {len(zen())} -> 10" in caplog.text
    assert "learning_rate: 0.001 -> 0.002" in caplog.text and "max_steps" not in caplog.text
    assert trainer.state.global_step == 3


def test_an_intact_resume_says_nothing(run, caplog):
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        sft(run, max_steps=3).train(resume_from_checkpoint=True)
    assert "differ" not in caplog.text and "missing" not in caplog.text


def test_tied_embeddings_raise_no_missing_keys_alarm(run, caplog):
    trainer = sft(run, max_steps=3)
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight  # tied: saved once
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=True)
    assert "missing keys" not in caplog.text
