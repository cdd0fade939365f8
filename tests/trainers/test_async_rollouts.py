"""Asynchronous rollouts (max_staleness, trainers/online_async.py): max_staleness=0 is the synchronous engine,
each batch is sampled by the policy max_staleness steps before (its behaviour log-probs are that policy's), a
run does not depend on the threads' timing, resuming after SIGKILL is bit-identical, and learning per sample
matches the synchronous engine's (slow)."""

import copy
import os
import threading
import time

import pytest
import torch
from tests.helpers.online import first_token_reward, learning_args, online_args, prompts
from tests.helpers.resume import assert_same_run, killed_at_save, logged_numbers, run_fields, trained_state
from transformers import TrainerCallback

from posttrain.forward.completions import completion_logprobs
from posttrain.trainers.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from posttrain.trainers.base import STATE_FILE
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.ppo import PPOConfig, PPOTrainer


def grpo(n_prompts: int = 8, reward=first_token_reward, **fields):
    """GRPO on the tiny model, 4 completions per prompt, one generation batch (2 prompts) per optimizer step."""
    overrides = {key: fields.pop(key) for key in list(fields) if key not in run_fields("", 0, 1)}
    args = GRPOConfig(**{**online_args(fields["output_dir"], num_generations=4, beta=0.1, learning_rate=1e-2),
                         **overrides, **fields})
    return GRPOTrainer("posttrain/tiny-qwen2", reward, args=args, train_dataset=prompts(n_prompts))


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def test_max_staleness_0_is_the_synchronous_engine(tmp_path):
    assert AsyncGRPOConfig(output_dir=str(tmp_path)).max_staleness == 4  # TRL's default
    sync = grpo(**run_fields(tmp_path / "sync", 3, 3))
    sync.train()
    args = AsyncGRPOConfig(**online_args(tmp_path / "async0", num_generations=4, beta=0.1, learning_rate=1e-2,
                                         max_steps=3, max_staleness=0))
    off = AsyncGRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts(8))
    assert off.rollouts is None and off.old_is_current  # no background sampler: the same code path
    off.train()
    expected = weights(sync)
    assert all(torch.equal(v, expected[k]) for k, v in weights(off).items())
    assert logged_numbers(off, 0) == logged_numbers(sync, 0)


class _Snapshots(TrainerCallback):
    """The policy's weights at the start of each optimizer step."""

    def __init__(self, trainer):
        self.trainer, self.at = trainer, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.at[state.global_step] = weights(self.trainer)


def test_each_batch_is_sampled_by_the_policy_max_staleness_steps_before(tmp_path):
    trainer = grpo(**run_fields(tmp_path, 4, 4), max_staleness=1)
    assert trainer.rollouts is not None and not trainer.old_is_current and not trainer.replays
    snapshots, batches = _Snapshots(trainer), []
    trainer.add_callback(snapshots)
    build = trainer.build_experience

    def keep(rollout, scores):  # each batch's rollout and the step that trains it
        batches.append((trainer.state.global_step, copy.deepcopy(rollout)))
        return build(rollout, scores)

    trainer.build_experience = keep
    trainer.train()
    assert [step for step, _ in batches] == [0, 1, 2, 3]
    staleness = [e["rollout/staleness"] for e in trainer.state.log_history if "rollout/staleness" in e]
    assert staleness == [0.0, 1.0, 1.0, 1.0]  # the first batch has nothing sampled ahead
    model = copy.deepcopy(trainer.policy)
    for step, rollout in batches:
        def logp_under(state):
            model.load_state_dict(state)
            with torch.no_grad():
                logp, _ = completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids,
                                              rollout.completion_mask, trainer.args.temperature)
            return torch.where(rollout.completion_mask.bool(), logp, 0.0)

        sampler = max(step - 1, 0)
        # the behaviour log-probs (old_logp, the ratio's denominator) are those of the policy that sampled ...
        torch.testing.assert_close(rollout.logprobs, logp_under(snapshots.at[sampler]), atol=2e-4, rtol=0)
        if step > 0:  # ... not the current one's, which has moved on
            assert (rollout.logprobs - logp_under(snapshots.at[step])).abs().max() > 1e-3


def test_a_run_does_not_depend_on_the_threads_timing(tmp_path):
    def slow_reward(completion_ids, **kwargs):  # an I/O-bound reward: the sampler finishes after the step
        time.sleep(0.3)
        return first_token_reward(completion_ids)
    slow_reward.__name__ = "first_token_reward"  # the same metric names

    fast = grpo(**run_fields(tmp_path / "fast", 3, 3), max_staleness=1)
    fast.train()
    slow = grpo(reward=slow_reward, **run_fields(tmp_path / "slow", 3, 3), max_staleness=1)
    slow.train()
    expected = weights(fast)
    assert all(torch.equal(v, expected[k]) for k, v in weights(slow).items())
    assert logged_numbers(slow, 0) == logged_numbers(fast, 0)  # timings left out


def test_resumes_identically_after_sigkill_with_a_batch_in_flight(tmp_path):
    full = grpo(**run_fields(tmp_path / "full", 4, 2), max_staleness=1)
    full.train()
    expected_state, expected_logs = trained_state(full), logged_numbers(full, 2)
    del full

    killed_at_save(tmp_path, os.path.dirname(__file__), 'from test_async_rollouts import grpo',
                   'grpo(**run_fields(output_dir, 4, 2), max_staleness=1)')
    saved = torch.load(tmp_path / "killed" / "checkpoint-2" / STATE_FILE, weights_only=True)
    # the third generation batch (numbered from 0), sampled by the weights before the second step: saved
    assert [ordinal for ordinal, _ in saved["_rollouts_in_flight"]] == [2]

    resumed = grpo(**run_fields(tmp_path / "killed", 4, 2), max_staleness=1)
    resumed.train(resume_from_checkpoint=True)
    assert_same_run(resumed, expected_state, expected_logs, max_steps=4, stop_at=2)


def test_ppo_trains_with_a_batch_sampled_ahead(tmp_path):
    args = PPOConfig(**online_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                                   num_ppo_epochs=1, max_staleness=1, max_steps=3))
    trainer = PPOTrainer(args=args, model="posttrain/tiny-qwen2", reward_funcs=first_token_reward,
                         train_dataset=prompts())
    before = weights(trainer)
    trainer.train()
    assert trainer.rollouts is not None
    assert any(not torch.equal(v, before[k]) for k, v in weights(trainer).items())
    staleness = [e["rollout/staleness"] for e in trainer.state.log_history if "rollout/staleness" in e]
    assert staleness == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("fields, message", [
    (dict(max_staleness=1, steps_per_generation=4), "max_staleness=1: a generation batch sampled one batch ahead "
                                                    "is 2 optimizer steps old"),
    (dict(max_staleness=-1), "max_staleness must be >= 0"),
])
def test_bad_staleness_is_refused(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**online_args(tmp_path, num_generations=4, **fields))


def test_a_streamed_dataset_is_refused(tmp_path):
    from datasets import IterableDataset

    stream = IterableDataset.from_generator(lambda: iter(prompts(8)))
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_staleness=1))
    with pytest.raises(ValueError, match="needs a map-style train_dataset"):
        GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=stream)


def test_sync_reward_functions_run_at_the_same_time():
    from posttrain.rollout.rewards import RewardScorer

    barrier = threading.Barrier(2, timeout=10)  # each waits for the other: called one after the other, it breaks

    def judge_a(completions, **kwargs):
        barrier.wait()
        return [1.0] * len(completions)

    def judge_b(completions, **kwargs):
        barrier.wait()
        return [2.0] * len(completions)

    _, total = RewardScorer([judge_a, judge_b])(["p", "q"], ["a", "b"], [[1], [2]], {})
    assert total.tolist() == [3.0, 3.0]


@pytest.mark.slow
def test_learns_as_well_per_sample_with_a_batch_sampled_ahead(sft_reverse_path, tmp_path):
    """From the partially SFT-trained tiny model on `reverse`: 60 steps of 64 samples with max_staleness=1 and 0;
    the asynchronous run's held-out sampled reward rises as much (within 0.05) as the synchronous one's."""
    from tests.helpers.online import heldout_scores

    from posttrain.tasks.builtin import digit_match_reward, task_dataset

    train = task_dataset("reverse", "train").remove_columns("completion")
    results = {}
    for staleness in (0, 1):
        trainer = GRPOTrainer(sft_reverse_path, digit_match_reward, train_dataset=train, args=GRPOConfig(
            **learning_args(tmp_path / str(staleness), num_generations=8, max_steps=60, max_staleness=staleness)))
        before = heldout_scores(trainer)
        trainer.train()
        results[staleness] = (before, heldout_scores(trainer))
        print(f"max_staleness={staleness}: held-out greedy accuracy {before[0]:.2f} -> {results[staleness][1][0]:.2f}, "
              f"sampled reward {before[1]:.3f} -> {results[staleness][1][1]:.3f}")
    (before, sync), (_, async_) = results[0], results[1]
    assert async_[1] > before[1] + 0.15, results
    assert async_[1] > sync[1] - 0.05, results


def _preset(name: str):
    """(config class, trainer class, extra config fields, extra trainer arguments) of an online preset."""
    import importlib

    module, config, trainer, fields, kwargs = {
        "rloo": ("rloo", "RLOOConfig", "RLOOTrainer", {"num_iterations": 1}, {}),
        "reinforce_pp": ("reinforce_pp", "ReinforcePPConfig", "ReinforcePPTrainer", {}, {}),
        "gfpo": ("gfpo", "GFPOConfig", "GFPOTrainer", {"num_generations": 4, "num_remains_in_group": 2},
                 {"group_filter_func": lambda group_completions, **kw: [[-len(c) for c in group]
                                                                        for group in group_completions]}),
        "gmpo": ("gmpo", "GMPOConfig", "GMPOTrainer", {"num_generations": 4}, {}),
        "gspo_token": ("gspo_token", "GSPOTokenConfig", "GSPOTokenTrainer", {"num_generations": 4}, {}),
        "replay_buffer": ("grpo_replay_buffer", "GRPOWithReplayBufferConfig", "GRPOWithReplayBufferTrainer",
                          {"num_generations": 4}, {}),
        "dr_grpo": ("grpo", "GRPOConfig", "GRPOTrainer", {"num_generations": 4, "loss_type": "dr_grpo"}, {}),
        "a2po": ("a2po", "A2POConfig", "A2POTrainer", {"num_value_samples": 2, "per_device_train_batch_size": 2}, {}),
        "minillm": ("minillm", "MiniLLMConfig", "MiniLLMTrainer", {"num_generations": 2},
                    {"teacher_model": "posttrain/tiny-llama"}),
    }[name]
    mod = importlib.import_module(f"posttrain.trainers.{module}")
    return getattr(mod, config), getattr(mod, trainer), fields, kwargs


@pytest.mark.parametrize("name", ["rloo", "reinforce_pp", "gfpo", "gmpo", "gspo_token", "replay_buffer", "dr_grpo",
                                  "a2po", "minillm"])
def test_every_online_preset_trains_with_a_batch_sampled_ahead(tmp_path, name):
    """One engine option for every online method (PPO and its critic: test_ppo_trains_with_a_batch_sampled_ahead):
    each preset's second batch is the one sampled a step ahead, and every trainable parameter moves."""
    from tests.helpers.online import train_and_check

    config_class, trainer_class, fields, kwargs = _preset(name)
    args = config_class(**online_args(tmp_path, learning_rate=1e-2, max_staleness=1, **fields))
    trainer = trainer_class("posttrain/tiny-qwen2", reward_funcs=first_token_reward, args=args,
                            train_dataset=prompts(8), **kwargs)
    assert trainer.rollouts is not None and not trainer.old_is_current
    logged = train_and_check(trainer, metrics=["rollout/staleness", "loss"], reward_names=("first_token_reward",))
    assert logged["rollout/staleness"] == [0.0, 1.0]


@pytest.mark.parametrize("module, config, trainer, kwargs", [
    ("distillation", "DistillationConfig", "DistillationTrainer", {"teacher_model": "posttrain/tiny-llama"}),
    ("online_dpo", "OnlineDPOConfig", "OnlineDPOTrainer", {"reward_funcs": first_token_reward}),
])
def test_presets_that_sample_with_more_than_the_policy_refuse(tmp_path, module, config, trainer, kwargs):
    import importlib

    mod = importlib.import_module(f"posttrain.trainers.{module}")
    args = getattr(mod, config)(**online_args(tmp_path, max_staleness=1))
    with pytest.raises(ValueError, match=r"samples with more than the policy \(a teacher, the reference\) and does "
                                         "not run asynchronous rollouts: set max_staleness=0"):
        getattr(mod, trainer)("posttrain/tiny-qwen2", args=args, train_dataset=prompts(8), **kwargs)


def test_sharded_weights_are_refused():
    """FSDP2 / ZeRO-3: the background sampler's whole copy would run forwards that are collectives of their own."""
    import types

    from posttrain.trainers.online_async import check_background_sampling

    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(), distributed_type=None, is_fsdp2=True)
    trainer = types.SimpleNamespace(accelerator=accelerator, rollout_func=None, vllm=None)
    with pytest.raises(ValueError, match=r"with sharded weights \(fsdp2\) each of its forwards would be a collective"):
        check_background_sampling(trainer)
    accelerator.is_fsdp2 = False
    check_background_sampling(trainer)  # DDP or one process: allowed
