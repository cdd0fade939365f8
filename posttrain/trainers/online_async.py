"""Asynchronous rollouts (`max_staleness` > 0): the next generation batches are sampled and scored in a
background thread while the current one trains, as in verl's one-step-off and fully asynchronous trainers,
OpenRLHF's `async_enable`, TRL's `AsyncGRPOTrainer` and AReaL (Fu et al. 2025, "AReaL: A Large-Scale
Asynchronous Reinforcement Learning System for Language Reasoning").

With K optimizer steps per generation batch, the engine runs d = max_staleness // K generation batches ahead.
The prompt order is a function of (seed, epoch), so when generation batch g starts, the prompts of batches
g+1 .. g+d are known (`prompts.PromptBatches(ahead=d)`). At that point `AsyncRollouts.take`:

  1. takes batch g's sampled, scored rollout from the queue (sampling it now when none is queued: the first
     batch of a run);
  2. queues batches up to g+d that are not queued yet, with a snapshot of the policy's current weights;
  3. returns batch g to the engine, which trains on it (reference log-probs, critic values, shaping and
     advantages are computed then, in the training thread, with the current reference and critic).

One worker thread runs the queued jobs in order: it loads the job's weights into its own copy of the policy
(weights are published to the sampler after each step, as a snapshot), samples with the trainer's sampler
generator, decodes and scores (`RewardScorer`: async reward functions awaited together, sync ones each in
its thread, with `reward_timeout`). Batch g is therefore sampled by the weights of generation batch
max(0, g - d) whatever the threads' timing: a run is deterministic. The behaviour log-probs (`old_logp`) are
the sampling policy's, and the clipped ratio pi_theta / pi_old corrects for the staleness.

Resuming is bit-identical: a checkpoint waits for the queued jobs and saves their results, and the sampler's
generator after them (`state`): the weights that sampled them are gone by then, so the batches in flight are
saved rather than regenerated.

With vLLM (`use_vllm=True`), the worker generates through the trainer's engine (tools, environments and a
`rollout_func` too): before a job samples, its weights are published with the engine's own sync (every
weight, or the LoRA adapter alone), from the worker's copy, never from the policy the optimizer is writing.
vLLM's log-probs are the behaviour log-probs: the engine keeps them as `vllm_logp`, old_logp is the policy's
when the batch starts training (AReaL's proximal policy), the clipped ratio is taken against it and the
`vllm_importance_sampling_mode` weight exp(old_logp - vllm_logp) corrects for both the staleness and vLLM's
numerics. The main thread's own generations (evaluation) sync the current policy again first.

With several processes (DDP), each process's worker samples its own prompts, and the collectives of the
sampling phase (tool metrics' gathers, a vLLM server sync's barrier) run on a process group of their own
(`gather_rows`), so they never interleave with training's gradient all-reduces on the default group.
Sharded weights (FSDP, ZeRO-3) are refused: each forward of the copy would be a collective of its own.

Departures: TRL's AsyncGRPOTrainer streams samples from a vLLM server and drops those older than
max_staleness; here the sampler never runs further ahead than max_staleness, so nothing is dropped, and
samples are whole generation batches. The worker keeps a whole copy of the policy (also with vLLM, whose
weights are published from it). Metrics recorded while a batch is sampled (reward functions' `log_metric`,
tool counts) are logged when the batch trains.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import Tensor

from posttrain.rollout.generate import Rollout


@dataclass
class Sampled:
    """One generation batch sampled and scored: what the sampling phase hands to build_experience."""

    rollout: Rollout
    scores: Tensor                 # (N,) float32 total reward per completion (weighted, normalize_then_sum applied)
    per_function: Tensor           # (N, F) float32 each reward function's value, NaN where it abstained
    prompts: list                  # (N,) each completion's prompt, as the reward functions got it
    texts: list[str]               # (N,) the decoded completions
    extra_columns: dict            # `log_extra`'s columns for the completions table
    records: list                  # [(metrics, mode)] recorded while sampling in the background, logged at training
    version: int = 0               # the optimizer step whose weights sampled the batch
    extra: dict = field(default_factory=dict)  # a preset's per-row tensors made while sampling (a teacher server's)

    def state(self) -> dict[str, Any]:
        """Plain tensors, lists and numbers for a checkpoint."""
        rollout = {f.name: getattr(self.rollout, f.name) for f in fields(Rollout) if f.name != "linear_outputs"}
        return {"rollout": {k: v for k, v in rollout.items() if v is not None}, "scores": self.scores,
                "per_function": self.per_function, "prompts": self.prompts, "texts": self.texts,
                "extra_columns": {k: list(v) for k, v in self.extra_columns.items()}, "records": self.records,
                "version": self.version, "extra": dict(self.extra)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Sampled:
        return cls(**{**state, "rollout": Rollout(**state["rollout"])})


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


def sampler_group():
    """A process group for the sampling phase's collectives (None with one process). Made by every process at
    the same point (the trainer's construction), as torch.distributed requires."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.new_group(ranks=list(range(dist.get_world_size())))
    return None


def gather_rows(x: Tensor, group) -> Tensor:
    """(N, ...) per process -> (processes * N, ...) over `group`, per-token tensors padded with 0 to a common
    width: the trainer's row gather (`_gather_rows`), on the sampler's own process group."""
    dist = torch.distributed
    if x.dim() > 1:
        width = torch.tensor([x.shape[1]], device=x.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX, group=group)
        if int(width) > x.shape[1]:
            x = torch.cat([x, x.new_zeros((x.shape[0], int(width) - x.shape[1], *x.shape[2:]))], dim=1)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def check_background_sampling(trainer):
    """Refuse, with the reason, what a background sampler cannot do."""
    from posttrain.models.loading import shards_weights

    if shards_weights(trainer.accelerator):
        raise ValueError(f"max_staleness > 0 samples with a whole copy of the policy in a background thread; with "
                         f"sharded weights ({shards_weights(trainer.accelerator)}) each of its forwards would be a "
                         "collective interleaving with training's: set max_staleness=0, or train with DDP")
    if trainer.rollout_func is not None and trainer.vllm is None:
        raise ValueError("max_staleness > 0 runs rollout_func in a background thread, and without use_vllm a "
                         "rollout_func samples with the trainer's policy, which the optimizer writes meanwhile: set "
                         "max_staleness=0, or use_vllm=True (its generations go through the engine, synced to the "
                         "sampler's weights)")


class AsyncRollouts:
    """The queue of generation batches sampled ahead, and the worker thread that samples them."""

    def __init__(self, trainer, depth: int):
        check_background_sampling(trainer)
        self.trainer, self.depth = trainer, depth
        self.queue: deque[tuple[int, Future]] = deque()  # (generation batch, future Sampled), in order
        self.sampler = None  # the worker's copy of the policy, made at the first job
        self.group = sampler_group()  # the sampling phase's collectives, apart from training's (None: one process)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-rollouts")

    def _snapshot(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.trainer.policy.state_dict().items()}

    def _submit(self, ordinal: int, inputs: dict, weights: dict[str, Tensor]):
        version = self.trainer.state.global_step
        self.queue.append((ordinal, self.pool.submit(self._job, inputs, weights, version)))

    def _job(self, inputs: dict, weights: dict[str, Tensor], version: int) -> Sampled:
        trainer = self.trainer
        self.sampler.load_state_dict(weights)  # the weights published when the job was queued
        local = trainer._sampling_thread
        local.model, local.records, local.group = self.sampler, [], self.group
        try:
            if trainer.vllm is not None:
                self._publish(version)
            with torch.no_grad():  # grad mode is per thread
                sampled = trainer.sample_and_score(inputs)
            sampled.records, sampled.version = local.records, version
            return sampled
        finally:
            local.model = local.records = local.group = None

    def _publish(self, version: int):
        """vLLM: the job's weights (the worker's copy) into the engine, with its sync, unless it holds them
        already. `trainer._vllm_synced_step` says what the engine holds: a step number for the main thread's
        syncs of the policy, ("sampler", version) for this worker's, so each side syncs again after the other."""
        trainer = self.trainer
        if trainer._vllm_synced_step == ("sampler", version):
            return
        trainer.vllm.sync(self.sampler, group=self.group)
        if self.group is not None:  # server mode: the main process sends for all; the others wait for it
            torch.distributed.barrier(group=self.group)
        trainer._vllm_synced_step = ("sampler", version)

    def take(self, inputs: dict) -> Sampled:
        """Generation batch `inputs["generation_batch"]` sampled and scored; queues the batches after it."""
        ordinal = inputs.get("generation_batch")
        if self.queue and self.queue[0][0] != ordinal:  # not the batch queued (a changed order): start again
            self.wait()
            self.queue.clear()
        if self.sampler is None:  # copied here, between steps, where no optimizer writes the weights
            self.sampler = copy.deepcopy(self.trainer.policy).eval().requires_grad_(False)
            for p in self.sampler.parameters():
                p.grad = None
        queued, steps_per_batch = {o for o, _ in self.queue}, self.trainer.optimizer_steps_per_generation
        jobs = [] if self.queue else [(ordinal, inputs)]
        # the batches after it, up to `depth` ahead; none past the run's end (batch b trains from step b * steps)
        jobs += [(later, batch) for later, batch in inputs.get("ahead", ())
                 if later not in queued and later * steps_per_batch < self.trainer.state.max_steps]
        weights = self._snapshot() if jobs else None  # the weights published to the sampler for these batches
        for later, batch in jobs:
            self._submit(later, batch, weights)
        start = time.perf_counter()
        sampled = self.queue.popleft()[1].result()
        trainer = self.trainer
        trainer.record({"rollout/wait_time": time.perf_counter() - start,
                        "rollout/staleness": float(trainer.state.global_step - sampled.version)}, "train")
        return sampled

    def wait(self):
        """Let every queued job finish (their results stay queued): before the sampler's generator is read or
        used elsewhere (a checkpoint, an evaluation)."""
        for _, future in self.queue:
            future.exception()  # waits; an error is raised when the batch is taken

    def state(self) -> list | None:
        """The queued batches' results, after waiting for them (None when nothing is queued)."""
        self.wait()
        if not self.queue:
            return None
        return [(ordinal, future.result().state()) for ordinal, future in self.queue]

    def load_state(self, state: list):
        self.close()
        self.queue = deque((ordinal, _done(Sampled.from_state(s))) for ordinal, s in state)

    def close(self):
        """Drop the jobs not started and wait for the running one (the end of training)."""
        for _, future in self.queue:
            if not future.cancel():
                future.exception()
        self.queue.clear()
