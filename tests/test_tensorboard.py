"""report_to="tensorboard" with a posttrain config: the event files hold the logged scalars, finite.

transformers 5 has no `logging_dir` argument; the TensorBoard folder is `$TENSORBOARD_LOGGING_DIR`
(else `<output_dir>/runs/<date>_<host>`).
"""

import glob
import math

import pytest

pytest.importorskip("tensorboard")


def test_tensorboard_event_files_hold_finite_scalars(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from posttrain import SFTConfig, SFTTrainer
    from posttrain.tasks.builtin import task_dataset

    logdir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))
    args = SFTConfig(output_dir=str(tmp_path / "out"), report_to="tensorboard", max_steps=4,
                     per_device_train_batch_size=4, logging_steps=1, learning_rate=1e-3, use_cpu=True)
    trainer = SFTTrainer("posttrain/tiny-qwen2", args, train_dataset=task_dataset("reverse", size=16))
    trainer.train()

    assert glob.glob(str(logdir / "events.out.tfevents.*")), f"no event file under {logdir}"
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    # transformers' own scalars and the ones posttrain's trainer buffers through `record`
    for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "train/mean_token_accuracy",
                "train/entropy", "train/num_tokens"):
        assert tag in tags, f"{tag} missing from {tags}"
        values = [e.value for e in acc.Scalars(tag)]
        assert len(values) >= 4 and all(math.isfinite(v) for v in values), (tag, values)
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    accuracy = [e.value for e in acc.Scalars("train/mean_token_accuracy")]
    assert all(0.0 <= v <= 1.0 for v in accuracy)
    tokens = [e.value for e in acc.Scalars("train/num_tokens")]
    assert tokens == sorted(tokens) and tokens[0] > 0  # cumulative
