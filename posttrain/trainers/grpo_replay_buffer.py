"""GRPO with a replay buffer (TRL's GRPOWithReplayBufferTrainer, TRL <= 1.12 experimental).

A group whose completions all get the same reward has advantage 0 everywhere: it spends a generation and
teaches nothing. This preset keeps the most informative groups seen so far, the `replay_buffer_size` with
the highest priority Σ_i |A_i| σ (A the group-normalised advantages, σ the group's reward std), and when a
generation batch holds groups of zero reward variance it puts groups drawn from the buffer in their
place, each with probability proportional to its priority (without replacement while the buffer holds
enough). The batch then trains as GRPO's: advantages from the (stored) scores, the KL to the reference
from a fresh reference forward.

A preset of the online engine: GRPO's fields plus `replay_buffer_size`; `GroupReplayBuffer` below.

Departures: a replayed group's old log-probs are those of the policy that sampled it, but with one
optimizer step per generation batch the engine takes old = current (ratio 1) for every row, as TRL does
then. The buffer is per process (each process's groups stay on it) and is saved with checkpoints, so a
resumed run replays what the uninterrupted one would. No tools / environments (their rows carry episode
state the buffer does not keep); no recorded linear outputs (replayed rows were not decoded in this batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.core.advantages import GROUP_STD_EPS
from posttrain.data.collate import pad
from posttrain.rollout.combine import take_rows
from posttrain.rollout.generate import Rollout
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

ROW_FIELDS = ("completion_ids", "completion_mask", "logprobs")


class GroupReplayBuffer:
    """The `size` groups of highest priority seen so far. A group is a dict: `prompt_ids` (list of k token-id lists),
    the (k, C) `completion_ids` / `completion_mask` / `logprobs` trimmed to the group's longest completion,
    `is_truncated` (k,) and `scores` (k,)."""

    def __init__(self, size: int, seed: int):
        self.size, self.groups, self.priorities = size, [], []
        self.generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def priority(scores: Tensor) -> float:
        """Σ_i |A_i| σ of one group's scores (k,): A the group-normalised advantages, σ the sample std."""
        std = scores.std()
        return float(((scores - scores.mean()).abs() / (std + GROUP_STD_EPS)).sum() * std)

    def add(self, group: dict) -> None:
        """Keep `group` if the buffer has room or it outranks the buffer's lowest priority (which it replaces)."""
        p = self.priority(group["scores"])
        if len(self.groups) < self.size:
            self.groups.append(group)
            self.priorities.append(p)
        elif self.priorities and p > min(self.priorities):
            low = self.priorities.index(min(self.priorities))
            self.groups[low], self.priorities[low] = group, p

    def sample(self, n: int) -> list[dict]:
        """n groups drawn with probability proportional to priority; without replacement when the buffer holds n."""
        weights = torch.tensor(self.priorities, dtype=torch.float64)
        picked = torch.multinomial(weights, n, replacement=n > len(self.groups), generator=self.generator)
        return [self.groups[i] for i in picked.tolist()]

    def state_dict(self) -> dict:
        return {"groups": self.groups, "priorities": self.priorities, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.groups, self.priorities = list(state["groups"]), list(state["priorities"])
        self.generator.set_state(state["generator"])


def split_groups(rollout: Rollout, scores: Tensor, k: int) -> list[dict]:
    """The rollout's groups of k rows (prompt-major), each trimmed to its own widths."""
    groups = []
    for g in range(rollout.completion_ids.shape[0] // k):
        rows = slice(g * k, (g + 1) * k)
        width = max(int(rollout.completion_mask[rows].sum(1).max()), 1)
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(rollout.prompt_ids[rows], rollout.prompt_mask[rows])]
        groups.append({"prompt_ids": prompts, "is_truncated": rollout.is_truncated[rows].clone(),
                       "scores": scores[rows].detach().cpu().clone(),
                       **{f: getattr(rollout, f)[rows, :width].clone() for f in ROW_FIELDS}})
    return groups


def join_groups(groups: list[dict], pad_token_id: int) -> tuple[Rollout, Tensor]:
    """A rollout (prompts left-padded, completions right-padded) and its scores from groups, in order: each group
    as a rollout of its own, joined by `rollout.combine.take_rows`."""
    parts = [Rollout(prompt_ids=pad(g["prompt_ids"], pad_token_id, side="left"),
                     prompt_mask=pad([[1] * len(p) for p in g["prompt_ids"]], 0, side="left"),
                     completion_ids=g["completion_ids"].long(), completion_mask=g["completion_mask"].long(),
                     logprobs=g["logprobs"].float(), is_truncated=g["is_truncated"]) for g in groups]
    rows = torch.arange(sum(len(g["is_truncated"]) for g in groups))
    return take_rows(parts, rows, pad_token_id), torch.cat([g["scores"] for g in groups])


@dataclass
class GRPOWithReplayBufferConfig(GRPOConfig):
    """GRPO's configuration plus the replay buffer's size."""

    replay_buffer_size: int = field(default=64, metadata={"help": "Groups kept: the ones of highest Σ|A| x reward "
                                    "std seen so far; a generation batch's groups of zero reward variance are "
                                    "replaced by groups drawn from them (0: no buffer, plain GRPO)."})

    def _check(self):
        if self.replay_buffer_size < 0:
            raise ValueError(f"replay_buffer_size must be >= 0 (0: no buffer), got {self.replay_buffer_size}")
        super()._check()


class GRPOWithReplayBufferTrainer(GRPOTrainer):
    """GRPO with a replay buffer of high-variance groups; same signature as GRPOTrainer (no tools)."""

    config_class = GRPOWithReplayBufferConfig
    _tag = "GRPO-replay-buffer"
    checkpointed = GRPOTrainer.checkpointed + ("replay_buffer",)

    def __init__(self, *args, **kwargs):
        if kwargs.get("tools") or kwargs.get("environment_factory"):
            raise ValueError("GRPOWithReplayBufferTrainer does not replay multi-turn episodes: drop tools= / "
                             "environment_factory=, or use GRPOTrainer")
        super().__init__(*args, **kwargs)
        self.replay_buffer = GroupReplayBuffer(self.args.replay_buffer_size,
                                               self.args.seed + 104729 * self.accelerator.process_index)
        self.replays = False  # replayed rows were not decoded in this batch: no linear outputs to reuse

    def build_experience(self, rollout: Rollout, scores: Tensor) -> list[dict]:
        if self.args.replay_buffer_size:
            rollout, scores = self.refill(rollout, scores)
        return super().build_experience(rollout, scores)

    def refill(self, rollout: Rollout, scores: Tensor) -> tuple[Rollout, Tensor]:
        """The groups with reward variance join the buffer; those without are replaced by groups drawn from it."""
        k = self.args.num_generations
        groups = split_groups(rollout, scores, k)
        flat = [bool(torch.isclose(g["scores"].std(), torch.tensor(0.0))) for g in groups]
        for group, no_variance in zip(groups, flat):
            if not no_variance:
                self.replay_buffer.add(group)
        if not any(flat) or not self.replay_buffer.groups:
            return rollout, scores
        drawn = iter(self.replay_buffer.sample(sum(flat)))
        return join_groups([next(drawn) if no_variance else g for g, no_variance in zip(groups, flat)],
                           self.processing_class.pad_token_id)
