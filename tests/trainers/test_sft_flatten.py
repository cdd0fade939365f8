"""SFT's per-batch flattening (padding_free=None under sdpa/eager): the cost rule by hand, which batches
become one flat row, and the loss, gradients and metrics of a flattened batch against the padded batch
and an independent float64 reference (each sequence alone); text, prompt-completion and assistant-only
data; training and evaluation runs; models that do not read restarting position_ids."""

import warnings

import pytest
import torch
from datasets import Dataset

from posttrain.models.loading import load_causal_lm
from posttrain.tasks.builtin import task_dataset, zen
from posttrain.trainers.sft import SFTConfig, SFTTrainer, flat_is_cheaper, rows_kept_apart

MODEL = "posttrain/tiny-qwen2"  # hidden 64, sdpa

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, disable_tqdm=True, seed=0, dataloader_pin_memory=False, report_to=[])
    return SFTConfig(**{**base, **kw})


def rows_of(trainer, indices):
    return [trainer.train_dataset[i] for i in indices]


def model_inputs(model):
    """A list that receives the keyword inputs of every forward of `model` (input_ids, position_ids, ...)."""
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    return seen


# ------------------------------------------------------------------ the rule, by hand


def test_flat_is_cheaper_by_hand():
    # hidden 576 (SmolLM2-135M), 4 * hidden = 2304; padded 4 x 256: 1024 * (1 + 256 / 2304) = 1137.8
    assert flat_is_cheaper([173, 256, 39, 256], 256, 576)  # 724 * (1 + 724 / 2304) = 951.5
    assert flat_is_cheaper([256, 256, 70, 188], 256, 576)  # 770 * 1.3342 = 1027.3
    assert flat_is_cheaper([256, 256, 128, 192], 256, 576)  # 832 * 1.3611 = 1132.4, near the break-even
    assert not flat_is_cheaper([256, 256, 136, 192], 256, 576)  # 840 * 1.3646 = 1146.3
    assert not flat_is_cheaper([256, 239, 248, 256], 256, 576)  # 999 * 1.4336 = 1432.2
    assert flat_is_cheaper([256, 255, 200, 100], 256, 576)  # 811 * 1.3520 = 1096.5
    assert not flat_is_cheaper([256] * 4, 256, 576)  # no padding: the mask-free causal path stays
    # a narrow model pays more for attention: hidden 64, 4 * 64 = 256
    assert flat_is_cheaper([30, 12, 20, 8], 30, 64)  # 70 * (1 + 70 / 256) = 89.1 < 120 * (1 + 30 / 256) = 134.1
    assert not flat_is_cheaper([300, 250, 280, 10], 300, 64)  # 840 * 4.28 = 3596 > 1200 * 2.17 = 2606


def test_rows_kept_apart_reads_the_model():
    for attn in ("sdpa", "eager"):
        model = load_causal_lm(MODEL, attn_implementation=attn).train()
        assert rows_kept_apart(model, torch.arange(3, 40))
        assert rows_kept_apart(model, torch.tensor([7, 9, 11]))  # fewer than 8 tokens: repeated
        assert model.training  # its mode comes back

    class RunsOn(torch.nn.Module):  # a model with its own mask code: position ids do not separate sequences
        def __init__(self):
            super().__init__()
            self.inner = load_causal_lm(MODEL)

        def forward(self, input_ids, position_ids=None, **kwargs):
            return self.inner(input_ids=input_ids, **kwargs)

    assert not rows_kept_apart(RunsOn(), torch.arange(3, 40))


# ------------------------------------------------------------------ which batches are flattened


def test_per_batch_decision_and_position_ids(tmp_path):
    data = Dataset.from_list([{"input_ids": list(range(3, 3 + n))} for n in (30, 12, 20, 8, 30, 30, 30, 30)])
    trainer = SFTTrainer(MODEL, args=config(tmp_path), train_dataset=data)
    assert trainer.args.padding_free is None  # unpacked, sdpa: decided per batch
    seen = model_inputs(trainer.model)
    with torch.no_grad():
        mixed = trainer.data_collator(rows_of(trainer, range(4)))  # lengths 30, 12, 20, 8: cheaper flat
        trainer.compute_loss(trainer.model, mixed)
        forward = seen[-1]
        assert forward["input_ids"].shape == (1, 70) and "attention_mask" not in forward
        assert forward["position_ids"].tolist() == [[*range(30), *range(12), *range(20), *range(8)]]
        assert forward["input_ids"].tolist() == [mixed["input_ids"][mixed["attention_mask"].bool()].tolist()]
        full = trainer.data_collator(rows_of(trainer, range(4, 8)))  # four rows of 30: no padding, stays
        trainer.compute_loss(trainer.model, full)
        assert seen[-1]["input_ids"].shape == (4, 30) and "position_ids" not in seen[-1]
        # padding_free=False keeps every batch padded
        padded = SFTTrainer(MODEL, args=config(tmp_path, padding_free=False), train_dataset=data)
        seen = model_inputs(padded.model)
        padded.compute_loss(padded.model, mixed)
        assert seen[-1]["input_ids"].shape == (4, 30) and seen[-1]["attention_mask"] is not None


def test_packing_and_flash_keep_their_resolution(tmp_path):
    packed = SFTTrainer(MODEL, args=config(tmp_path, packing=True, max_length=64), train_dataset=zen())
    assert packed.args.padding_free is False and packed._flatten_width is None  # full bins: one per row
    eager = SFTTrainer(MODEL, args=config(tmp_path, model_init_kwargs={"attn_implementation": "eager"}),
                       train_dataset=zen())
    assert eager.args.padding_free is None and eager._flatten_width == 64


def test_a_model_that_ignores_restarting_positions_stays_padded(tmp_path):
    data = Dataset.from_list([{"input_ids": list(range(3, 3 + n))} for n in (30, 12, 20, 8)])
    trainer = SFTTrainer(MODEL, args=config(tmp_path), train_dataset=data)
    batch = trainer.data_collator(rows_of(trainer, range(4)))
    forward = trainer.model.forward
    trainer.model.forward = lambda input_ids=None, position_ids=None, **kw: forward(input_ids=input_ids, **kw)
    seen = model_inputs(trainer.model)
    with pytest.warns(UserWarning, match="see each other despite restarting position_ids"), torch.no_grad():
        trainer.compute_loss(trainer.model, batch)
    assert seen[-1]["input_ids"].shape == (4, 30)
    with warnings.catch_warnings():  # checked once
        warnings.simplefilter("error")
        with torch.no_grad():
            trainer.compute_loss(trainer.model, batch)


def test_left_padding_or_targets_on_padding_stay_padded(tmp_path):
    data = Dataset.from_list([{"input_ids": list(range(3, 3 + n))} for n in (30, 12, 20, 8)])
    trainer = SFTTrainer(MODEL, args=config(tmp_path), train_dataset=data)
    batch = trainer.data_collator(rows_of(trainer, range(4)))
    seen = model_inputs(trainer.model)
    left = {k: v.flip(1) for k, v in batch.items()}  # a custom collator padding on the left
    on_pad = dict(batch, labels=batch["input_ids"].clone())  # labels on padding too
    with torch.no_grad():
        for odd in (left, on_pad):
            trainer.compute_loss(trainer.model, odd)
            assert seen[-1]["input_ids"].shape == (4, 30)


# ------------------------------------------------------------------ same loss, gradients and metrics


def reference_loss(model, rows):
    """Float64 NLL of every target token, each sequence run alone (no padding, no flattening), summed over
    the batch and divided by the number of targets, as SFT aggregates it."""
    total, count = 0.0, 0
    for row in rows:
        ids = torch.tensor([row["input_ids"]])
        mask = torch.tensor(row["loss_mask"][1:], dtype=torch.bool)  # the first token is never a target
        logps = model(input_ids=ids, use_cache=False).logits.double()[0, :-1].log_softmax(-1)
        total = total - logps.gather(-1, ids[0, 1:, None])[:, 0][mask].sum()
        count += int(mask.sum())
    return total / count


def losses_and_grads(trainer, batch):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer.recorded_metrics().items()}
    return loss.detach(), grads, metrics, trainer._num_tokens


def varied_text(size: int, split: str = "train"):
    """`reverse` rows as text of 4 lengths, so that padded batches hold padding worth removing."""
    return task_dataset("reverse", split, size=size).map(
        lambda row, i: {"text": row["prompt"] + row["completion"] + " and again" * (3 * (i % 4))}, with_indices=True,
        remove_columns=["prompt", "completion", "answer"])


DATASETS = {
    "text": lambda: varied_text(8),
    "prompt_completion": lambda: task_dataset("reverse", size=8).map(  # completion_only_loss
        lambda row, i: {"prompt": "please " * (3 * (i % 4)) + row["prompt"]}, with_indices=True),
    "assistant_only": lambda: task_dataset("reverse", size=8).map(  # two turns; the loss on assistant turns only
        lambda row, i: {"messages": [{"role": "user", "content": row["prompt"] + " please" * (30 * (i == 3))},
                                     {"role": "assistant", "content": row["answer"]},
                                     {"role": "user", "content": "again"},
                                     {"role": "assistant", "content": row["answer"]}]},
        with_indices=True, remove_columns=["prompt", "completion", "answer"]),
}


@pytest.mark.parametrize("kind", list(DATASETS))
def test_flat_and_padded_give_the_same_loss_gradients_and_metrics(tmp_path, kind):
    extra = {"assistant_only_loss": True} if kind == "assistant_only" else {}
    data = DATASETS[kind]()
    flat = SFTTrainer(MODEL, args=config(tmp_path, **extra), train_dataset=data)
    padded = SFTTrainer(MODEL, args=config(tmp_path, padding_free=False, **extra), train_dataset=data)
    padded.model.load_state_dict(flat.model.state_dict())
    for trainer in (flat, padded):
        trainer.model.double().train()  # float64: the two layouts agree far below float32 rounding (no dropout)
    by_length = sorted(range(len(flat.train_dataset)), key=lambda i: len(flat.train_dataset[i]["input_ids"]))
    rows = rows_of(flat, [by_length[-1], *by_length[:3]])  # the longest and the three shortest
    lengths = [len(r["input_ids"]) for r in rows]
    assert flat_is_cheaper(lengths, max(lengths), 64), lengths  # this batch is really flattened
    if kind != "text":  # prompt tokens, or what is not an assistant turn, carry no loss
        assert all(0 < sum(r["loss_mask"]) < len(r["input_ids"]) for r in rows)
    seen = model_inputs(flat.model)
    loss_f, grads_f, metrics_f, tokens_f = losses_and_grads(flat, flat.data_collator(rows))
    assert seen[-1]["input_ids"].shape == (1, sum(lengths))
    loss_p, grads_p, metrics_p, tokens_p = losses_and_grads(padded, padded.data_collator(rows))
    with torch.no_grad():
        reference = reference_loss(flat.model, rows)
    assert loss_f.item() == pytest.approx(reference.item(), abs=1e-10)
    assert loss_p.item() == pytest.approx(reference.item(), abs=1e-10)
    assert grads_f.keys() == grads_p.keys() and len(grads_f) == len(list(flat.model.parameters()))
    for name in grads_f:
        torch.testing.assert_close(grads_f[name], grads_p[name], atol=1e-10, rtol=1e-9, msg=name)
    assert metrics_f.keys() == {"entropy", "mean_token_accuracy"}
    assert metrics_f == pytest.approx(metrics_p, abs=1e-6)
    assert tokens_f == tokens_p == sum(lengths)


def test_training_and_evaluation_match_padded_runs(tmp_path):
    """Three steps of 4 rows, then evaluation: the per-batch layout logs the losses, metrics and token counts
    of padding_free=False (float32 rounding apart)."""
    data, eval_data = varied_text(12), varied_text(8, "test")
    logs = {}
    for name, kw in {"auto": {}, "padded": dict(padding_free=False)}.items():
        trainer = SFTTrainer(MODEL, args=config(tmp_path, per_device_eval_batch_size=4, **kw), train_dataset=data,
                             eval_dataset=eval_data)
        seen = model_inputs(trainer.model)
        trainer.train()
        n_train = len(seen)
        logs[name] = [h for h in trainer.state.log_history if "loss" in h] + [trainer.evaluate()]
        for forwards in (seen[:n_train], seen[n_train:]):  # train, eval: flat rows only where decided per batch
            flat = [s["input_ids"].shape for s in forwards if s.get("position_ids") is not None]
            assert (name == "auto") == any(shape[0] == 1 and shape[1] > 8 for shape in flat), flat  # 8: the check
    assert len(logs["auto"]) == 4
    for auto, padded in zip(logs["auto"], logs["padded"]):
        for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens", "eval_loss", "eval_entropy",
                    "eval_mean_token_accuracy"):
            if key in padded:
                assert auto[key] == pytest.approx(padded[key], abs=1e-5, rel=1e-5), key
