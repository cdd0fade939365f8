"""What the distillation trainers skip recomputing: the student's linear outputs that the sampler already made
(`accel/replay.py`), with the same losses and updates as the full forward up to float rounding."""

import pytest
import torch
from tests.helpers.online import online_args

from posttrain.accel import replay as replay_module
from posttrain.tasks.builtin import task_dataset
from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer


def run(tmp_path, monkeypatch, replay: bool, **fields):
    """Two steps of on-policy distillation (student tiny-qwen2, teacher tiny-llama); (losses, weights, forwards that
    took the record)."""
    used = []
    inner = replay_module.replaying

    def counted(record, layout, last=False):
        used.append(record)
        return inner(record, layout, last)

    monkeypatch.setattr(replay_module, "replaying", counted)
    monkeypatch.setattr("posttrain.forward.completions.replaying", counted)
    args = DistillationConfig(**{**online_args(tmp_path / str(replay)), "gradient_accumulation_steps": 1,
                                 "lmbda": 1.0, "loss_top_k": 0, "beta": 0.5, "replay_linear_outputs": replay,
                                 "seed": 3, "optim": "sgd", "learning_rate": 0.1, **fields})
    trainer = DistillationTrainer("posttrain/tiny-qwen2", teacher_model="posttrain/tiny-llama", args=args,
                                  train_dataset=task_dataset("reverse", "train", size=16))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, len(used)


@pytest.mark.parametrize("num_generations", [1, 2])
def test_student_forward_takes_the_samplers_record_and_trains_as_without_it(tmp_path, monkeypatch, num_generations):
    """On-policy batches: the student's forward reads its linear outputs from the sampler's record (one record per
    step, each micro-batch's forward), packed by prompt with num_generations=2; the teacher's forward never does.
    Losses and trained weights equal those of the run that recomputes them, to float32 rounding (plain SGD: Adam's
    first steps would turn rounding-sized gradients into whole learning-rate steps)."""
    fields = {"num_generations": num_generations, "per_device_train_batch_size": 4}
    with_record = run(tmp_path, monkeypatch, True, **fields)
    without = run(tmp_path, monkeypatch, False, **fields)
    assert with_record[2] == 2 and without[2] == 0  # 2 steps x 1 micro-batch, the student's forwards only
    assert with_record[0] == pytest.approx(without[0], rel=1e-4, abs=1e-6)
    for name, weight in without[1].items():
        torch.testing.assert_close(with_record[1][name], weight, rtol=1e-4, atol=1e-6, msg=name)
