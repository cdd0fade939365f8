"""DAPO in the online engine: dynamic sampling (`filter_groups_enable`: groups whose rewards are all equal are
dropped and more prompts drawn until the batch is full, at most `max_num_gen_batches` generation batches), its
extra prompts' place kept by checkpoints (a resumed run is bit-identical, from a map-style dataset or a stream),
and the overlong reward shaping step (`overlong_buffer_len`) next to `mask_truncated_completions`."""

import pytest
import torch
from datasets import IterableDataset
from tests.helpers.online import assert_learns, first_token_reward, learning_args, online_args, prompts, train_and_check
from tests.helpers.resume import assert_resumes_identically

from posttrain.core.shaping import overlong_penalty
from posttrain.rollout.generate import Rollout
from posttrain.trainers.base import STATE_FILE
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

MODEL = "posttrain/tiny-qwen2"
DS_METRICS = ["dynamic_sampling/gen_batches", "dynamic_sampling/groups_drawn", "dynamic_sampling/groups_dropped",
              "reward", "frac_reward_zero_std", "loss/policy_avg"]


def half_constant_reward(prompts, completion_ids, **kwargs):
    """1.0 for every completion of the prompts whose characters' codes sum to an even number (a group with no
    signal), else the first token's id mod 5 (varies between samples of the random tiny model)."""
    return [1.0 if sum(map(ord, p)) % 2 == 0 else float(ids[0] % 5) if ids else 0.0
            for p, ids in zip(prompts, completion_ids)]


def grpo(data=None, reward=half_constant_reward, **fields):
    args = GRPOConfig(**{**online_args(fields.pop("output_dir"), num_generations=4, filter_groups_enable=True),
                         **fields})
    return GRPOTrainer(MODEL, reward, args=args, train_dataset=prompts(16) if data is None else data)


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def test_constant_groups_are_dropped_and_more_prompts_drawn(tmp_path):
    seen = []

    def reward(prompts, completion_ids, **kwargs):
        seen.extend(prompts[::4])
        return half_constant_reward(prompts, completion_ids)

    trainer = grpo(reward=reward, output_dir=tmp_path, max_steps=3)
    assert not trainer.replays  # the batch joins rows of several rollouts: no record of one
    train_and_check(trainer, metrics=DS_METRICS, reward_names=("reward",))
    assert logged(trainer, "frac_reward_zero_std") == [0.0, 0.0, 0.0]  # only groups whose rewards differ trained
    drawn, dropped = logged(trainer, "dynamic_sampling/groups_drawn"), logged(trainer, "dynamic_sampling/groups_dropped")
    gen_batches = logged(trainer, "dynamic_sampling/gen_batches")
    assert sum(dropped) > 0 and max(gen_batches) > 1
    assert drawn == [2 * b for b in gen_batches]  # 2 prompts a generation batch
    assert len(seen) == sum(drawn)  # every drawn group was scored once
    constant = [p for p in seen if sum(map(ord, p)) % 2 == 0]
    assert sum(dropped) >= len(constant) > 0  # the constant groups were dropped (and any that tied by chance)
    # the extra prompts came from the top-up cursor, 2 a batch beyond each step's first
    position = trainer._top_up_position
    assert position["passes"] * 16 + position["prompts"] == 2 * (sum(gen_batches) - 3)


def test_too_many_generation_batches_is_a_clear_error(tmp_path):
    trainer = grpo(reward=lambda completions, **kw: [1.0] * len(completions), output_dir=tmp_path,
                   max_num_gen_batches=3)
    with pytest.raises(ValueError, match=r"drew max_num_gen_batches=3 generation batches and kept 0 of the 2 prompt "
                                         r"groups one needs .* raise max_num_gen_batches"):
        trainer.train()


def test_dynamic_sampling_needs_groups(tmp_path):
    with pytest.raises(ValueError, match="filter_groups_enable drops the groups .* set num_generations >= 2"):
        GRPOConfig(output_dir=str(tmp_path), num_generations=1, per_device_train_batch_size=2,
                   advantage_estimator="reinforce_pp", filter_groups_enable=True)  # an estimator without groups


def drew_more_after(trainer, step: int) -> bool:
    """Whether a step after `step` drew more than one generation batch (so the top-up cursor's place mattered)."""
    return any(e["dynamic_sampling/gen_batches"] > 1 for e in trainer.state.log_history
               if e.get("step", 0) > step and "dynamic_sampling/gen_batches" in e)


def test_resume_with_dynamic_sampling_is_identical(tmp_path):
    # stopped after step 1, inside the first epoch (16 prompts, 2 a step); the top-up cursor's place is saved
    resumed = assert_resumes_identically(lambda **f: grpo(**f), tmp_path, max_steps=3, stop_at=1)
    saved = torch.load(tmp_path / "stopped" / "checkpoint-1" / STATE_FILE, weights_only=True)
    assert saved["_top_up_position"]["prompts"] > 0
    assert drew_more_after(resumed, 1)


def test_resume_from_a_stream_with_dynamic_sampling_is_identical(tmp_path):
    rows = list(prompts(10))
    data = IterableDataset.from_generator(lambda: iter(rows))
    resumed = assert_resumes_identically(lambda **f: grpo(data, **f), tmp_path, max_steps=4, stop_at=2)
    assert drew_more_after(resumed, 2)


def test_overlong_shaping_next_to_masked_truncated_completions(tmp_path):
    """The reward metric and the advantages' input carry the overlong term of each completion's length; truncated
    completions (the full 6 tokens: the largest penalty) are still left out of the loss."""
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, overlong_buffer_len=3, overlong_penalty_factor=0.5,
                                    mask_truncated_completions=True))
    trainer = GRPOTrainer(MODEL, first_token_reward, args=args, train_dataset=prompts(8))
    pad = trainer.processing_class.pad_token_id
    lengths = torch.tensor([2, 3, 4, 5, 6, 6, 1, 6])
    mask = (torch.arange(6)[None, :] < lengths[:, None]).long()
    rollout = Rollout(prompt_ids=torch.tensor([[5, 6, 7]] * 4 + [[pad, 8, 9]] * 4),
                      prompt_mask=torch.tensor([[1, 1, 1]] * 4 + [[0, 1, 1]] * 4),
                      completion_ids=torch.where(mask.bool(), torch.arange(10, 58).view(8, 6), pad),
                      completion_mask=mask, logprobs=-1.0 * mask, is_truncated=lengths == 6)
    scores = torch.arange(8.0)
    micro = trainer.build_experience(rollout, scores)
    term = overlong_penalty(scores, lengths, overlong_buffer_len=3, max_completion_length=6,
                            overlong_penalty_factor=0.5)
    # by hand: 0 up to 3 tokens, then -0.5/3 a token
    assert term.tolist() == pytest.approx([0.0, 0.0, -1 / 6, -2 / 6, -0.5, -0.5, 0.0, -0.5])
    recorded = trainer.recorded_metrics()
    assert recorded["shaping/overlong"] == [pytest.approx(float(term.mean()))]
    assert recorded["reward"] == [pytest.approx(float((scores + term).mean()))]
    loss_mask = torch.cat([mb["loss_mask"].sum(1) for mb in micro])
    assert torch.equal(loss_mask == 0, rollout.is_truncated)


@pytest.mark.slow
def test_grpo_with_dynamic_sampling_raises_heldout_reward(sft_reverse_path, tmp_path):
    """GRPO with dynamic sampling from the partially SFT-trained tiny model raises held-out greedy accuracy and
    sampled reward, and some groups were dropped on the way."""
    from posttrain.tasks.builtin import digit_match_reward, task_dataset

    train = task_dataset("reverse", "train").remove_columns("completion")
    trainer = GRPOTrainer(sft_reverse_path, digit_match_reward, train_dataset=train,
                          args=GRPOConfig(**learning_args(tmp_path, num_generations=8,
                                                          filter_groups_enable=True)))
    assert_learns(trainer, "GRPO + dynamic sampling")
    assert sum(logged(trainer, "dynamic_sampling/groups_dropped")) > 0
    assert logged(trainer, "frac_reward_zero_std") and max(logged(trainer, "frac_reward_zero_std")) == 0.0


def test_overlong_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match=r"overlong_buffer_len \(tokens of the overlong buffer\) must be >= 1, got 0"):
        GRPOConfig(output_dir=str(tmp_path), overlong_buffer_len=0)
    with pytest.raises(ValueError, match="overlong_buffer_len=300 must be <= max_completion_length=256"):
        GRPOConfig(output_dir=str(tmp_path), overlong_buffer_len=300)
    with pytest.raises(ValueError, match=r"overlong_penalty_factor must be >= 0, got -1.0"):
        GRPOConfig(output_dir=str(tmp_path), overlong_buffer_len=16, overlong_penalty_factor=-1.0)


def test_dynamic_sampling_is_refused_with_asynchronous_rollouts(tmp_path):
    with pytest.raises(ValueError, match=r"filter_groups_enable .* \(max_staleness > 0\) .* set one of them off"):
        GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, filter_groups_enable=True, max_staleness=1)
