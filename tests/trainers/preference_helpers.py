"""Helpers of the offline preference-trainer tests (reward, DPO, BCO, KTO); a plain module, see conftest.py."""

from __future__ import annotations

import math
import random
import string

import pytest
import torch
from transformers import TrainerCallback

TINY = "posttrain/tiny-qwen2"


def corrupt(answer: str, rng: random.Random, how: str) -> str:
    """A wrong answer: one digit replaced by a letter ("letter"), or one digit dropped ("drop").

    The letter never replaces the first digit: " 1a74" tokenises as " ", "1", "a", "7", "4", like the
    right answer, but " a274" merges " a" into one token, and a shorter rejected answer would be
    favoured by its length alone."""
    if how == "letter":
        i = rng.randrange(1, len(answer))
        return answer[:i] + rng.choice(string.ascii_lowercase) + answer[i + 1:]
    if how == "drop":
        i = rng.randrange(len(answer))
        return answer[:i] + answer[i + 1:]
    raise ValueError(how)


def task_pairs(split: str = "train", size: int = 200, how: str = "letter", unpaired: bool = False):
    """Preference pairs from the built-in `reverse` task: chosen = the right answer, rejected = a corrupted
    one (held-out prompts for split="test"). With `unpaired`, one row per prompt, alternately labelled."""
    from datasets import Dataset

    from posttrain.data.builtin import task_dataset

    rng = random.Random(f"{split}-{how}")
    rows = []
    for i, row in enumerate(task_dataset("reverse", split, size)):
        good, bad = " " + row["answer"], " " + corrupt(row["answer"], rng, how)
        if unpaired:
            rows.append({"prompt": row["prompt"], "completion": good if i % 2 == 0 else bad, "label": i % 2 == 0})
        else:
            rows.append({"prompt": row["prompt"], "chosen": good, "rejected": bad})
    return Dataset.from_list(rows)


@torch.no_grad()
def preference_rate(model, tokenizer, pairs) -> float:
    """Fraction of pairs with log π(chosen|x) > log π(rejected|x)."""
    from posttrain.trainers.preference_base import PreferenceCollator, completion_logps, prepare_preference_dataset

    data = prepare_preference_dataset(pairs, tokenizer, paired=True, max_length=None, name="held-out")
    batch = PreferenceCollator(tokenizer.pad_token_id)([data[i] for i in range(len(data))])
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    logps = completion_logps(model, *(batch[k].to(device) for k in ("input_ids", "attention_mask", "completion_mask")))[0]
    model.train(was_training)
    n = len(data)
    return (logps[:n] > logps[n:]).float().mean().item()


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
