"""GRPO: the TRL-style call, a smoke run with every metric, variants, and learning on `reverse`."""

import json
import os

import pytest
from tests.helpers.online import assert_learns, learning_args, first_token_reward, online_args, prompts, train_and_check

from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


def test_trl_style_call_with_default_num_generations(tmp_path):
    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    dataset = prompts(4)
    trainer = GRPOTrainer(
        model="posttrain/tiny-qwen2",
        reward_funcs=reward_len,
        args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                        logging_steps=2, max_steps=2, max_completion_length=16, disable_tqdm=True),
        train_dataset=dataset,
    )
    assert trainer.args.num_generations == 8 and trainer.ref_model is None
    trainer.train()
    assert trainer.state.global_step == 2 and "reward" in trainer.state.log_history[0]


def test_smoke_every_parameter_changes_and_metrics_are_finite(tmp_path):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, beta=0.1, log_completions=True,
                                    num_completions_to_print=2))
    trainer = GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts())
    train_and_check(trainer)
    with open(os.path.join(tmp_path, "completions.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert rows and {"step", "prompt", "completion", "first_token_reward"} <= set(rows[0])


def test_bf16_autocast_on_cpu_trains(tmp_path):
    """bf16=True on CPU: the prefill fills the KV cache in bfloat16, so the sampler steps through the model's own
    forward instead of the float32 lean step (which once met the bfloat16 cache and raised)."""
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, beta=0.1, bf16=True, use_cpu=True))
    train_and_check(GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts()))


def test_variants_run(tmp_path):
    """GSPO sequence ratio, clip-higher, bnpo, several passes and steps per generation batch, stop strings."""
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, importance_sampling_level="sequence",
                                    epsilon_high=0.28, loss_type="bnpo", num_iterations=2, steps_per_generation=4,
                                    scale_rewards="batch", stop_strings=["7"], max_steps=4))
    trainer = GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts())
    assert not trainer.old_is_current and trainer.optimizer_steps_per_generation == 4
    logged = train_and_check(trainer, metrics=["loss/policy_avg", "val/ratio", "policy/clipfrac_avg"])
    assert max(logged["policy/approxkl_avg"]) > 0  # later passes see a moved policy


@pytest.mark.slow
def test_grpo_raises_heldout_reward(sft_reverse_path, tmp_path):
    """GRPO from the partially SFT-trained tiny model raises held-out greedy accuracy and sampled reward."""
    from posttrain.tasks.builtin import digit_match_reward, task_dataset

    train = task_dataset("reverse", "train").remove_columns("completion")
    trainer = GRPOTrainer(sft_reverse_path, digit_match_reward, train_dataset=train,
                          args=GRPOConfig(**learning_args(tmp_path, num_generations=8)))
    assert_learns(trainer, "GRPO")


def test_cli_with_builtin_and_module_reward_functions(tmp_path):
    from posttrain.cli import run

    trainer = run(["grpo", "--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "reverse",
                   "--reward_funcs", "digit_match", "tests.helpers.online:first_token_reward", "--num_generations", "4",
                   "--per_device_train_batch_size", "8", "--max_completion_length", "6", "--max_steps", "1",
                   "--output_dir", str(tmp_path), "--disable_tqdm", "true"])
    assert trainer.reward_scorer.names == ["digit_match_reward", "first_token_reward"]
    assert os.path.exists(tmp_path / "model.safetensors")
