"""KTOConfig fields TRL users set: loss_type, precompute_ref_log_probs, sync_ref_model, compute_metrics."""

import math

import pytest
import torch
from tests.helpers.preference import TINY, config_kwargs

from posttrain.tasks.builtin import zen
from posttrain.trainers.base import SyncRefModelCallback
from posttrain.trainers.bco import BCOConfig, BCOTrainer
from posttrain.trainers.kto import KTOConfig, KTOTrainer


def nudge(model, seed=0, scale=0.05):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def summed_logps(model, batch, rows):
    """Summed completion log-probs of the given batch rows, from a full float64 log-softmax."""
    ids, mask, cmask = batch["input_ids"][rows], batch["attention_mask"][rows], batch["completion_mask"][rows]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (logp * cmask[:, 1:]).sum(-1)


def test_apo_zero_unpaired_needs_no_kl_rows(tmp_path):
    args = KTOConfig(**config_kwargs(tmp_path, loss_type="apo_zero_unpaired", per_device_train_batch_size=1,
                                     undesirable_weight=1.5, beta=0.5, max_steps=1))
    trainer = KTOTrainer(TINY, args=args, train_dataset=zen("unpaired_preference"))
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(rows)
    assert batch["input_ids"].shape[0] == 4  # no mismatched rows appended
    nudge(trainer.model)
    loss = trainer.compute_loss(trainer.model, batch)
    rho = summed_logps(trainer.model, batch, slice(0, 4)) - summed_logps(trainer.ref_model, batch, slice(0, 4))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = [1 - sig(0.5 * r) if row["label"] else 1.5 * sig(0.5 * r) for r, row in zip(rho.tolist(), rows)]
    assert {row["label"] for row in rows} == {True, False}
    assert loss.item() == pytest.approx(sum(expected) / 4, rel=1e-4)
    trainer.train()  # batch size 1 is fine without a KL estimate
    logged = trainer.state.log_history[0]
    assert math.isfinite(logged["loss"]) and "kl" not in logged


def test_precomputed_reference_fixes_the_kl_pairs_and_gives_the_live_loss(tmp_path):
    data = zen("unpaired_preference")
    pre = KTOTrainer(TINY, args=KTOConfig(**config_kwargs(tmp_path, precompute_ref_log_probs=True)),
                     train_dataset=data, eval_dataset=data.select(range(5)))
    live = KTOTrainer(TINY, args=KTOConfig(**config_kwargs(tmp_path)), train_dataset=data)
    assert pre.ref_model is None and pre.ref_precomputed
    assert {"ref_logps", "ref_kl_logps", "kl_completion_ids"} <= set(pre.train_dataset.column_names)
    assert "ref_kl_logps" in pre.eval_dataset.column_names
    completions = pre.train_dataset["completion_ids"]
    assert pre.train_dataset[0]["kl_completion_ids"] == completions[1]  # row i's prompt, row i+1's completion
    batch = pre.data_collator([pre.train_dataset[i] for i in range(4)])
    B = 4
    row0 = pre.train_dataset[0]
    assert batch["input_ids"][B, :len(row0["prompt_ids"]) + len(completions[1])].tolist() == \
        row0["prompt_ids"] + completions[1]
    # the stored reference log-probs are the reference's on these rows, KL rows included
    torch.testing.assert_close(batch["ref_logps"].double(), summed_logps(live.ref_model, batch, slice(0, B)),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batch["ref_kl_logps"].double(), summed_logps(live.ref_model, batch, slice(B, 2 * B)),
                               rtol=1e-4, atol=1e-4)
    nudge(pre.model)
    nudge(live.model)
    live_batch = {k: v for k, v in batch.items() if k not in ("ref_logps", "ref_kl_logps")}
    loss_pre, loss_live = pre.compute_loss(pre.model, batch), live.compute_loss(live.model, live_batch)
    assert loss_pre.item() == pytest.approx(loss_live.item(), rel=1e-5)
    pre.train()
    assert pre.ref_model is None and math.isfinite(pre.state.log_history[0]["kl"])


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path):
    args = KTOConfig(**config_kwargs(tmp_path, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5,
                                     max_steps=1))
    trainer = KTOTrainer(TINY, args=args, train_dataset=zen("unpaired_preference"))
    assert any(isinstance(cb, SyncRefModelCallback) for cb in trainer.callback_handler.callbacks)
    before = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    policy = dict(trainer.model.named_parameters())
    for name, ref in trainer.ref_model.named_parameters():
        torch.testing.assert_close(ref, 0.5 * policy[name].detach() + 0.5 * before[name])
    assert any(not torch.equal(ref, before[n]) for n, ref in trainer.ref_model.named_parameters())


def test_sync_ref_model_refuses_a_peft_reference(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="sync_ref_model"):
        KTOTrainer(TINY, args=KTOConfig(**config_kwargs(tmp_path, sync_ref_model=True)),
                   train_dataset=zen("unpaired_preference"), peft_config=lora)


@pytest.mark.parametrize("trainer_class, config_class", [(KTOTrainer, KTOConfig), (BCOTrainer, BCOConfig)])
def test_compute_metrics_receives_row_rewards_and_labels(tmp_path, trainer_class, config_class):
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction)
        return {"rows": float(len(prediction.label_ids))}

    data = zen("unpaired_preference")
    trainer = trainer_class(TINY, args=config_class(**config_kwargs(tmp_path, per_device_eval_batch_size=4)),
                            train_dataset=data, eval_dataset=data.select(range(6)), compute_metrics=compute_metrics)
    nudge(trainer.model)
    result = trainer.evaluate()
    predictions, labels = seen[0].predictions, seen[0].label_ids
    assert result["eval_rows"] == 6 and predictions.shape == (6,)
    assert labels.tolist() == [int(trainer.eval_dataset[i]["label"]) for i in range(6)]
    trainer.model.eval()
    batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(4)])
    with torch.no_grad():
        _, outputs = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    torch.testing.assert_close(torch.as_tensor(predictions[:4]), outputs["rewards"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("fields, message", [
    (dict(loss_type="sigmoid"), "loss_type must be one of"),
    (dict(per_device_train_batch_size=1), "per_device_train_batch_size >= 2"),
    (dict(sync_ref_model=True, precompute_ref_log_probs=True), "precompute"),
    (dict(max_completion_length=0), "max_completion_length must be a positive"),
    (dict(max_prompt_length=0), "max_prompt_length must be a positive"),
    (dict(truncation_mode="left"), "truncation_mode"),
])
def test_refused_values(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        KTOConfig(output_dir=str(tmp_path), **fields)
    KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, precompute_ref_log_probs=True)
