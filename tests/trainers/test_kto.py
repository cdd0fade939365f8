import pytest
import torch
from tests.helpers.preference import (TINY, assert_all_changed, assert_finite_metrics, assert_split_invariant,
                                config_kwargs, snapshot, task_pairs)

from posttrain.core.preference_losses import kto_loss
from posttrain.data.formats import FormatError
from posttrain.forward.completions import completion_logps
from posttrain.tasks.builtin import zen
from posttrain.trainers.bco import BCOConfig, BCOTrainer
from posttrain.trainers.kto import KTOConfig, KTOTrainer
from posttrain.trainers.preference_base import preference_accuracy

METRICS = ["loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "num_tokens"]


def test_tiny_run_changes_every_parameter_and_logs_finite_metrics(tmp_path):
    args = KTOConfig(**config_kwargs(tmp_path, per_device_train_batch_size=8, desirable_weight=1.2))
    trainer = KTOTrainer(TINY, args=args, train_dataset=zen("unpaired_preference", conversational=True))
    before = snapshot(trainer.model)
    trainer.train()
    assert_all_changed(before, trainer.model)
    assert_finite_metrics(trainer, METRICS)


def test_shares_bco_data_path(tmp_path):
    kto = KTOTrainer(TINY, args=KTOConfig(output_dir=str(tmp_path)), train_dataset=zen("preference"))
    bco = BCOTrainer(TINY, args=BCOConfig(output_dir=str(tmp_path)), train_dataset=zen("preference"))
    assert kto.train_dataset.to_dict() == bco.train_dataset.to_dict()


def test_kl_reference_point_from_mismatched_pairs(tmp_path):
    args = KTOConfig(**config_kwargs(tmp_path, beta=0.5, undesirable_weight=1.5))
    trainer = KTOTrainer(TINY, args=args, train_dataset=zen("unpaired_preference"))
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(rows)
    # rows 4..7: completion i after prompt i+1
    for i in range(4):
        expected = rows[(i + 1) % 4]["prompt_ids"] + rows[i]["completion_ids"]
        assert batch["input_ids"][4 + i, :len(expected)].tolist() == expected
        assert batch["completion_mask"][4 + i].sum() == len(rows[i]["completion_ids"])
    with torch.no_grad():  # move the policy so that the KL estimate is not 0
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    loss = trainer.compute_loss(trainer.model, batch)
    logps = [completion_logps(m, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])[0]
             for m in (trainer.model, trainer.ref_model)]
    z = (logps[0][4:] - logps[1][4:]).mean().clamp(min=0)
    expected, _ = kto_loss(logps[0][:4], logps[1][:4], batch["label"], z, beta=0.5, undesirable_weight=1.5)
    assert trainer.recorded_metrics(trainer.mode())["kl"][-1] == pytest.approx(z.item(), rel=1e-4, abs=1e-6)
    assert loss.item() == pytest.approx(expected.mean().item(), rel=1e-5)


def test_split_invariance(tmp_path):
    data = zen("unpaired_preference").select(range(8))
    assert_split_invariant(lambda **kw: KTOTrainer(TINY, args=KTOConfig(**config_kwargs(tmp_path, **kw)),
                                                   train_dataset=data))


def test_invalid_configs_raise(tmp_path):
    with pytest.raises(ValueError, match="per_device_train_batch_size >= 2"):
        KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=1)
    with pytest.raises(ValueError, match="undesirable_weight"):
        KTOConfig(output_dir=str(tmp_path), undesirable_weight=-1.0)


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "completion": " b", "label": True}, {"prompt": "a", "completion": "", "label": False}],
     r"row 1, column 'completion'.*empty"),
    ([{"prompt": "a", "completion": " b", "label": "yes"}], r"row 0, column 'label'"),
])
def test_bad_rows_are_named(tmp_path, rows, message):
    with pytest.raises(FormatError, match=message):
        KTOTrainer(TINY, args=KTOConfig(**config_kwargs(tmp_path)), train_dataset=rows)


def test_kto_learns_to_prefer_held_out_correct_answers(tmp_path):
    """Random-init tiny-qwen2; `reverse` pairs (rejected: one digit replaced by a letter) split into rows."""
    torch.manual_seed(0)
    args = KTOConfig(**config_kwargs(tmp_path, per_device_train_batch_size=8, max_steps=40, learning_rate=5e-3,
                                     logging_steps=40, max_length=64))
    trainer = KTOTrainer(TINY, args=args, train_dataset=task_pairs("train", 400))
    test = task_pairs("test", 200)
    before = preference_accuracy(trainer.model, trainer.processing_class, test)
    trainer.train()
    after = preference_accuracy(trainer.model, trainer.processing_class, test)
    print(f"KTO held-out preference for the correct answer: {before:.3f} -> {after:.3f}")
    assert before < 0.7 and after > 0.9
