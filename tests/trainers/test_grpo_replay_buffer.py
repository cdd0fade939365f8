"""GRPOWithReplayBufferTrainer: the buffer's priorities and eviction by hand, zero-variance groups replaced by
buffered ones, every parameter trained, and a bit-identical resume with the buffer in the checkpoint."""

import math

import pytest
import torch
from tests.helpers.online import ONLINE_METRICS, first_token_reward, online_args, prompts, train_and_check
from tests.helpers.resume import assert_resumes_identically

from posttrain.rollout.generate import Rollout
from posttrain.trainers.grpo_replay_buffer import (GroupReplayBuffer, GRPOWithReplayBufferConfig,
                                                   GRPOWithReplayBufferTrainer, join_groups, split_groups)


def group(scores, token=1):
    k = len(scores)
    return {"prompt_ids": [[5, 6]] * k, "completion_ids": torch.full((k, 2), token), "completion_mask": torch.ones(k, 2),
            "logprobs": torch.zeros(k, 2), "is_truncated": torch.zeros(k, dtype=torch.bool),
            "scores": torch.tensor(scores, dtype=torch.float32)}


def test_priority_is_the_sum_of_absolute_advantages_times_the_std():
    # scores 0, 0, 1, 1: mean 0.5, sample std 1/sqrt(3); |A_i| = 0.5 / (std + 1e-4) each
    std = 1 / math.sqrt(3)
    assert GroupReplayBuffer.priority(torch.tensor([0.0, 0.0, 1.0, 1.0])) == pytest.approx(4 * 0.5 / (std + 1e-4) * std, rel=1e-6)
    assert GroupReplayBuffer.priority(torch.tensor([2.0, 2.0])) == 0.0


def test_the_buffer_keeps_the_highest_priorities_and_samples_by_them():
    buffer = GroupReplayBuffer(2, seed=0)
    for scores, token in [([0.0, 1.0], 1), ([0.0, 3.0], 2), ([0.0, 0.5], 3), ([0.0, 2.0], 4)]:
        buffer.add(group(scores, token))
    kept = sorted(int(g["completion_ids"][0, 0]) for g in buffer.groups)
    assert kept == [2, 4]  # priorities |A| std: 3 / 2 and 2 / 2 beat 1 / 2 and 0.5 / 2
    drawn = [int(g["completion_ids"][0, 0]) for _ in range(400) for g in buffer.sample(1)]
    assert abs(drawn.count(2) / 400 - 0.6) < 0.08  # probability 3 / (3 + 2)
    assert sorted(int(g["completion_ids"][0, 0]) for g in buffer.sample(2)) == [2, 4]  # without replacement
    state = buffer.state_dict()
    other = GroupReplayBuffer(2, seed=1)
    other.load_state_dict(state)
    assert [int(g["completion_ids"][0, 0]) for g in other.sample(2)] == [
        int(g["completion_ids"][0, 0]) for g in buffer.sample(2)]


def test_split_and_join_are_inverse_up_to_padding():
    rollout = Rollout(prompt_ids=torch.tensor([[0, 7], [0, 7], [8, 9], [8, 9]]),
                      prompt_mask=torch.tensor([[0, 1], [0, 1], [1, 1], [1, 1]]),
                      completion_ids=torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6], [7, 0, 0]]),
                      completion_mask=torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]]),
                      logprobs=torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0], [-4.0, -5.0, -6.0], [-7.0, 0, 0]]),
                      is_truncated=torch.tensor([False, False, True, False]))
    groups = split_groups(rollout, torch.tensor([1.0, 0.0, 2.0, 2.0]), 2)
    assert groups[0]["prompt_ids"] == [[7], [7]] and groups[0]["completion_ids"].shape == (2, 2)
    back, scores = join_groups(groups[::-1], pad_token_id=0)  # the second group first
    assert back.prompt_ids.tolist() == [[8, 9], [8, 9], [0, 7], [0, 7]]
    assert back.completion_ids.tolist() == [[4, 5, 6], [7, 0, 0], [1, 2, 0], [3, 0, 0]]
    assert back.logprobs.dtype == torch.float32 and back.logprobs[2].tolist() == [-1.0, -2.0, 0.0]
    assert back.is_truncated.tolist() == [True, False, False, False] and scores.tolist() == [2.0, 2.0, 1.0, 0.0]


def make(tmp_path=None, n=8, **fields):
    out = fields.pop("output_dir", tmp_path)
    args = GRPOWithReplayBufferConfig(**{**online_args(out, num_generations=4, beta=0.1), **fields})
    return GRPOWithReplayBufferTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts(n))


def test_zero_variance_groups_are_replaced_from_the_buffer(tmp_path):
    trainer = make(tmp_path)
    keep = group([0.0, 1.0, 2.0, 4.0], token=9)
    trainer.replay_buffer.add(keep)
    flat = group([1.0] * 4, token=3)
    rollout, scores = join_groups([flat, group([0.0, 1.0, 0.0, 0.0], token=4)], trainer.processing_class.pad_token_id)
    new_rollout, new_scores = trainer.refill(rollout, scores)
    assert new_rollout.completion_ids[:4, 0].tolist() == [9] * 4  # the flat group gave way to the buffered one
    assert new_scores[:4].tolist() == [0.0, 1.0, 2.0, 4.0] and new_rollout.completion_ids[4:, 0].tolist() == [4] * 4
    assert len(trainer.replay_buffer.groups) == 2  # the batch's group with variance joined the buffer


def test_trains_every_parameter(tmp_path):
    train_and_check(make(tmp_path), metrics=ONLINE_METRICS)


def test_resumes_identically_with_its_buffer(tmp_path):
    assert_resumes_identically(lambda **f: make(n=6, **f), tmp_path, max_steps=3, stop_at=1)
