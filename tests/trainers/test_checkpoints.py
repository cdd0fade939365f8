"""Checkpoints a run can always resume from (atomic saves, incomplete ones skipped), a reused output_dir,
the seed fixing fresh weights, and an empty train_dataset refused at construction."""

import json
import logging
import os
import shutil

import pytest
import torch
from datasets import Dataset
from tests.helpers.preference import TINY, config_kwargs
from transformers import TrainerCallback

from posttrain.models.tiny import tiny_model_path
from posttrain.tasks.builtin import zen
from posttrain.trainers.dpo import DPOConfig, DPOTrainer
from posttrain.trainers.reward import RewardConfig, RewardTrainer
from posttrain.trainers.sft import SFTConfig, SFTTrainer


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def sft(output_dir, **overrides) -> SFTTrainer:
    fields = config_kwargs(output_dir, per_device_train_batch_size=2, learning_rate=1e-3, save_strategy="steps",
                           save_steps=2, max_steps=2)
    return SFTTrainer(TINY, args=SFTConfig(**{**fields, **overrides}), train_dataset=zen())


def folders(path) -> list[str]:
    return sorted(name for name in os.listdir(path) if os.path.isdir(os.path.join(path, name)))


class RecordSteps(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


# ------------------------------------------------------------------ atomic checkpoints

def test_resume_true_skips_a_half_written_checkpoint_with_a_warning(tmp_path, caplog):
    sft(tmp_path).train()
    # what a run killed while writing checkpoint-6 leaves behind: weights, no trainer_state.json
    os.makedirs(tmp_path / "checkpoint-6")
    shutil.copy(tmp_path / "checkpoint-2" / "model.safetensors", tmp_path / "checkpoint-6")
    resumed, steps = sft(tmp_path, max_steps=4), RecordSteps()
    resumed.add_callback(steps)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        resumed.train(resume_from_checkpoint=True)
    assert "checkpoint-6" in caplog.text and "incomplete" in caplog.text
    assert steps.steps == [3, 4]  # went on from checkpoint-2
    with pytest.raises(ValueError, match="no trainer_state.json"):
        sft(tmp_path, max_steps=8).train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))


def test_a_save_interrupted_midway_leaves_no_checkpoint_folder(tmp_path):
    trainer = sft(tmp_path)

    def killed(output_dir):  # the RNG state is written after the weights and the optimizer
        raise KeyboardInterrupt("killed while saving")

    trainer._save_rng_state = killed
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert not [name for name in folders(tmp_path) if name.startswith("checkpoint-")]
    assert folders(tmp_path) == ["tmp-checkpoint-2"]  # the partial save, under a name resuming never picks
    with pytest.raises(ValueError, match="no complete checkpoint"):
        sft(tmp_path, max_steps=4).train(resume_from_checkpoint=True)

    again = sft(tmp_path)  # a run that saves the same step again replaces the leftover
    again.train()
    assert folders(tmp_path) == ["checkpoint-2"]
    assert os.path.isfile(tmp_path / "checkpoint-2" / "trainer_state.json")


def test_save_total_limit_still_rotates_checkpoints(tmp_path):
    sft(tmp_path, max_steps=6, save_steps=1, save_total_limit=2).train()
    assert folders(tmp_path) == ["checkpoint-5", "checkpoint-6"]


def test_the_best_checkpoint_is_named_by_its_final_folder(tmp_path):
    trainer = SFTTrainer(TINY, train_dataset=zen(), eval_dataset=zen().select(range(4)), args=SFTConfig(**config_kwargs(
        tmp_path, per_device_train_batch_size=2, max_steps=4, save_strategy="steps", save_steps=2,
        eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss")))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert os.path.basename(best) in ("checkpoint-2", "checkpoint-4") and os.path.isdir(best)
    assert folders(tmp_path) == ["checkpoint-2", "checkpoint-4"]
    for name in folders(tmp_path):  # a resumed run reads the best checkpoint from its trainer state
        with open(tmp_path / name / "trainer_state.json") as f:
            assert os.path.isdir(json.load(f)["best_model_checkpoint"])


# ------------------------------------------------------------------ reusing an output_dir

def test_a_fresh_run_refuses_an_earlier_runs_checkpoints_unless_told_to_overwrite(tmp_path, caplog):
    sft(tmp_path, max_steps=4).train()  # the earlier, longer run: checkpoint-2 and checkpoint-4
    assert folders(tmp_path) == ["checkpoint-2", "checkpoint-4"]
    with pytest.raises(ValueError, match=r"earlier run.*checkpoint-2.*checkpoint-4.*overwrite_output_dir"):
        sft(tmp_path).train()

    with caplog.at_level(logging.WARNING, logger="posttrain"):
        sft(tmp_path, overwrite_output_dir=True).train()
    assert "checkpoint-4" in caplog.text
    assert folders(tmp_path) == ["checkpoint-2"]  # the stale checkpoint-4 is gone; checkpoint-2 is the new run's
    resumed = sft(tmp_path, max_steps=3)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3


def test_a_run_without_checkpoints_in_the_folder_is_not_refused(tmp_path):
    sft(tmp_path, save_strategy="no").train()
    sft(tmp_path, save_strategy="no").train()  # final weights are overwritten, as transformers does
    assert os.path.isdir(tmp_path) and not folders(tmp_path)


# ------------------------------------------------------------------ seeds

def first_loss_and_head(tmp_path, seed: int):
    args = RewardConfig(**config_kwargs(tmp_path, max_steps=1, seed=seed))
    causal_lm = str(tiny_model_path("tiny-qwen2"))  # a causal-LM folder: the score head is new, drawn at random
    trainer = RewardTrainer(causal_lm, args=args, train_dataset=zen("preference"))
    head = trainer.model.score.weight.detach().clone()
    trainer.train()
    return trainer.state.log_history[0]["loss"], head


def test_same_seed_same_fresh_score_head_and_first_loss(tmp_path):
    torch.manual_seed(123)  # whatever the global RNG holds before, the seed decides
    loss_a, head_a = first_loss_and_head(tmp_path / "a", seed=0)
    torch.rand(10)
    loss_b, head_b = first_loss_and_head(tmp_path / "b", seed=0)
    loss_c, head_c = first_loss_and_head(tmp_path / "c", seed=1)
    assert torch.equal(head_a, head_b) and loss_a == loss_b
    assert not torch.equal(head_a, head_c) and loss_a != loss_c


# ------------------------------------------------------------------ empty data

@pytest.mark.parametrize("make", [
    lambda path: SFTTrainer(TINY, args=SFTConfig(output_dir=path), train_dataset=Dataset.from_dict({"text": []})),
    lambda path: RewardTrainer(TINY, args=RewardConfig(output_dir=path),
                               train_dataset=Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []})),
    lambda path: DPOTrainer(TINY, args=DPOConfig(output_dir=path), train_dataset=[]),
], ids=["sft", "reward", "dpo"])
def test_an_empty_train_dataset_is_refused_at_construction(tmp_path, make):
    with pytest.raises(ValueError, match=r"train_dataset is empty \(0 rows\)"):
        make(str(tmp_path))


# ------------------------------------------------------------------ an online run's sample log

def test_grpo_completions_log_one_file_per_run_and_markup_printed_literally(tmp_path, capsys):
    from tests.helpers.online import first_token_reward, online_args, prompts

    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    data = prompts(8).map(lambda row: {"prompt": "[INST] " + row["prompt"] + " [/INST] [bold]"})
    for _ in range(2):
        args = GRPOConfig(**online_args(tmp_path, num_generations=4, log_completions=True, max_steps=1))
        GRPOTrainer(TINY, reward_funcs=first_token_reward, args=args, train_dataset=data).train()
    assert "[/INST] [bold]" in capsys.readouterr().out
    for name in ("completions.jsonl", "completions.1.jsonl"):  # the first run's rows moved aside, not appended to
        with open(tmp_path / name) as f:
            steps = [json.loads(line)["step"] for line in f]
        assert steps and set(steps) == {1}, (name, steps)
