"""Asynchronous GRPO under TRL's names (`trl.experimental.async_grpo`: `AsyncGRPOConfig`, `AsyncGRPOTrainer`):
GRPO (grpo.py) whose next generation batches are sampled and scored while the current one trains, at most
`max_staleness` optimizer steps behind (trainers/online_async.py).

Every online trainer has the same option (`max_staleness` on `OnlineConfig`: GRPO, RLOO, PPO, REINFORCE++ and
their presets); this preset only changes its default to TRL's, 4, and `logging_steps` to TRL's 1.

Departures: TRL's trainer streams samples from a vLLM server and drops those more than `max_staleness` steps old;
here an in-process sampler never runs further ahead than `max_staleness`, so no sample is dropped. TRL's
server-pipeline fields (`max_inflight_tasks`, `queue_maxsize`, `weight_sync_steps`, `request_timeout`) have no
counterpart: weights are published to the sampler after every step (docs/migrating.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    """GRPO's configuration with asynchronous rollouts on by default (TRL's defaults)."""

    max_staleness: int = field(default=4, metadata={"help": "How many optimizer steps old the policy that sampled "
                               "a batch may be when the batch starts training; the sampler runs that far ahead "
                               "(0: synchronous GRPO)."})
    logging_steps: float = field(default=1, metadata={"help": "Log every this many optimizer steps."})


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPO with asynchronous rollouts; TRL's signature (`AsyncGRPOTrainer(model, reward_funcs, args=None,
    train_dataset=None, ...)`), GRPOTrainer's arguments otherwise."""

    config_class = AsyncGRPOConfig
    _tag = "AsyncGRPO"
