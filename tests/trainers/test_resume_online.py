"""Resuming the online trainers: stopped (or killed) after step k and resumed from checkpoint-k, a run ends
with the same weights (the critic's included) and logs the same numbers, `episode` included, as the run
that was never interrupted: bit-identical on CPU.

Each case resumes in the middle of an epoch (the dataset holds more generation batches than were trained)
unless it says otherwise; cases with several optimizer steps per generation batch resume in the middle of
one, from the micro-batches the checkpoint keeps.
"""

import os

import pytest
import torch
from tests.helpers.online import first_token_reward, online_args, prompts
from tests.helpers.resume import (assert_resumes_identically, assert_same_run, killed_at_save, logged_numbers,
                                  run_fields, trained_state)

from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.base import STATE_FILE
from posttrain.trainers.ppo import PPOConfig, PPOTrainer
from posttrain.trainers.reinforce_pp import ReinforcePPConfig, ReinforcePPTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer


def grpo(n_prompts: int = 6, **fields):
    """GRPO, 4 completions per prompt, 2 prompts per optimizer step, a KL term (so a reference model)."""
    overrides = {key: fields.pop(key) for key in list(fields) if key not in run_fields("", 0, 1)}
    args = GRPOConfig(**{**online_args(fields["output_dir"], num_generations=4, beta=0.1), **overrides, **fields})
    return GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts(n_prompts))


def test_grpo_resumes_mid_epoch_with_replayed_forward(tmp_path):
    # 4 prompts = 2 steps an epoch: resumed after step 1, step 2 ends epoch 0 and step 3 starts epoch 1
    resumed = assert_resumes_identically(lambda **f: grpo(4, **f), tmp_path, max_steps=3, stop_at=1)
    assert resumed.replays  # the sampler's linear outputs were used, before and after the resume
    episodes = [e["episode"] for e in resumed.state.log_history if "episode" in e]
    assert episodes == [8, 16, 24]  # it continues, 8 completions a step


def test_grpo_resumes_at_epoch_boundary(tmp_path):
    assert_resumes_identically(lambda **f: grpo(4, **f), tmp_path, max_steps=3, stop_at=2)  # 2 steps an epoch


def test_grpo_resumes_inside_a_generation_batch(tmp_path):
    # steps_per_generation 4 > gradient_accumulation_steps 2: one generation batch (4 prompts, the whole epoch)
    # feeds 2 optimizer steps; stopped after step 1, the resumed run trains step 2 on the second half of the
    # batch it kept, then step 3 on a new one
    def make(**fields):
        return grpo(6, steps_per_generation=4, **fields)

    resumed = assert_resumes_identically(make, tmp_path, max_steps=3, stop_at=1)
    saved = torch.load(tmp_path / "stopped" / "checkpoint-1" / STATE_FILE, weights_only=True)
    in_progress = saved["_generation_in_progress"]
    assert len(in_progress["buffer"]) == 4 and in_progress["next_micro"] == 2  # micro-batches not yet trained on
    assert not resumed.replays


def test_grpo_with_synced_reference_resumes(tmp_path):
    # the reference moves halfway to the policy after every step: it is part of the checkpoint
    resumed = assert_resumes_identically(lambda **f: grpo(4, sync_ref_model=True, ref_model_sync_steps=1,
                                                          ref_model_mixup_alpha=0.5, **f),
                                         tmp_path, max_steps=3, stop_at=1)
    assert any(k.startswith("ref_model.") for k in trained_state(resumed))


def test_rloo_classic_defaults_resume_inside_a_generation_batch(tmp_path):
    # num_ppo_epochs = 4 by default: 4 optimizer steps on each batch of 4 prompts x 2, the micro-batches
    # reshuffled for each pass; stopped after step 3, in the middle of the first batch, step 5 on the second
    def make(**fields):
        return RLOOTrainer(RLOOConfig(**{**online_args(fields["output_dir"]), **fields}), None, "posttrain/tiny-qwen2",
                           None, first_token_reward, prompts(8))

    resumed = assert_resumes_identically(make, tmp_path, max_steps=5, stop_at=3)
    assert resumed.args.num_iterations == 4 and resumed.optimizer_steps_per_generation == 4


def test_rloo_one_pass_resumes(tmp_path):
    def make(**fields):
        args = RLOOConfig(**{**online_args(fields["output_dir"], num_ppo_epochs=1), **fields})
        return RLOOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts(12))

    assert_resumes_identically(make, tmp_path, max_steps=3, stop_at=1)


def test_ppo_with_value_head_resumes(tmp_path):
    # 2 PPO epochs: each batch of 8 prompts (one an epoch) feeds 2 optimizer steps; stopped after step 1
    def make(**fields):
        args = PPOConfig(**{**online_args(fields["output_dir"], num_ppo_epochs=2), **fields})
        return PPOTrainer(args=args, model="posttrain/tiny-qwen2", reward_funcs=first_token_reward,
                          train_dataset=prompts(12))

    resumed = assert_resumes_identically(make, tmp_path, max_steps=3, stop_at=1)
    assert any(k.startswith("model.v_head.") for k in trained_state(resumed))
    assert resumed.model.v_head.weight.abs().sum() > 0  # the head trained (it starts at zero)


def test_ppo_with_separate_value_model_resumes(tmp_path):
    def make(**fields):
        args = PPOConfig(**{**online_args(fields["output_dir"], num_ppo_epochs=2), **fields})
        return PPOTrainer(args=args, model="posttrain/tiny-qwen2", reward_funcs=first_token_reward,
                          train_dataset=prompts(12), value_model="posttrain/tiny-qwen2-seqcls")

    resumed = assert_resumes_identically(make, tmp_path, max_steps=3, stop_at=1)
    assert any(k.startswith("model.value_model.") for k in trained_state(resumed))


@pytest.mark.parametrize("trainer", ["grpo", "ppo"])
def test_lora_resumes(tmp_path, trainer):
    # the adapter is made (randomly) when the trainer is built: seeded, so every run starts from the same one
    from peft import LoraConfig

    def make(**fields):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        if trainer == "grpo":
            args = GRPOConfig(**{**online_args(fields["output_dir"], num_generations=4, beta=0.1), **fields})
            return GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts(4),
                               peft_config=lora)
        args = PPOConfig(**{**online_args(fields["output_dir"], num_ppo_epochs=1), **fields})
        return PPOTrainer(args=args, model="posttrain/tiny-qwen2", reward_funcs=first_token_reward,
                          train_dataset=prompts(8), peft_config=lora)

    resumed = assert_resumes_identically(make, tmp_path, max_steps=3, stop_at=1)
    assert any("lora_A" in k for k in trained_state(resumed))


def test_reinforce_pp_resumes(tmp_path):
    def make(**fields):
        args = ReinforcePPConfig(**{**online_args(fields["output_dir"], num_generations=4), **fields})
        return ReinforcePPTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts(4))

    assert_resumes_identically(make, tmp_path, max_steps=3, stop_at=1)


def test_grpo_resumes_after_sigkill(tmp_path):
    full = grpo(**run_fields(tmp_path / "full", 3, 2))
    full.train()
    expected_state, expected_logs = trained_state(full), logged_numbers(full, 2)
    del full

    killed_at_save(tmp_path, os.path.dirname(__file__), 'from test_resume_online import grpo',
                   'grpo(**run_fields(output_dir, 3, 2))')

    resumed = grpo(**run_fields(tmp_path / "killed", 3, 2))
    resumed.train(resume_from_checkpoint=True)  # the latest checkpoint: checkpoint-2
    assert_same_run(resumed, expected_state, expected_logs, max_steps=3, stop_at=2)


def test_ppo_step_refuses_a_nan_score(tmp_path):
    args = PPOConfig(**online_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                                   num_ppo_epochs=1))
    trainer = PPOTrainer(args=args, model="posttrain/tiny-qwen2", train_dataset=prompts())
    batch = next(iter(trainer.dataloader))
    responses = trainer.generate(batch["input_ids"], max_new_tokens=4)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    scores = [torch.tensor(1.0), torch.tensor(0.5), torch.tensor(float("nan")), torch.tensor(0.0)]
    with pytest.raises(ValueError, match=r"step\(\) scores returned NaN for sample 2"):
        trainer.step(batch["input_ids"], responses, scores)
    with pytest.raises(ValueError, match="for sample 0; rewards must be finite"):
        trainer.step(batch["input_ids"], responses, [float("inf"), 0.0, 0.0, 0.0])
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    stats = trainer.step(batch["input_ids"], responses, [1.0, 0.5, 0.0, 2.0])  # finite scores still train
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
