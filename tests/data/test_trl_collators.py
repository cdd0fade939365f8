"""TRL's public collators (posttrain.data.collators) against batches worked by hand."""

import pytest
import torch

from posttrain import DataCollatorForLanguageModeling, DataCollatorForPreference, DataCollatorForUnpairedPreference

M = -100


def as_lists(batch):
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_language_modeling_padded():
    out = as_lists(DataCollatorForLanguageModeling(pad_token_id=0)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]))
    assert out == {"input_ids": [[1, 2, 3], [4, 5, 0]], "attention_mask": [[1, 1, 1], [1, 1, 0]],
                   "position_ids": [[0, 1, 2], [0, 1, 0]], "labels": [[1, 2, 3], [4, 5, M]]}


def test_language_modeling_completion_and_assistant_masks():
    rows = [{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}, {"input_ids": [4, 5], "completion_mask": [0, 1]}]
    out = as_lists(DataCollatorForLanguageModeling(pad_token_id=0)(rows))
    assert out["labels"] == [[M, 2, 3], [M, 5, M]]
    # completion_only_loss=False ignores the completion mask
    out = as_lists(DataCollatorForLanguageModeling(pad_token_id=0, completion_only_loss=False)(rows))
    assert out["labels"] == [[1, 2, 3], [4, 5, M]]
    rows = [{"input_ids": [1, 2, 3, 4], "assistant_masks": [0, 0, 1, 1], "labels": [9, 8, 7, 6]}]
    out = as_lists(DataCollatorForLanguageModeling(pad_token_id=0, completion_only_loss=False)(rows))
    assert out["labels"] == [[M, M, 7, 6]]  # the row's own labels, masked to the assistant's tokens


def test_language_modeling_pad_to_multiple_of():
    out = as_lists(DataCollatorForLanguageModeling(pad_token_id=7, pad_to_multiple_of=4)(
        [{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6]}]))
    assert out["input_ids"] == [[1, 2, 3, 4, 5, 7, 7, 7], [6, 7, 7, 7, 7, 7, 7, 7]]
    assert out["attention_mask"] == [[1] * 5 + [0] * 3, [1] + [0] * 7]
    assert out["labels"] == [[1, 2, 3, 4, 5, M, M, M], [6] + [M] * 7]
    assert out["position_ids"] == [[0, 1, 2, 3, 4, 0, 0, 0], [0] + [0] * 7]


def test_language_modeling_padding_free():
    rows = [{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}, {"input_ids": [4, 5], "completion_mask": [0, 1]}]
    out = as_lists(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows))
    # the second sequence's first token is never a target: its label is -100 (masked here by the completion too)
    assert out == {"input_ids": [[1, 2, 3, 4, 5]], "attention_mask": [[1, 1, 1, 1, 1]],
                   "position_ids": [[0, 1, 2, 0, 1]], "labels": [[M, 2, 3, M, 5]]}
    out = as_lists(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]))
    assert out["labels"] == [[1, 2, 3, M, 5]]  # TRL keeps 4 here, trained from the previous sequence's 3


def test_language_modeling_packed_rows():
    rows = [{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2]}, {"input_ids": [6, 7], "seq_lengths": [2]}]
    out = as_lists(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows))
    # packed and padding-free: no attention mask, so attention follows the restarting position ids
    assert out == {"input_ids": [[1, 2, 3, 4, 5, 6, 7]], "position_ids": [[0, 1, 2, 0, 1, 0, 1]],
                   "labels": [[1, 2, 3, M, 5, M, 7]]}
    out = as_lists(DataCollatorForLanguageModeling(pad_token_id=0)(rows))
    assert out["position_ids"] == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 0]]
    assert out["labels"] == [[1, 2, 3, M, 5], [6, 7, M, M, M]]
    with pytest.raises(ValueError, match="add up to 4"):
        DataCollatorForLanguageModeling(pad_token_id=0)([{"input_ids": [1, 2, 3], "seq_lengths": [2, 2]}])


def test_language_modeling_batch_trains_the_tiny_model(tiny_lm):
    """The collator's batch feeds a model as it is: the loss is the mean NLL over the non -100 labels."""
    model, tokenizer = tiny_lm
    rows = [{"input_ids": tokenizer("abc def")["input_ids"]}, {"input_ids": tokenizer("hello")["input_ids"]}]
    batch = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)(rows)
    with torch.no_grad():
        loss = model(**batch).loss
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    targets = batch["labels"][:, 1:]
    logp = torch.log_softmax(logits[:, :-1], -1)
    keep = targets != M
    expected = -logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0][keep].mean()
    assert torch.allclose(loss.double(), expected, atol=1e-5)


def test_preference_collator():
    rows = [{"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6], "ref_chosen_logps": -1.0,
             "ref_rejected_logps": -2.0},
            {"prompt_ids": [7], "chosen_ids": [8], "rejected_ids": [9, 10, 11], "ref_chosen_logps": -3.0,
             "ref_rejected_logps": -4.0}]
    out = as_lists(DataCollatorForPreference(pad_token_id=0)(rows))
    assert out == {"input_ids": [[1, 2, 3, 4, 5], [7, 8, 0, 0, 0], [1, 2, 3, 6, 0], [7, 9, 10, 11, 0]],
                   "attention_mask": [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]],
                   "completion_mask": [[0, 0, 0, 1, 1], [0, 1, 0, 0, 0], [0, 0, 0, 1, 0], [0, 1, 1, 1, 0]],
                   "ref_chosen_logps": [-1.0, -3.0], "ref_rejected_logps": [-2.0, -4.0]}
    older = [{"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [3, 4]}]
    out = as_lists(DataCollatorForPreference(pad_token_id=0, pad_to_multiple_of=4)(older))
    assert out == {"input_ids": [[1, 2, 0, 0], [1, 3, 4, 0]], "attention_mask": [[1, 1, 0, 0], [1, 1, 1, 0]],
                   "completion_mask": [[0, 1, 0, 0], [0, 1, 1, 0]]}
    with pytest.raises(KeyError, match="prompt_ids"):
        DataCollatorForPreference(pad_token_id=0)([{"chosen_ids": [1], "rejected_ids": [2]}])


def test_unpaired_preference_collator():
    rows = [{"prompt_ids": [1, 2], "completion_ids": [3, 4, 5], "KL_completion_ids": [9], "label": True,
             "ref_logps": -1.5, "ref_KL_logps": -0.5},
            {"prompt_ids": [6], "completion_ids": [7], "KL_completion_ids": [3, 4, 5], "label": False,
             "ref_logps": -2.5, "ref_KL_logps": -3.5}]
    out = as_lists(DataCollatorForUnpairedPreference(pad_token_id=0, max_length=4)(rows))
    assert out == {"completion_input_ids": [[1, 2, 3, 4], [6, 7, 0, 0]],
                   "completion_attention_mask": [[1, 1, 1, 1], [1, 1, 0, 0]],
                   "completion_mask": [[0, 0, 1, 1], [0, 1, 0, 0]],
                   "KL_completion_input_ids": [[1, 2, 9, 0], [6, 3, 4, 5]],
                   "KL_completion_attention_mask": [[1, 1, 1, 0], [1, 1, 1, 1]],
                   "KL_completion_mask": [[0, 0, 1, 0], [0, 1, 1, 1]],
                   "ref_logps": [-1.5, -2.5], "ref_KL_logps": [-0.5, -3.5], "label": [True, False]}


def test_language_modeling_collator_as_sft_data_collator(tmp_path):
    """Given to posttrain's SFTTrainer, it reads the prepared rows' loss_mask: the same completion-only losses
    as the trainer's own collator."""
    from posttrain import SFTConfig, SFTTrainer
    from posttrain.tasks.builtin import task_dataset

    def losses(collator, out):
        args = SFTConfig(output_dir=str(tmp_path / out), max_steps=2, per_device_train_batch_size=4, logging_steps=1,
                         learning_rate=1e-2, report_to=[], disable_tqdm=True, seed=0)
        trainer = SFTTrainer("posttrain/tiny-qwen2", args=args, data_collator=collator,
                             train_dataset=task_dataset("reverse", "train").select(range(16)))
        trainer.train()
        return [r["loss"] for r in trainer.state.log_history if "loss" in r]

    from posttrain.models.loading import load_tokenizer

    pad = load_tokenizer(None, model="posttrain/tiny-qwen2").pad_token_id
    own, public = losses(None, "own"), losses(DataCollatorForLanguageModeling(pad_token_id=pad), "public")
    assert public == pytest.approx(own, rel=1e-4)
    unmasked = losses(DataCollatorForLanguageModeling(pad_token_id=pad, completion_only_loss=False), "all")
    assert public == pytest.approx(unmasked, rel=1e-4)  # loss_mask is the trainer's decision, applied either way
