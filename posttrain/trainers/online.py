"""The online RL engine: every online algorithm (GRPO, RLOO, PPO, REINFORCE++) is this loop.

  1. take a batch of prompts; each is sampled `num_generations` times (one prefill per prompt);
  2. generate: completion ids, the sampler's log-probs, a mask up to EOS / a stop token; with
     `tools=` / `environment_factory=` a multi-turn rollout (`rollout/multiturn.py`: each tool result
     is fed into its row's KV cache and left out of the loss, the KL and the entropy), and with
     `rollout_func=` the user's function instead of the sampler;
  3. score with reward functions and/or reward models (weighted); once the reference log-probs are known, one
     pure function shapes the scores, `core.shaping.shape_rewards` (missing-EOS penalty, normalise, clip, KL
     in the reward, whiten);
  4. reference log-probs, only when `beta > 0`; old-policy log-probs are the sampler's own,
     and when the policy cannot have moved since sampling (one pass, one optimizer step per
     generation batch) `old_logp = logp.detach()`, so the ratio is exactly 1 and no pass is run;
  5. advantages = `core.advantages.compute_advantages(advantage_estimator, ...)`;
  6. for each of `num_iterations` passes and each micro-batch: loss = aggregate(`POLICY_LOSSES
     [policy_loss]`) + beta * KL (KL in the loss, GRPO) + vf_coef * value loss (with a critic).
     With `kl_in_reward`, -beta * KL goes into the reward instead (PPO, RLOO, REINFORCE++).
     Policy and reference log-probs come from one forward that computes each prompt once per group
     (`forward.completions.completion_logprobs`: block attention mask, logits at scoring positions only).
     When old == current, the policy's forward takes every decoder layer's linear outputs from the
     record the CPU sampler backend keeps of the batch's sampling (`rollout.cpu_backend.keep_record`,
     `accel/replay.py`, `replay_linear_outputs`) instead of recomputing them.

Steps 1-3 are `make_experience` (sampling and scoring: `online_sampling.py`), 4-5 `build_experience`, 6
`compute_loss`. With `max_staleness` > 0 (asynchronous rollouts, `online_async.py`), steps 1-3 of the next
generation batches run in a background thread, by a copy of the policy up to `max_staleness` optimizer steps
old, while the current batch trains; old_logp is then that policy's and the clipped ratio corrects for it.

The rest is in files of its own: the configuration (`online_config.py`), the setup (`online_setup.py`), the
prompt data (`online_data.py` over `prompts.py`), evaluation (`online_eval.py`), metrics (`online_metrics.py`)
and checkpointed state (`online_state.py`: resuming is bit-identical to never stopping). What flows between
the phases is `core.batch.Experience`.

Batch semantics (as GRPO in TRL): `per_device_train_batch_size` counts completions per
micro-batch. Each process generates `per_device_train_batch_size * steps_per_generation`
completions at a time (whole groups of `num_generations`; `steps_per_generation` defaults to
`gradient_accumulation_steps`), and trains on them for `steps_per_generation *
num_iterations` micro-batches. The "dataloader" yields each process's prompts once per
micro-batch; `training_step` generates when a new generation batch starts.

Reductions are global: rewards, normalisation and advantages are computed on the batch
gathered from every process (each group stays on its process, prompt-major), and loss
denominators count the tokens/sequences of the whole optimizer step over all processes, so the
update does not depend on how a batch is split across micro-batches or processes.
"""

from __future__ import annotations

import os
import time

import torch
from torch import Tensor

from posttrain.core.advantages import ADVANTAGES, AdvantageInput, compute_advantages
from posttrain.core.batch import Experience
from posttrain.core.importance import IMPORTANCE_CORRECTIONS
from posttrain.core.kl import kl_penalty
from posttrain.core.masked import AGGREGATIONS, aggregate_loss, count_tokens, masked_mean, masked_var, top_quantile_mask
from posttrain.core.policy_losses import POLICY_LOSSES, clipped_value_loss, entropy_bonus
from posttrain.core.shaping import RewardShaping, shape_rewards
from posttrain.forward.completions import completion_logprobs
from posttrain.forward.logprobs import token_logprobs
from posttrain.forward.vision import forward_inputs, has_images, row_part
from posttrain.models import loading
from posttrain.rollout.cpu_backend import holds_record, keep_record, replay_rows
from posttrain.rollout.generate import Rollout
from posttrain.rollout.images import load_policy
from posttrain.trainers import online_setup as setup
from posttrain.trainers.base import BaseTrainer, classic_arguments, is_streamed, seed_run
from posttrain.trainers.online_config import OnlineConfig, config_options, shaping_steps
from posttrain.trainers.online_data import OnlinePromptData
from posttrain.trainers.online_eval import OnlineEvaluation
from posttrain.trainers.online_metrics import OnlineMetrics
from posttrain.trainers.online_sampling import OnlineSampling
from posttrain.trainers.online_setup import OnlineSetup
from posttrain.trainers.online_state import OnlineCheckpoints
from posttrain.trainers.prompts import new_stream_position


class OnlineTrainer(OnlineSampling, OnlinePromptData, OnlineSetup, OnlineMetrics, OnlineEvaluation, OnlineCheckpoints,
                    BaseTrainer):
    """Rollout -> score -> advantages -> clipped policy update, configured by an `OnlineConfig`."""

    config_class = OnlineConfig
    samples_in_background = True  # max_staleness > 0 may sample with a copy of the policy (online_async.py)
    batch_prompts: list | None = None  # the prompts (one per completion) of the batch make_experience builds
    prompts_required = True  # a train_dataset (or environments that supply prompts); PPO's manual loop needs none
    _tag = "online"

    def __init__(self, model, reward_funcs=None, args: OnlineConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, ref_model=None, value_model=None, tools=None,
                 environment_factory=None, rollout_func=None, **kwargs):
        name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "model")
        args = args or self.config_class(output_dir=f"{os.path.basename(str(name).rstrip('/'))}-{self._tag}")
        # kwargs: TRL's older conventions (tokenizer=, config fields such as beta=), see classic_arguments
        args, processing_class = classic_arguments(type(self).__name__, self.config_class, args, processing_class,
                                                   kwargs)
        seed_run(args)  # before any weights are made here (a LoRA adapter's, a critic's head), as BaseTrainer does
        init_kwargs = dict(args.model_init_kwargs or {})
        policy, processing_class, self.vision = load_policy(model, processing_class, train_dataset,
                                                            type(self).__name__, init_kwargs)
        critics = sorted(name for name, e in ADVANTAGES.items() if e.critic)
        policy, wrapped = setup.prepare_policy(policy, args, peft_config, value_model, init_kwargs, critics)
        if reward_funcs is None and args.reward_model_path:
            reward_funcs = [args.reward_model_path]
        tooling, reward_funcs, train_dataset = setup.tooling(args, tools, environment_factory, reward_funcs,
                                                             train_dataset)
        train_dataset, eval_dataset = setup.checked_inputs(self, args, processing_class, reward_funcs, train_dataset,
                                                           eval_dataset, tooling, rollout_func)
        super().__init__(wrapped, args, processing_class=processing_class, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, callbacks=callbacks, optimizers=optimizers,
                         data_collator=lambda rows: rows)
        if isinstance(model, str):  # the name as given, for the model card (BaseTrainer sees the loaded policy)
            self.model_name = model
        self.loss_is_scaled_for_ga = True  # our denominators already span the whole optimizer step
        self.tooling, self.rollout_func, self.policy = tooling, rollout_func, policy
        self._positions = setup.positions(policy, args)
        self.reward_scorer = setup.reward_scorer(args, reward_funcs, reward_processing_classes, processing_class,
                                                 self.accelerator)
        self.reward_processing_classes = reward_processing_classes  # as TRL's trainer exposes them
        self._set_reference(ref_model, policy, args)
        self.sampling = setup.sampling_config(args, processing_class if self.vision else None)
        # with use_vllm: the engine, and the step its weights are of
        self.vllm = setup.vllm_engine(args, model, policy, self.accelerator, processing_class)
        self._vllm_synced_step = None
        self.generator = torch.Generator().manual_seed(args.seed + 7919 * self.accelerator.process_index)
        self._shuffle = torch.Generator().manual_seed(args.seed + 1)
        self.loss_mode, self.global_denominator = args.loss_aggregation()
        # the policy can move between sampling and training only with several optimizer steps or passes, or sampling ahead
        self.old_is_current = not args.max_staleness and args.num_iterations == 1 and \
            args.steps_per_generation == args.gradient_accumulation_steps
        self.replays = setup.replays(args, policy, self.old_is_current, args.advantage_estimator in critics)
        keep_record(policy, None)  # a record the sampler backend kept for this model before is not this run's
        self._buffer, self._next_micro = [], 0  # the generation batch's micro-batches (Experience), the next's index
        self._episodes, self._start_time, self._samples, self._last_sample_step = 0, None, None, -1
        from posttrain.callbacks import CompletionsTable

        self.completions_table = CompletionsTable(args.output_dir, args.num_completions_to_print, report_to=args.report_to)
        per_generation = args.per_process_generation * self.accelerator.num_processes
        self.optimizer_steps_per_generation = args.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
        self._stream_pos, self._stream_resumed = new_stream_position(), False  # a streamed train_dataset's place
        self._top_up_pos, self._top_up = new_stream_position(), None  # dynamic sampling's extra prompts (their place)
        self.rollouts = self._async_rollouts(train_dataset)
        if train_dataset is not None and not is_streamed(train_dataset) and len(self.get_train_dataloader()) == 0:
            raise ValueError(f"train_dataset has {len(train_dataset)} prompts, fewer than one generation batch needs "
                             f"({per_generation // args.num_generations}); add prompts or lower "
                             "per_device_train_batch_size / steps_per_generation")

    @torch.no_grad()
    def make_experience(self, inputs: dict) -> list[Experience]:
        """Generate, score and prepare one generation batch; returns its micro-batches in training order. With
        max_staleness > 0 the batch was sampled and scored ahead, in the background (`online_async.py`)."""
        self._start_time = self._start_time or time.time()
        sampled = self.rollouts.take(inputs) if self.rollouts is not None else self.sample_and_score(inputs)
        self._record_sampled(sampled)
        # one prompt per completion, for rows_in_loss (GFPO's filter); dynamic sampling mixes batches: none then
        self.batch_prompts = None if self.args.filter_groups_enable else sampled.prompts
        if self.args.filter_groups_enable:
            return self.build_experience(*self.dynamic_sampling(sampled))
        return self.build_experience(sampled.rollout, sampled.scores)

    # ------------------------------------------------------------------ experience
    def _no_grad_forward(self, model, batch, values: bool = False) -> Tensor:
        """Log-probs (or critic values) of the completions of `batch` (an Experience or a dict with its four
        token tensors), `local_rollout_forward_batch_size` rows at a time."""
        step, out = self.args.local_rollout_forward_batch_size, []
        for s in range(0, batch["completion_ids"].shape[0], step):
            keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", *(row_part(batch) or ()))
            chunk = {k: batch[k][s:s + step] for k in keys}  # (with image prompts, the rows' images)
            logp, _, v = self.forward(model, chunk, with_values=values)
            out.append(v if values else logp)
        return torch.cat(out)

    @torch.no_grad()
    def build_experience(self, rollout: Rollout, scores: Tensor) -> list[Experience]:
        """Penalties, reference log-probs, old values, advantages and loss denominators for one batch."""
        args, acc = self.args, self.accelerator
        device = acc.device
        N, C = rollout.completion_ids.shape
        batch = Experience(prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask,
                           completion_ids=rollout.completion_ids, completion_mask=rollout.completion_mask,
                           old_logp=rollout.logprobs.float(), rollout_row=torch.arange(N),  # where each row's record is
                           extra=dict(rollout.vision or {})).to(device)  # image prompts: each row's images
        # the sampler's record of linear outputs (accel/replay.py) is the CPU backend's to keep, for this batch's
        # forwards, while the policy cannot have moved since sampling; else any kept record goes
        keep_record(self.policy, rollout.linear_outputs if self.old_is_current and self.replays else None)
        if self.vllm is not None:  # vLLM's log-probs are not the policy's: kept for the importance weights only
            batch.vllm_logp = batch.old_logp
            if not self.old_is_current or args.kl_in_reward:  # where pi_old is read before the loss's forward
                batch.old_logp = self._no_grad_forward(self.policy, batch)
        truncated = rollout.is_truncated.to(device)
        loss_mask = batch.completion_mask.clone()
        if rollout.tool_mask is not None:  # fed tool results: context, out of the loss, the KL and the entropy
            loss_mask = loss_mask * (1 - rollout.tool_mask.to(device))
        if args.mask_truncated_completions:
            loss_mask[truncated] = 0
        kept = self.rows_in_loss(rollout, scores)
        if kept is not None:  # a group filter's left-out completions: out of the loss and the advantages
            kept = kept.to(device)
            loss_mask[~kept] = 0
        batch.loss_mask = loss_mask
        scores = scores.to(device).float()
        if self.needs_reference:
            batch.ref_logp = self.reference_logprobs(batch)
        if ADVANTAGES[args.advantage_estimator].critic:
            batch.old_values = self._no_grad_forward(acc.unwrap_model(self.model), batch, values=True)

        # everything below sees the batch of all processes
        g = {k: self._gather_rows(batch[k]) for k in ("loss_mask", "old_logp", "ref_logp", "old_values",
                                                      "completion_ids") if k in batch}
        g_truncated, mask = self._gather_rows(truncated), g["loss_mask"]
        lengths = self._gather_rows(batch.completion_mask.sum(1))
        shaped = shape_rewards(self._gather_rows(scores), mask, self.reward_shaping(), truncated=g_truncated,
                               logp=g["old_logp"], ref_logp=g.get("ref_logp"), lengths=lengths)
        self._record_rollout(g, shaped.penalized_scores, g_truncated)
        for name, term in shaped.terms.items():  # each registered shaping step's mean term
            self.record({f"shaping/{name}": float(term.mean())}, "train")
        inp = AdvantageInput(scores=shaped.scores, mask=mask, group_size=args.num_generations, layout="prompt_major",
                             token_rewards=shaped.token_rewards, values=g.get("old_values"),
                             kept=None if kept is None else self._gather_rows(kept.long()).bool())
        advantages, returns = compute_advantages(args.advantage_estimator, inp, **self._options("advantage_estimator"))
        mine = slice(acc.process_index * N, (acc.process_index + 1) * N)
        batch.advantages = advantages[mine, :C].float()
        if returns is not None:
            batch.returns = returns[mine, :C].float()
        if args.kl_in_reward:
            batch.ref_logp = None  # the KL is in the advantages already
        self._episodes += mask.shape[0]
        return self._micro_batches(batch)

    def reference_logprobs(self, batch: Experience) -> Tensor:
        """(N, C) log-probs of the batch's completions under the reference (beta > 0), at the sampling temperature."""
        with self.reference_context(self.ref_model):
            ref = self.ref_model if self.ref_model is not None else self.policy  # PEFT: adapter disabled
            return self._no_grad_forward(ref, batch)

    def rows_in_loss(self, rollout: Rollout, scores: Tensor) -> Tensor | None:
        """(N,) bool: the completions of this process's batch to train on, or None for all of them (GFPO's group
        filter keeps some of each group)."""
        return None

    def reward_shaping(self) -> RewardShaping:
        """The config's reward-shaping switches (`core.shaping`), read when a batch is shaped (PPO's adaptive
        controller sets `beta` just before)."""
        args = self.args
        return RewardShaping(missing_eos_penalty=args.missing_eos_penalty, normalize=args.normalize_reward,
                             clip_range=args.reward_clip_range, steps=shaping_steps(args),
                             kl_in_reward=args.kl_in_reward, kl_coef=args.beta,
                             kl_estimator=args.kl_estimator, per_token=ADVANTAGES[args.advantage_estimator].per_token,
                             token_level_kl=args.token_level_kl, whiten=args.whiten_rewards)

    def _options(self, what: str) -> dict:
        """The config fields named by the options of the configured `what`, "advantage_estimator" or "policy_loss";
        an option without a field raises (config_options)."""
        registry = ADVANTAGES if what == "advantage_estimator" else POLICY_LOSSES
        return config_options(self.args, what, registry[getattr(self.args, what)])

    def _micro_batches(self, batch: Experience | dict) -> list[Experience]:
        """Split into micro-batches (shuffled per pass when the policy moves within a batch), each carrying the
        global denominators of its optimizer step (`core.batch.Experience`: the fields and their shapes)."""
        args, batch = self.args, Experience.of(batch)
        bs, ga, N = args.per_device_train_batch_size, args.gradient_accumulation_steps, batch["loss_mask"].shape[0]
        rows = []
        for _ in range(args.num_iterations):
            order = torch.arange(N) if self.old_is_current else torch.randperm(N, generator=self._shuffle)
            rows += [order[s:s + bs].to(batch["loss_mask"].device) for s in range(0, N, bs)]
        count, L = AGGREGATIONS[self.loss_mode].count, args.max_completion_length
        counts = []  # per optimizer step: the loss mode's count, tokens (this process)
        for j in range(0, len(rows), ga):
            m = batch["loss_mask"][torch.cat(rows[j:j + ga])]
            # a last chunk of n < ga micro-batches (steps_per_generation not a multiple of ga) shares its optimizer
            # step with the next generation batch: scaled by ga / n, it weighs n / ga of that step's mean
            share = ga / len(rows[j:j + ga])
            counts.append([count(m, L) * share, count_tokens(m) * share])
        counts = torch.tensor(counts, dtype=torch.float64, device=batch["loss_mask"].device)
        world = self.accelerator.num_processes
        if world > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        counts = counts.clamp(min=1) / world  # DDP averages gradients over processes
        micro = []
        for i, idx in enumerate(rows):
            mb = batch.select(idx).trimmed(args.pad_to_multiple_of)
            denominator, token_denominator = counts[i // ga]
            if not self.global_denominator:  # bnpo: this micro-batch's own count
                denominator = count(mb.loss_mask, L).clamp(min=1).double() * ga
            mb.denominator, mb.token_denominator = denominator.float(), token_denominator.float()
            mb.old_is_current = self.old_is_current
            micro.append(mb)
        return micro

    # ------------------------------------------------------------------ loss
    def forward(self, model, mb: dict, with_values: bool = False, with_entropy: bool = False, replay: bool = False):
        """(log-probs (B, C) at the sampling temperature, entropy (B, C) or None, values (B, C) or None).
        Without a critic, each distinct prompt of the micro-batch is computed once (`completion_logprobs`).
        `replay`: the policy's forward, which may take its linear outputs from the record the CPU sampler backend
        keeps of this generation batch's sampling (`rollout.cpu_backend.replay_rows`; the forward that reads its
        last rows lets it go layer by layer)."""
        if not with_values:
            record = None
            if replay and mb.get("old_is_current") and mb.get("rollout_row") is not None:
                record = replay_rows(self.policy, mb["rollout_row"])
            logp, entropy = completion_logprobs(model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                                mb["completion_mask"], self.args.temperature, with_entropy,
                                                replay=record, vision=row_part(mb))
            return logp, entropy, None
        ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
        attention = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
        C = mb["completion_ids"].shape[1]
        images = forward_inputs(mb, torch.arange(len(ids))) if has_images(mb) else {}  # each row's images
        logp, entropy, _, out = token_logprobs(model, ids, attention, num_scored=C, temperature=self.args.temperature,
                                               with_entropy=with_entropy, return_outputs=True, **images)
        values = out.value[:, -(C + 1):-1].float() if with_values else None
        return logp, entropy, values

    @property
    def experience(self) -> tuple[Experience, ...]:
        """The current generation batch's micro-batches (`make_experience`), in training order."""
        return tuple(self._buffer)

    @property
    def holds_replay_record(self) -> bool:
        """Whether the sampler backend still keeps recorded linear outputs (`accel/replay.py`) of the policy's
        sampling for the micro-batches to come."""
        return holds_record(self.policy)

    def training_step(self, model, inputs, num_items_in_batch=None):
        index = inputs["micro_index"]
        if index == 0 or not self._buffer:
            # FSDP2 shards policy + critic as one module: the sampler's policy-alone forwards gather through it
            loading.route_through_fsdp_root(model, self.policy)
            self._buffer = []  # the last batch's micro-batches (and any record) go before sampling the next
            keep_record(self.policy, None)
            self._buffer = self.make_experience(inputs)
        loss = super().training_step(model, self._buffer[index], num_items_in_batch)
        self._next_micro = index + 1
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        critic = ADVANTAGES[args.advantage_estimator].critic
        logp, entropy, values = self.forward(model, inputs, with_values=critic, with_entropy=True, replay=True)
        mask = inputs["loss_mask"]
        old_logp = logp.detach() if inputs["old_is_current"] else inputs["old_logp"]
        per_token, stats = POLICY_LOSSES[args.policy_loss].fn(logp, old_logp, inputs["advantages"], mask,
                                                              **self._options("policy_loss"))
        metrics = {}
        if "vllm_logp" in inputs and args.vllm_importance_sampling_correction:  # sampled by vLLM, not by pi_old
            weights = IMPORTANCE_CORRECTIONS[args.vllm_importance_sampling_mode].fn(
                old_logp, inputs["vllm_logp"], mask, args.vllm_importance_sampling_clip_min,
                args.vllm_importance_sampling_clip_max)
            per_token = per_token * weights
            gap = (old_logp - inputs["vllm_logp"]).abs()
            metrics = {"sampling/sampling_logp_difference/mean": masked_mean(gap, mask),
                       "sampling/importance_sampling_ratio/mean": masked_mean(weights, mask)}
        policy_avg = masked_mean(per_token.detach(), mask)
        metrics.update({"loss/policy_avg": policy_avg, "policy_loss": policy_avg})  # TRL's name and the classic one
        if "ref_logp" in inputs:  # GRPO: beta * KL(pi || ref) per token, in the loss
            kl = kl_penalty(logp, inputs["ref_logp"], args.kl_estimator)
            if args.use_bias_correction_kl:  # samples are pi_old's: weight by pi/pi_old to estimate KL(pi || ref)
                kl = kl * torch.exp(torch.where(mask.bool(), logp - old_logp, 0.0))
            per_token = per_token + args.beta * kl
        if args.entropy_coef:
            per_token = per_token - args.entropy_coef * entropy_bonus(logp, entropy, stats["ratio"])
        # tokens left out keep their place in the denominator, as TRL's masks do
        keep = mask
        if args.top_entropy_quantile < 1.0:
            keep = top_quantile_mask(entropy.detach(), keep, args.top_entropy_quantile)
        if args.off_policy_mask_threshold is not None:
            drift = masked_mean(old_logp - logp.detach(), mask, dim=1)  # (B,) mean log pi_old/pi per sequence
            negative = (inputs["advantages"] * mask).sum(1) < 0
            keep = keep * ~(negative & (drift > args.off_policy_mask_threshold))[:, None]
        per_token = torch.where(keep.bool(), per_token, 0.0)
        loss = aggregate_loss(per_token, mask, self.loss_mode, denominator=inputs["denominator"],
                              max_length=args.max_completion_length)
        if critic:
            value_loss, value_clipped = clipped_value_loss(values, inputs["old_values"], inputs["returns"], mask,
                                                           args.cliprange_value)
            loss = loss + args.vf_coef * aggregate_loss(value_loss, mask, "token_mean", inputs["token_denominator"])
            metrics.update({"loss/value_avg": masked_mean(value_loss.detach(), mask),
                            "val/clipfrac_avg": masked_mean(value_clipped.float(), mask)})
        metrics.update({"policy/approxkl_avg": masked_mean(stats["approx_kl"], mask),
                        "policy/clipfrac_avg": masked_mean(stats["clipped"].float(), mask),
                        "policy/entropy_avg": masked_mean(entropy, mask),
                        "val/ratio": masked_mean(stats["ratio"], mask), "val/ratio_var": masked_var(stats["ratio"], mask)})
        self.record(metrics, "train")
        return (loss, None) if return_outputs else loss

