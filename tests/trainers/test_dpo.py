import math

import pytest
import torch
from tests.helpers.preference import (TINY, assert_all_changed, assert_finite_metrics, assert_split_invariant,
                                config_kwargs, snapshot, task_pairs)

from posttrain.core.preference_losses import DPO_LOSSES, PreferenceInput, dpo_loss
from posttrain.data.formats import FormatError
from posttrain.forward.completions import completion_logps
from posttrain.forward.logprobs import plain_lm_head
from posttrain.models.loading import frozen_copy, load_causal_lm
from posttrain.tasks.builtin import zen
from posttrain.trainers.dpo import DPOConfig, DPOTrainer
from posttrain.trainers.preference_base import preference_accuracy

METRICS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "num_tokens"]


def batch_of(trainer, n=4):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(n)])


def test_tiny_run_changes_every_parameter_and_logs_finite_metrics(tmp_path):
    trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=zen("preference"))
    before = snapshot(trainer.model)
    trainer.train()
    assert_all_changed(before, trainer.model)
    assert_finite_metrics(trainer, METRICS)


@pytest.mark.parametrize("loss_type", sorted(DPO_LOSSES) + [["sigmoid", "bco_pair"]])
def test_every_loss_type_goes_through_the_core_loss(tmp_path, loss_type):
    args = DPOConfig(**config_kwargs(tmp_path, loss_type=loss_type, max_steps=1))
    trainer = DPOTrainer(TINY, args=args, train_dataset=zen("preference"))
    with torch.no_grad():  # move the policy away from the reference so the losses are not at their tie value
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = batch_of(trainer)
    loss = trainer.compute_loss(trainer.model, batch)
    # the same numbers, computed outside the trainer
    ids, mask, cmask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    logps, lengths, _ = completion_logps(trainer.model, ids, mask, cmask)
    if trainer.reference_free:
        assert trainer.ref_model is None
        ref = [None, None]
    else:
        ref = completion_logps(trainer.ref_model, ids, mask, cmask)[0].chunk(2)
    inp = PreferenceInput(*logps.chunk(2), *ref, *lengths.chunk(2))
    expected = dpo_loss(inp, loss_type, 0.1).mean()
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in trainer.model.parameters())


def test_rpo_alpha_adds_the_chosen_per_token_nll(tmp_path):
    """RPO: loss = DPO loss + alpha x mean over pairs of (chosen NLL / chosen length), the NLL computed
    here independently with a full float64 log_softmax."""
    data = zen("preference")
    plain = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=data)
    rpo = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, rpo_alpha=0.5)), train_dataset=data)
    batch = batch_of(plain)
    base, with_nll = plain.compute_loss(plain.model, batch), rpo.compute_loss(rpo.model, batch)
    ids, mask, cmask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    B = ids.shape[0] // 2
    with torch.no_grad():
        logits = rpo.model(input_ids=ids[:B], attention_mask=mask[:B]).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:B, 1:, None]).squeeze(-1)
    m = cmask[:B, 1:].double()
    nll = (-(logp * m).sum(-1) / m.sum(-1)).mean()
    assert with_nll.item() == pytest.approx(base.item() + 0.5 * nll.item(), rel=1e-5)
    with pytest.raises(ValueError, match="rpo_alpha"):
        DPOConfig(**config_kwargs(tmp_path, rpo_alpha=-1.0))


def test_one_concatenated_forward_with_completion_logits_only(tmp_path):
    trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=zen("preference"))
    batch = batch_of(trainer)
    plain = plain_lm_head(trainer.model, batch["input_ids"])  # checked (one 8-token forward) before the hook
    calls = []
    hook = trainer.model.register_forward_hook(lambda m, args, kw, out: calls.append(
        (kw["input_ids"].shape, out.logits.shape)), with_kwargs=True)
    trainer.compute_loss(trainer.model, batch)
    hook.remove()
    assert len(calls) == 1  # chosen and rejected together; the reference is a separate model
    (rows, width), (_, kept, _) = calls[0]
    first_completion = int(batch["completion_mask"].any(0).int().argmax())
    if plain is not None:  # one [prompt | chosen | rejected] row per pair; the output layer is fused: no logits
        assert rows == 4 and kept == 0
        assert width < batch["input_ids"].shape[1] + batch["completion_mask"].sum(1).max()
    else:
        assert rows == 8
        assert kept == width - first_completion < width  # exactly the scoring positions, no extra column


def test_precomputed_reference_gives_the_live_loss_and_frees_the_reference(tmp_path):
    data = zen("preference")
    pre = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, precompute_ref_log_probs=True)),
                     train_dataset=data, eval_dataset=data.select(range(5)))
    live = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=data)
    assert pre.ref_model is None and live.ref_model is not None
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(pre.train_dataset.column_names)
    assert "ref_chosen_logps" in pre.eval_dataset.column_names
    for trainer in (pre, live):  # the same move away from the reference
        torch.manual_seed(0)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    loss_pre = pre.compute_loss(pre.model, batch_of(pre, 8))
    loss_live = live.compute_loss(live.model, batch_of(live, 8))
    assert abs(loss_live.item() - math.log(2)) > 1e-3
    assert loss_pre.item() == pytest.approx(loss_live.item(), rel=1e-5)
    pre.train()  # trains without any reference model
    assert pre.ref_model is None


def test_peft_reference_is_the_adapter_disabled_model(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights=False, task_type="CAUSAL_LM")
    data = zen("preference")
    adapter = DPOTrainer(load_causal_lm(TINY), args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=data,
                         peft_config=lora)
    explicit = DPOTrainer(load_causal_lm(TINY), ref_model=frozen_copy(load_causal_lm(TINY)),
                          args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=data, peft_config=lora)
    assert adapter.ref_model is None  # no second copy of the weights
    batch = batch_of(adapter)
    rows = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    ref_a, ref_b = adapter.reference_logps(*rows), explicit.reference_logps(*rows)
    torch.testing.assert_close(ref_a, ref_b, rtol=1e-5, atol=1e-4)
    policy = completion_logps(adapter.model, *rows)[0]
    assert (policy - ref_a).abs().max() > 1e-3  # the adapter is active outside the reference context
    before = snapshot(adapter.model)
    adapter.train()
    assert_all_changed(before, adapter.model)
    assert all("lora" in n for n in before)


def test_split_invariance(tmp_path):
    data = zen("preference").select(range(8))
    assert_split_invariant(lambda **kw: DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, **kw)),
                                                   train_dataset=data))


def test_sync_ref_model_mixes_the_policy_into_the_reference(tmp_path):
    args = DPOConfig(**config_kwargs(tmp_path, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=1.0,
                                     max_steps=1))
    trainer = DPOTrainer(TINY, args=args, train_dataset=zen("preference"))
    trainer.train()
    for (_, ref), (_, pol) in zip(trainer.ref_model.named_parameters(), trainer.model.named_parameters()):
        torch.testing.assert_close(ref, pol.detach())


@pytest.mark.parametrize("fields, message", [
    (dict(sync_ref_model=True, precompute_ref_log_probs=True), "precompute"),
    (dict(loss_type=["sigmoid", "ipo"], loss_weights=[1.0]), "loss_weights"),
    (dict(loss_type="orpo"), "unknown loss_type"),
    (dict(loss_type="hinge", label_smoothing=0.1), "label_smoothing"),
    (dict(loss_type="robust", label_smoothing=0.5), "robust"),
    (dict(loss_type="simpo", precompute_ref_log_probs=True), "no reference"),
    (dict(max_length=16, max_prompt_length=16), "max_prompt_length"),
])
def test_invalid_configs_raise(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        DPOConfig(output_dir=str(tmp_path), **fields)


def test_simpo_is_reference_free(tmp_path):
    args = DPOConfig(**config_kwargs(tmp_path, loss_type="simpo", beta=2.0))
    with pytest.raises(ValueError, match="reference-free"):
        DPOTrainer(TINY, ref_model=TINY, args=args, train_dataset=zen("preference"))
    trainer = DPOTrainer(TINY, args=args, train_dataset=zen("preference"))
    assert trainer.ref_model is None
    trainer.train()
    assert_finite_metrics(trainer, METRICS)


def test_conversational_and_implicit_prompt_data(tmp_path):
    for data in (zen("preference", conversational=True), zen("implicit_prompt_preference")):
        trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, max_steps=1)), train_dataset=data)
        trainer.train()
        assert_finite_metrics(trainer, ["loss"])


def test_long_rows_are_dropped_or_truncated_and_reported(tmp_path, caplog):
    data = task_pairs("train", 20)
    prompt_len = len(DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=data)
                     .train_dataset[0]["prompt_ids"])
    with caplog.at_level("WARNING"):
        trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, max_length=prompt_len + 2)),
                             train_dataset=data)
    assert "truncated 20 pairs" in caplog.text
    assert all(len(r["chosen_ids"]) == 2 for r in trainer.train_dataset)
    with pytest.raises(ValueError, match="no train rows are left"):
        DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, max_length=prompt_len)), train_dataset=data)


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "a", "chosen": " b", "rejected": None}],
     r"row 1, column 'rejected'"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "a", "chosen": "", "rejected": " c"}],
     r"row 1, column 'chosen'.*empty"),
    ([{"prompt": "q", "responses": [" a", " b"], "ranks": [0, 1]},
      {"prompt": "q", "responses": [" a", " b", " c"], "ranks": [0, 1]}], r"row 1, column 'ranks'"),
])
def test_bad_rows_are_named(tmp_path, rows, message):
    with pytest.raises(FormatError, match=message):
        DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=rows)


def test_dpo_learns_to_prefer_held_out_correct_answers(tmp_path):
    """Random-init tiny-qwen2, `reverse` pairs (rejected: one answer digit replaced by a letter)."""
    torch.manual_seed(0)
    args = DPOConfig(**config_kwargs(tmp_path, per_device_train_batch_size=8, max_steps=12, learning_rate=3e-3,
                                     logging_steps=12, max_length=64))
    trainer = DPOTrainer(TINY, args=args, train_dataset=task_pairs("train", 400))
    test = task_pairs("test", 200)
    before = preference_accuracy(trainer.model, trainer.processing_class, test)
    trainer.train()
    after = preference_accuracy(trainer.model, trainer.processing_class, test)
    print(f"DPO held-out preference for the correct answer: {before:.3f} -> {after:.3f}")
    assert before < 0.7 and after > 0.95


def test_task_preference_dataset_corrupts_one_digit_keeping_the_token_count():
    from posttrain.models.loading import load_tokenizer
    from posttrain.tasks.builtin import load_builtin, task_preference_dataset

    tok = load_tokenizer(TINY)
    for corruption in ("letter", "digit"):
        for row in task_preference_dataset("reverse", "test", 50, corruption=corruption):
            assert row["chosen"] == " " + row["answer"] and row["rejected"] != row["chosen"]
            assert row["rejected"][:2] == row["chosen"][:2]  # the first digit is kept
            assert sum(a != b for a, b in zip(row["chosen"], row["rejected"])) == 1
            assert len(tok(row["rejected"])["input_ids"]) == len(tok(row["chosen"])["input_ids"])
    unpaired = load_builtin("reverse/unpaired_preference", "test")
    assert unpaired["label"][:4] == [True, False, True, False]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_paired_completion_logps_equal_the_two_row_forward_with_gradients(tmp_path, attn):
    """Pairs scored as one [prompt | chosen | rejected] sequence give the two-row forward's log-probs,
    lengths and gradients (float64, pairs of uneven prompt and completion lengths), whether the
    pairs go through the model in one batch or in length groups."""
    from posttrain.forward.logprobs import plain_lm_head

    model = load_causal_lm(TINY).double()
    model.config._attn_implementation = attn
    trainer = DPOTrainer(model, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=zen("preference"))
    batch = batch_of(trainer, 4)
    rows = []
    model.register_forward_hook(lambda m, args, kw, out: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    ids, mask, cmask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    head = plain_lm_head(model, ids)
    ways = {"two rows": lambda: completion_logps(model, ids, mask, cmask, paired=False),
            "paired, one batch": lambda: completion_logps(model, ids, mask, cmask, paired=True, per_forward=10**9),
            "paired, a pair per forward": lambda: completion_logps(model, ids, mask, cmask, paired=True, per_forward=0)}
    results, forwards = {}, {}
    for name, way in ways.items():
        model.zero_grad()
        rows.clear()
        logps, lengths, mean_logits = way()
        (logps * torch.linspace(0.5, 1.5, len(logps), dtype=logps.dtype)).sum().backward()
        results[name] = (logps.detach(), lengths, mean_logits, [p.grad.clone() for p in model.parameters()])
        forwards[name] = list(rows)
    assert forwards == {"two rows": [8], "paired, one batch": [4], "paired, a pair per forward": [1, 1, 1, 1]}
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 2  # uneven lengths
    plain, plain_len, plain_mean, plain_grads = results["two rows"]
    for name in ("paired, one batch", "paired, a pair per forward"):
        shared, shared_len, shared_mean, shared_grads = results[name]
        torch.testing.assert_close(shared, plain, rtol=1e-6, atol=1e-6)
        assert torch.equal(shared_len, plain_len)
        torch.testing.assert_close(shared_mean, plain_mean, rtol=1e-5, atol=1e-5)
        for a, b in zip(shared_grads, plain_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_length_groups_minimise_padding_plus_a_cost_per_forward():
    from posttrain.core.log_softmax import length_groups

    lengths = [174, 143, 151, 157]
    # one group pads to 4 x 174 = 696; per row costs 625 + 4 x 16 = 689; {174} {157, 151, 143} 174 + 471 + 32 = 677
    assert length_groups(lengths, 16) == [[0], [1, 2, 3]]
    assert length_groups(lengths, 1000) == [[0, 1, 2, 3]]
    assert length_groups(lengths, 0) == [[0], [3], [2], [1]]  # longest first
    assert length_groups([10, 10, 50, 50], 5) == [[2, 3], [0, 1]]
    assert length_groups([], 5) == []
