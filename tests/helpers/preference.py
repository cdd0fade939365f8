"""Helpers of the offline preference-trainer tests (reward, DPO, BCO, KTO)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TrainerCallback

TINY = "posttrain/tiny-qwen2"


def task_pairs(split: str = "train", size: int = 200):
    """`reverse` pairs: chosen = the right answer, rejected = one digit replaced by a letter."""
    from posttrain.tasks.builtin import task_preference_dataset

    return task_preference_dataset("reverse", split, size).remove_columns("answer")


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_all_changed(before: dict[str, torch.Tensor], model) -> None:
    after = dict(model.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    assert not unchanged, f"parameters left unchanged: {unchanged}"


def assert_finite_metrics(trainer, names) -> None:
    logged = [row for row in trainer.state.log_history if "loss" in row]
    assert logged, "nothing was logged"
    for row in logged:
        for name in names:
            if name in row:
                assert math.isfinite(row[name]), (name, row)
    seen = set().union(*logged)
    missing = [n for n in names if n not in seen]
    assert not missing, f"metrics never logged: {missing}"


def config_kwargs(tmp_path, **overrides) -> dict:
    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
                  logging_steps=1, disable_tqdm=True, lr_scheduler_type="constant", report_to="none",
                  dataloader_pin_memory=False)
    kwargs.update(overrides)
    return kwargs


class GradGrab(TrainerCallback):
    """Copies every gradient just before the optimizer step."""

    def __init__(self):
        self.model, self.grads = None, {}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}


def one_step(make_trainer, batch_size: int, accumulation: int):
    """(logged loss, gradients) of one optimizer step over the same 8 rows, split batch_size x accumulation."""
    grab = GradGrab()
    trainer = make_trainer(per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
                           max_steps=1, max_grad_norm=0.0, learning_rate=0.0)
    grab.model = trainer.model
    trainer.add_callback(grab)
    trainer.train()
    return trainer.state.log_history[0]["loss"], grab.grads


def assert_split_invariant(make_trainer) -> None:
    """Batch 8 x accumulation 1 == 4 x 2 == 2 x 4: same loss, same gradients."""
    loss8, grads8 = one_step(make_trainer, 8, 1)
    assert grads8 and all(g.abs().sum() > 0 for g in grads8.values())
    for bs, ga in ((4, 2), (2, 4)):
        loss, grads = one_step(make_trainer, bs, ga)
        assert loss == pytest.approx(loss8, rel=1e-5, abs=1e-6), (bs, ga)
        for name, g in grads8.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=f"{name} at {bs}x{ga}")
