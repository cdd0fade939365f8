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

    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.trainers.base import BaseConfig, BaseTrainer

    class ProbeTrainer(BaseTrainer):
        """Also buffers a metric of its own through `record`, like every posttrain trainer does."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.record({"probe/loss_x2": 2 * loss.detach()})
            return loss

    logdir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))
    tok = load_tokenizer(None, model="posttrain/tiny-qwen2")
    ids = tok(["reverse 1234 = 4321"] * 12)["input_ids"]
    data = [{"input_ids": i, "labels": i} for i in ids]
    args = BaseConfig(output_dir=str(tmp_path / "out"), report_to="tensorboard", max_steps=4,
                      per_device_train_batch_size=4, logging_steps=1, learning_rate=1e-3, use_cpu=True)
    trainer = ProbeTrainer(load_causal_lm("posttrain/tiny-qwen2"), args, processing_class=tok, train_dataset=data)
    trainer.train()

    files = glob.glob(str(logdir / "events.out.tfevents.*"))
    assert files, f"no event file under {logdir}"
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("train/loss", "train/probe/loss_x2", "train/learning_rate", "train/grad_norm"):
        assert tag in tags, f"{tag} missing from {tags}"
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in losses)
    doubled = [e.value for e in acc.Scalars("train/probe/loss_x2")]
    assert doubled == pytest.approx([2 * v for v in losses], rel=1e-4)
