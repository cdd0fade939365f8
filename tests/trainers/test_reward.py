import pytest
import torch
from datasets import Dataset
from tests.helpers.preference import (TINY, assert_all_changed, assert_finite_metrics, assert_split_invariant,
                                config_kwargs, snapshot, task_pairs)

from posttrain.core.preference_losses import pairwise_reward_loss
from posttrain.data.formats import FormatError
from posttrain.models.loading import load_sequence_classifier
from posttrain.tasks.builtin import zen
from posttrain.trainers.preference_base import PreferenceCollator
from posttrain.trainers.reward import RewardConfig, RewardTrainer, pair_rewards, plain_score_head

METRICS = ["loss", "accuracy", "margin", "rewards/mean", "rewards/min", "rewards/max", "num_tokens"]


def test_tiny_run_changes_every_parameter_and_logs_finite_metrics(tmp_path):
    trainer = RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=zen("preference"))
    assert trainer.model.config.num_labels == 1 and hasattr(trainer.model, "score")
    before = snapshot(trainer.model)
    trainer.train()
    assert_all_changed(before, trainer.model)
    assert_finite_metrics(trainer, METRICS)


def test_loss_is_the_core_pairwise_loss_with_margin_and_centering(tmp_path):
    data = zen("preference").add_column("margin", [0.5 * i for i in range(19)])
    args = RewardConfig(**config_kwargs(tmp_path, center_rewards_coefficient=0.01))
    trainer = RewardTrainer(TINY, args=args, train_dataset=data)
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(rows)
    assert batch["margin"].tolist() == [0.0, 0.5, 1.0, 1.5]
    loss = trainer.compute_loss(trainer.model, batch)
    # score each sequence on its own, unpadded, and apply the loss by hand
    scores = []
    for column in ("chosen_ids", "rejected_ids"):
        for r in rows:
            ids = torch.tensor([r["prompt_ids"] + r[column]])
            scores.append(trainer.model(input_ids=ids).logits[0, 0])
    scores = torch.stack(scores)
    expected = pairwise_reward_loss(scores[:4], scores[4:], batch["margin"], 0.01)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_data_layouts(tmp_path):
    args = RewardConfig(**config_kwargs(tmp_path, max_steps=1))
    ranked = Dataset.from_list([{"prompt": "I have a fever.", "responses": [" rest", " take medicine", " see a doctor"],
                                 "ranks": [1, 2, 0]}])
    trainer = RewardTrainer(TINY, args=args, train_dataset=ranked)
    decode = trainer.processing_class.decode
    pairs = [(decode(r["chosen_ids"], skip_special_tokens=True), decode(r["rejected_ids"], skip_special_tokens=True))
             for r in trainer.train_dataset]
    assert pairs == [(" see a doctor", " rest"), (" see a doctor", " take medicine"), (" rest", " take medicine")]
    for data in (zen("preference", conversational=True), zen("implicit_prompt_preference"),
                 zen("implicit_prompt_preference", conversational=True)):
        trainer = RewardTrainer(TINY, args=args, train_dataset=data)
        trainer.train()
        assert_finite_metrics(trainer, ["loss", "accuracy"])


def test_peft_trains_lora_and_the_score_head(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])  # no task_type: SEQ_CLS is set
    trainer = RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=zen("preference"),
                            peft_config=lora)
    before = snapshot(trainer.model)
    assert any("score" in n for n in before) and any("lora" in n for n in before)
    trainer.train()
    assert_all_changed(before, trainer.model)
    with pytest.raises(ValueError, match="SEQ_CLS"):
        RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=zen("preference"),
                      peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))


def test_split_invariance(tmp_path):
    data = zen("preference").select(range(8))
    assert_split_invariant(lambda **kw: RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path, **kw)),
                                                      train_dataset=data))


def test_long_prompts_are_dropped_and_reported(tmp_path, caplog):
    data = Dataset.from_list([{"prompt": "short", "chosen": " a b c d e f", "rejected": " g"},
                              {"prompt": "a much longer prompt " * 10, "chosen": " a", "rejected": " b"}])
    with caplog.at_level("WARNING"):
        trainer = RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path, max_length=8)), train_dataset=data)
    assert len(trainer.train_dataset) == 1
    assert "dropped 1 of 2 pairs" in caplog.text and "truncated 1 pairs" in caplog.text
    row = trainer.train_dataset[0]
    assert len(row["prompt_ids"]) + len(row["chosen_ids"]) == 8


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "a", "chosen": None, "rejected": " c"}],
     r"row 1, column 'chosen'"),
    ([{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "a", "chosen": " b", "rejected": ""}],
     r"row 1, column 'rejected'.*empty"),
    ([{"prompt": "q", "responses": [" a", " b", " c"], "scores": [1.0, 2.0]}], r"row 0, column 'scores'"),
])
def test_bad_rows_are_named(tmp_path, rows, message):
    with pytest.raises(FormatError, match=message):
        RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=rows)


def test_reward_model_learns_held_out_pairs(tmp_path):
    """tiny-qwen2 with a fresh score head; `reverse` pairs (rejected: one answer digit replaced by a letter)."""
    args = RewardConfig(**config_kwargs(tmp_path, per_device_train_batch_size=16, max_steps=15, learning_rate=3e-3,
                                        logging_steps=15, per_device_eval_batch_size=100, max_length=64))
    trainer = RewardTrainer(TINY, args=args, train_dataset=task_pairs("train", 400),
                            eval_dataset=task_pairs("test", 200))
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    print(f"reward model held-out pairwise accuracy: {before:.3f} -> {after:.3f}")
    assert before < 0.7 and after > 0.9


def _uneven_pairs():
    """Three collated pairs (6 rows, chosen first) whose prompts and completions differ in length."""
    g = torch.Generator().manual_seed(0)
    shapes = [(5, 3, 1), (2, 1, 4), (7, 2, 2)]  # (prompt, chosen, rejected) tokens
    rows = [{k: torch.randint(3, 200, (n,), generator=g).tolist() for k, n in zip(("prompt_ids", "chosen_ids",
                                                                                  "rejected_ids"), shape)}
            for shape in shapes]
    return PreferenceCollator(pad_token_id=0)(rows)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_pairs_give_the_scores_and_gradients_of_the_two_row_forward(attention):
    """[prompt | chosen | rejected] in one sequence, in one group or in length groups, scores every row
    as its own padded row does, and the loss has the same gradient for every parameter (float64).

    The scores agree to float64 rounding; the gradients to float32 rounding, because transformers'
    RMSNorm computes in float32 whatever the model's dtype, and a shared prompt's gradient is summed
    over its two completions after the norm's backward in the packed forward, before it in the
    two-row one."""
    model = load_sequence_classifier(TINY, dtype=torch.float64, attn_implementation=attention)
    model.config.pad_token_id = 0
    batch = _uneven_pairs()
    ids, mask, cmask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    assert plain_score_head(model, ids) is model.score

    def scores_and_grads(score):
        model.zero_grad()
        rewards = score()
        pairwise_reward_loss(rewards[:3], rewards[3:], None, 0.01).backward()
        return rewards.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want, want_grads = scores_and_grads(lambda: model(input_ids=ids, attention_mask=mask).logits[:, 0])
    for per_forward in (None, 0, 10**6):  # CPU default (16 tokens), one group per pair, one group
        got, grads = scores_and_grads(lambda: pair_rewards(model, ids, mask, cmask, per_forward=per_forward))
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()), msg=name)
    # document attention (what RewardTrainer switches sdpa models to): all pairs in one padding-free row
    from posttrain.accel import document_attention

    if document_attention.enable(model):
        calls = []
        model.get_input_embeddings().register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
        got, grads = scores_and_grads(lambda: pair_rewards(model, ids, mask, cmask))
        assert calls == [torch.Size([1, int(mask[:3].sum() + cmask[3:].sum())])]  # one row: every pair, no padding
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        for name, grad in want_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()), msg=name)
    assert document_attention.enable(model) == (attention == "sdpa")


def test_prompt_learning_adapters_take_the_two_row_forward():
    """Prompt tuning prepends virtual tokens inside the PEFT forward, which the packed positions do not
    allow for: the rows go through the model as they are."""
    from peft import PromptTuningConfig, get_peft_model

    model = load_sequence_classifier(TINY, dtype=torch.float64)
    model.config.pad_token_id = 0
    model = get_peft_model(model, PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=2))
    batch = _uneven_pairs()
    assert plain_score_head(model, batch["input_ids"]) is None
    with torch.no_grad():
        got = pair_rewards(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        want = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    assert torch.equal(got, want)
