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
     sampler's record instead of recomputing them (`accel/replay.py`, `replay_linear_outputs`).

The configuration, `OnlineConfig`, lives in `online_config.py` (imported here).

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

Resuming (`train(resume_from_checkpoint=...)`) is bit-identical to never stopping: the prompt order
is a function of (seed, epoch), so transformers skips the micro-batches already trained on, and each
checkpoint also holds, per process, the sampler's and the shuffle's generators, the episode count and
the generation batch's micro-batches not yet trained on (`checkpointed`); with a critic, the critic
is saved next to the policy and read back by `load_critic`. A streamed train_dataset (IterableDataset)
is read in order (`prompts._PromptStream`), and its place in the stream is checkpointed too. Prompt
batching and streaming live in `prompts.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import os
import time
from collections import defaultdict

import torch
from torch import Tensor

from posttrain.core.advantages import ADVANTAGES, AdvantageInput, compute_advantages
from posttrain.core.kl import kl_penalty
from posttrain.core.masked import (AGGREGATIONS, aggregate_loss, count_tokens, masked_mean, masked_sum, masked_var,
                                   top_quantile_mask)
from posttrain.core.policy_losses import POLICY_LOSSES, clipped_value_loss, entropy_bonus, truncated_importance_weights
from posttrain.core.shaping import RewardShaping, normalize_then_sum, shape_rewards
from posttrain.data.tokenize import check_prompts, encode_prompt
from posttrain.forward.completions import completion_logprobs
from posttrain.forward.logprobs import token_logprobs
from posttrain.models import loading
from posttrain.models.modes import disable_dropout
from posttrain.models.value_head import CausalLMWithValueHead, PolicyWithCritic
from posttrain.rollout.generate import Rollout, SamplingConfig, generate
from posttrain.rollout.multiturn import Tooling, rollout_from_func
from posttrain.rollout.rewards import RewardScorer
from posttrain.trainers.base import (BaseTrainer, SyncRefModelCallback, as_dataset, check_datasets,
                                     classic_arguments, is_streamed, seed_run)
from posttrain.trainers.online_config import GENERATION_KWARGS, OnlineConfig, config_options
from posttrain.trainers.prompts import PromptBatches, _collate_streamed, _PromptStream, new_stream_position

logger = logging.getLogger(__name__)


def _prepare_policy(policy, args: OnlineConfig, peft_config, value_model, init_kwargs: dict):
    """The loaded policy made ready to train (dropout off, the output layer in float32 if asked, the PEFT adapter)
    and the module the trainer trains: the policy, or the policy with its critic for critic estimators."""
    if args.disable_dropout:
        disable_dropout(policy)
    if args.cast_lm_head_to_fp32 and policy.get_output_embeddings() is not None:
        policy.get_output_embeddings().float()  # the log-probs' last matmul and softmax in float32
    policy = loading.apply_peft(policy, peft_config, args.gradient_checkpointing)
    if ADVANTAGES[args.advantage_estimator].critic:  # the critic trains with the policy, in one module
        critic = value_model if value_model is None else loading.load_sequence_classifier(
            value_model, convert_causal_lm=True, **init_kwargs)  # a causal LM: a fresh score head, with a warning
        return policy, CausalLMWithValueHead(policy) if critic is None else PolicyWithCritic(policy, critic)
    if value_model is not None:
        raise ValueError(f"value_model is only used by critic estimators "
                         f"{sorted(name for name, e in ADVANTAGES.items() if e.critic)}, "
                         f"not advantage_estimator={args.advantage_estimator!r}")
    return policy, policy


def _tooling(args: OnlineConfig, tools, environment_factory, reward_funcs, train_dataset):
    """tools= / environment_factory=: multi-turn rollouts (rollout/multiturn.py) -> (the `Tooling` or None, the
    reward functions, the train dataset). An environment's get_reward() is one more reward function, named after
    its class; without a train_dataset, the environments' reset() supplies the prompts."""
    if not tools and environment_factory is None:
        return None, reward_funcs, train_dataset
    tooling = Tooling(tools, environment_factory, max_iterations=args.max_tool_calling_iterations
                      if args.max_tool_calling_iterations is not None else 2 ** 31,
                      timeout=args.tool_call_timeout, max_call_chars=args.max_tool_call_chars,
                      max_result_chars=args.max_tool_result_chars)
    env_rewards = tooling.environment_rewards()
    if env_rewards:
        given = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
            else [reward_funcs]
        reward_funcs = given + env_rewards
    if train_dataset is None and environment_factory is not None:  # reset() supplies the prompts
        train_dataset = tooling.reset_dataset(args)
    return tooling, reward_funcs, train_dataset


def _sampling_config(args: OnlineConfig) -> SamplingConfig:
    """The sampler's settings from the config, `generation_kwargs` over the fields."""
    sampling = SamplingConfig(
        max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, num_generations=args.num_generations,
        stop_token_ids=tuple(args.stop_token_ids or ()), stop_strings=tuple(args.stop_strings or ()),
        repetition_penalty=args.repetition_penalty)
    if args.generation_kwargs:  # keys checked by the config; tuples where SamplingConfig keeps tuples
        sampling = dataclasses.replace(sampling, **{
            key: tuple(v) if key in ("stop_strings", "stop_token_ids") else v
            for key, v in args.generation_kwargs.items() if key in GENERATION_KWARGS})
    return sampling


def _positions(policy, args: OnlineConfig) -> int | None:
    """The model's max_position_embeddings (None if it has none), warning when the configured limits reach past
    it; prompts that do when max_prompt_length is None are warned about once they are seen (`_collate`)."""
    positions = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    if positions and (args.max_prompt_length or 0) + args.max_completion_length > positions:
        logger.warning(f"max_prompt_length={args.max_prompt_length} + max_completion_length="
                       f"{args.max_completion_length} exceeds the model's max_position_embeddings="
                       f"{positions}: sequences that long go past the positions it was trained on")
    return positions


class OnlineTrainer(BaseTrainer):
    """Rollout -> score -> advantages -> clipped policy update, configured by an `OnlineConfig`."""

    config_class = OnlineConfig
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
        policy = loading.load_causal_lm(model, **init_kwargs)
        processing_class = loading.load_tokenizer(processing_class, model=model if isinstance(model, str) else policy)
        policy, wrapped = _prepare_policy(policy, args, peft_config, value_model, init_kwargs)
        if reward_funcs is None and args.reward_model_path:
            reward_funcs = [args.reward_model_path]
        tooling, reward_funcs, train_dataset = _tooling(args, tools, environment_factory, reward_funcs, train_dataset)
        if train_dataset is None and self.prompts_required:
            raise ValueError(f"train_dataset is required: {type(self).__name__} samples completions of its prompts "
                             "(or give environment_factory= whose environments' reset() supply them)")
        if rollout_func is not None and tooling is not None:
            raise ValueError("rollout_func replaces the built-in sampler, tools and environments included; give "
                             "rollout_func or tools= / environment_factory=, not both")
        if args.use_vllm and (rollout_func is not None or tooling is not None):
            raise ValueError("use_vllm=True generates single-turn completions with vLLM; it does not run rollout_func, "
                             "tools= or environment_factory= (posttrain's sampler does): set use_vllm=False")
        if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
            raise ValueError("reward_funcs is required: reward functions, reward models, or model names "
                             "(or set reward_model_path, or give an environment_factory whose environments "
                             "have get_reward)")
        train_dataset, eval_dataset = as_dataset(train_dataset), as_dataset(eval_dataset, "eval_dataset")
        if train_dataset is not None:  # None is allowed: PPO's manual loop (generate / step) needs no prompts
            check_datasets(args, train_dataset, eval_dataset)
        self._check_dataset(train_dataset, "train_dataset")
        for what, data in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if data is not None and not isinstance(data, dict) and not is_streamed(data):  # here, not at a step
                check_prompts(data, processing_class, what)  # (a stream's prompts: when they are tokenised)
        if args.total_episodes:  # before transformers asks a stream for max_steps; steps_per_generation
            per_generation = args.per_process_generation * args.world_size  # need not divide into accumulation
            args.max_steps = math.ceil(math.ceil(args.total_episodes / per_generation) * args.steps_per_generation
                                       * args.num_iterations / args.gradient_accumulation_steps)
        super().__init__(wrapped, args, processing_class=processing_class, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, callbacks=callbacks, optimizers=optimizers,
                         data_collator=lambda rows: rows)
        if isinstance(model, str):  # the name as given, for the model card (BaseTrainer sees the loaded policy)
            self.model_name = model
        self.loss_is_scaled_for_ga = True  # our denominators already span the whole optimizer step
        self.tooling, self.rollout_func = tooling, rollout_func
        self.policy = policy
        self._positions = _positions(policy, args)
        self.reward_scorer = RewardScorer(reward_funcs, args.reward_weights, reward_processing_classes,
                                          tokenizer=processing_class, device=self.accelerator.device,
                                          timeout=args.reward_timeout)
        self.reward_processing_classes = reward_processing_classes  # as TRL's trainer exposes them
        if loading.shards_weights(self.accelerator):  # ZeRO-3 / FSDP2: reward models sharded like the policy
            self.reward_scorer.funcs = [loading.prepare_frozen(self.accelerator, f) if isinstance(f, torch.nn.Module)
                                        else f for f in self.reward_scorer.funcs]
        self._set_reference(ref_model, policy, args)
        self.sampling = _sampling_config(args)
        self.vllm, self._vllm_synced_step = None, None  # with use_vllm: the engine, and the step its weights are of
        if args.use_vllm:
            from posttrain.rollout.vllm_engine import make_engine

            name = model if isinstance(model, str) else getattr(policy.config, "_name_or_path", None)
            extra = {k: v for k, v in (args.generation_kwargs or {}).items() if k not in GENERATION_KWARGS}
            self.vllm = make_engine(args, name, self.accelerator, processing_class.pad_token_id,
                                    processing_class.eos_token_id, extra)
        self.generator = torch.Generator().manual_seed(args.seed + 7919 * self.accelerator.process_index)
        self._shuffle = torch.Generator().manual_seed(args.seed + 1)
        self.loss_mode, self.global_denominator = args.loss_aggregation()
        # the policy can move between sampling and training only with several optimizer steps or passes
        self.old_is_current = args.num_iterations == 1 and args.steps_per_generation == args.gradient_accumulation_steps
        # ... and then the sampler's linear outputs are the training forward's (accel/replay.py)
        self.replays = (args.replay_linear_outputs and self.old_is_current and not ADVANTAGES[
                        args.advantage_estimator].critic and not (args.bf16 or args.fp16 or args.torch_compile
                                                                  or args.gradient_checkpointing) and _no_dropout(policy))
        self._replay = None  # the current generation batch's LinearRecord while its micro-batches train
        self._buffer: list[dict] = []  # the current generation batch's micro-batches, in training order
        self._next_micro = 0  # index in `_buffer` of the next micro-batch to train on
        self._episodes, self._start_time, self._samples, self._last_sample_step = 0, None, None, -1
        from posttrain.callbacks import CompletionsTable

        self.completions_table = CompletionsTable(args.output_dir, args.num_completions_to_print, report_to=args.report_to)
        per_generation = args.per_process_generation * self.accelerator.num_processes
        self.optimizer_steps_per_generation = args.steps_per_generation * args.num_iterations // args.gradient_accumulation_steps
        self._stream_pos, self._stream_resumed = new_stream_position(), False  # a streamed train_dataset's place
        if train_dataset is not None and not is_streamed(train_dataset) and len(self.get_train_dataloader()) == 0:
            raise ValueError(f"train_dataset has {len(train_dataset)} prompts, fewer than one generation batch needs "
                             f"({per_generation // args.num_generations}); add prompts or lower "
                             "per_device_train_batch_size / steps_per_generation")

    @staticmethod
    def uses_reference(args) -> bool:
        """Whether the engine loads a reference policy: a KL term with `beta > 0`. A preset whose `beta` means
        something else (distillation: the divergence's interpolation) says no here."""
        return args.beta > 0

    def _set_reference(self, ref_model, policy, args: OnlineConfig):
        """`self.ref_model`: only when `uses_reference` (beta > 0); a frozen copy of the policy unless one is given
        or the policy is a PEFT model (whose reference is the adapter-disabled policy); synced to the policy with
        sync_ref_model."""
        needs_ref = self.uses_reference(args)
        if needs_ref and ref_model is None and not loading.is_peft_model(policy):
            ref_model = loading.frozen_copy(policy)  # the policy alone, never the critic
        self.ref_model = self.make_reference(ref_model, needed=needs_ref)
        self.needs_reference = needs_ref  # build_experience computes reference log-probs
        if args.sync_ref_model:
            if self.ref_model is None:
                raise ValueError("sync_ref_model needs a separate reference model; with PEFT the reference is the "
                                 "adapter-disabled policy, which cannot be synced")
            self.add_callback(SyncRefModelCallback(self.ref_model))

    # ------------------------------------------------------------------ data
    @staticmethod
    def _check_dataset(dataset, what: str):
        if dataset is None:
            return
        if is_streamed(dataset):  # the first row's columns (a stream may not know its features)
            columns = dataset.column_names or list(next(iter(dataset), {}))
        else:
            columns = getattr(dataset, "column_names", None) or (list(dataset[0]) if len(dataset) else [])
        if "prompt" not in columns and "input_ids" not in columns:
            raise ValueError(f"{what} needs a 'prompt' column (text or chat messages) or a tokenised 'input_ids' "
                             f"column; it has {columns}")

    def _collate(self, rows: list[dict]) -> dict:
        """Prompts (as given, for reward functions), their token ids (left-cut to max_prompt_length), other columns."""
        tok, limit = self.processing_class, self.args.max_prompt_length
        if "prompt" in rows[0]:
            prompts = [row["prompt"] for row in rows]
            prompt_ids = [encode_prompt(tok, p, tools=self.tooling.schemas_for(row) if self.tooling else None,
                                        template_kwargs=self.args.chat_template_kwargs)
                          for p, row in zip(prompts, rows)]
        else:  # pre-tokenised prompts, as in classic PPO/RLOO datasets
            prompt_ids = [list(row["input_ids"]) for row in rows]
            prompts = tok.batch_decode(prompt_ids, skip_special_tokens=True)
        if limit:
            prompt_ids = [ids[-limit:] for ids in prompt_ids]
        positions, completion = getattr(self, "_positions", None), self.args.max_completion_length
        longest = max(map(len, prompt_ids), default=0)
        if positions and not limit and longest + completion > positions:
            self._positions = None  # said once
            logger.warning(f"a prompt of {longest} tokens + max_completion_length={completion} exceeds the model's "
                           f"max_position_embeddings={positions}: max_prompt_length=None does not cut prompts, so "
                           "training goes past the positions the model was trained on; set max_prompt_length")
        skip = ("prompt", "input_ids", "attention_mask")
        columns = {key: [row[key] for row in rows] for key in rows[0] if key not in skip}
        return {"prompt": prompts, "prompt_ids": prompt_ids, "columns": columns}

    def get_train_dataloader(self):
        args = self.args
        if is_streamed(self.train_dataset):
            # a resumed run (`_stream_position` restored) reads on from the checkpoint's place; a fresh one from the start
            resumed, self._stream_resumed = self._stream_resumed and not args.ignore_data_skip, False
            if not resumed:
                self._stream_pos = new_stream_position()
            stream = _PromptStream(self.train_dataset, args.per_process_generation // args.num_generations,
                                   self.accelerator.num_processes, self.accelerator.process_index,
                                   args.steps_per_generation * args.num_iterations, self._stream_pos,
                                   placeholders=self._stream_pos["yielded"] if resumed else 0)
            return torch.utils.data.DataLoader(stream, batch_size=None,
                                               collate_fn=functools.partial(_collate_streamed, self._collate))
        return PromptBatches(self.train_dataset, self._collate, args.per_process_generation // args.num_generations,
                             self.accelerator.num_processes, self.accelerator.process_index,
                             args.steps_per_generation * args.num_iterations, args.shuffle_dataset, args.seed)

    # ------------------------------------------------------------------ rollout
    def sample_completions(self, prompt_ids: list[list[int]], sampling: SamplingConfig | None = None,
                           continue_turn=None) -> Rollout:
        """Generate `num_generations` completions per prompt with the current policy. With the training
        sampling settings (`sampling` None) and `self.replays`, the rollout keeps the linear outputs.
        continue_turn: a multi-turn rollout's `Episodes` (see `generate`)."""
        tok = self.processing_class
        if self.vllm is not None:
            if self.state.global_step != self._vllm_synced_step:  # the policy moved since vLLM's weights were set
                from posttrain.rollout.vllm_engine import policy_weights

                self.vllm.load_weights(policy_weights(self.policy))
                self.accelerator.wait_for_everyone()  # server mode: the main process sends for all
                self._vllm_synced_step = self.state.global_step
            return self.vllm.generate(prompt_ids, sampling or self.sampling)
        return generate(self.policy, prompt_ids, sampling or self.sampling, pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id, tokenizer=tok, generator=self.generator,
                        record_linears=self.replays and sampling is None, continue_turn=continue_turn)

    def roll_out(self, inputs: dict, prompts: list, columns: dict, sampling: SamplingConfig | None = None,
                 mode: str = "train"):
        """(rollout, episodes or None) for a batch of prompts, `prompts` / `columns` repeated per completion.

        The user's `rollout_func(prompts, trainer)` when given (its extra fields join `columns`); else the
        sampler, multi-turn with tools or environments (each row's environment joins `columns` as
        `environments`, for `get_reward`)."""
        tok = self.processing_class
        if self.rollout_func is not None:
            rollout, extra = rollout_from_func(self.rollout_func(prompts, self), len(prompts), tok.pad_token_id,
                                               tok.eos_token_id)
            columns.update(extra)
            return rollout, None
        if self.tooling is None:
            return self.sample_completions(inputs["prompt_ids"], sampling), None
        G = (sampling or self.sampling).num_generations
        episodes, environments, prompt_ids = self.tooling.episodes(tok, prompts, columns, G, self.args.max_prompt_length)
        if environments is not None:
            columns["environments"] = environments
            prompts[:] = episodes.prompts  # with reset()'s text: the reward functions get the prompts the model saw
        rollout = self.sample_completions(prompt_ids or inputs["prompt_ids"], sampling, continue_turn=episodes)
        self.record(episodes.metrics(lambda x: self._gather_rows(x.to(self.accelerator.device))), mode)
        return rollout, episodes

    @torch.no_grad()
    def make_experience(self, inputs: dict) -> list[dict]:
        """Generate, score and prepare one generation batch; returns its micro-batches in training order."""
        k = self.args.num_generations
        self._start_time = self._start_time or time.time()
        prompts = [p for p in inputs["prompt"] for _ in range(k)]
        columns = {key: [v for v in values for _ in range(k)] for key, values in inputs["columns"].items()}
        rollout, episodes = self.roll_out(inputs, prompts, columns)
        texts, completions, ids = self.decode(rollout, prompts, episodes)
        per_function, scores = self.reward_scorer(prompts, completions, ids, columns, extra=self._reward_extras("train"))
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            scores = normalize_then_sum(per_function, self.reward_scorer.weights, self.args.num_generations)
        self._record_rewards(per_function)
        self._keep_samples(prompts, texts, per_function)
        return self.build_experience(rollout, scores)

    def _reward_extras(self, mode: str) -> dict:
        """The keyword arguments TRL passes every reward function besides the data: the trainer state and
        two logging hooks: `log_metric(name, value)` averages a number into the logs; `log_extra(column, values)`
        (one value per completion) adds a column to this batch's completions table (log_completions)."""
        self._extra_columns = defaultdict(list)  # this call's; `_keep_samples` takes them
        return {"trainer_state": self.state, "log_metric": lambda name, value: self.record({name: float(value)}, mode),
                "log_extra": lambda column, values: self._extra_columns[column].extend(values)}

    def decode(self, rollout: Rollout, prompts: list, episodes=None):
        """(texts, completions as reward functions get them (messages for chat prompts; a multi-turn
        episode's assistant turns, tool calls and tool results), token-id lists)."""
        lengths = rollout.completion_mask.sum(1).tolist()
        ids = [row[:n] for row, n in zip(rollout.completion_ids.tolist(), lengths)]
        texts = self.processing_class.batch_decode(ids, skip_special_tokens=True)
        if episodes is not None:
            return texts, episodes.completions(rollout), ids
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                       for p, t in zip(prompts, texts)]
        return texts, completions, ids

    # ------------------------------------------------------------------ experience
    def _gather_rows(self, x: Tensor) -> Tensor:
        """(N, ...) per process -> (processes * N, ...), per-token tensors padded to a common width."""
        if self.accelerator.num_processes == 1:
            return x
        if x.dim() > 1:
            x = self.accelerator.pad_across_processes(x, dim=1)
        return self.accelerator.gather(x)

    def _no_grad_forward(self, model, batch: dict, values: bool = False) -> Tensor:
        """Log-probs (or critic values) of the completions, `local_rollout_forward_batch_size` rows at a time."""
        step, out = self.args.local_rollout_forward_batch_size, []
        for s in range(0, batch["completion_ids"].shape[0], step):
            chunk = {k: v[s:s + step] for k, v in batch.items()}
            logp, _, v = self.forward(model, chunk, with_values=values)
            out.append(v if values else logp)
        return torch.cat(out)

    @torch.no_grad()
    def build_experience(self, rollout: Rollout, scores: Tensor) -> list[dict]:
        """Penalties, reference log-probs, old values, advantages and loss denominators for one batch."""
        args, acc = self.args, self.accelerator
        device = acc.device
        batch = {"prompt_ids": rollout.prompt_ids, "prompt_mask": rollout.prompt_mask,
                 "completion_ids": rollout.completion_ids, "completion_mask": rollout.completion_mask,
                 "old_logp": rollout.logprobs.float()}
        batch = {k: v.to(device) for k, v in batch.items()}
        if self.vllm is not None:  # vLLM's log-probs are not the policy's: kept for the importance weights only
            batch["vllm_logp"] = batch["old_logp"]
            if not self.old_is_current or args.kl_in_reward:  # where pi_old is read before the loss's forward
                batch["old_logp"] = self._no_grad_forward(self.policy, batch)
        N, C = batch["completion_ids"].shape
        batch["rollout_row"] = torch.arange(N, device=device)  # where each row's sampler record is
        self._replay = rollout.linear_outputs
        truncated = rollout.is_truncated.to(device)
        loss_mask = batch["completion_mask"].clone()
        if rollout.tool_mask is not None:  # fed tool results: context, out of the loss, the KL and the entropy
            loss_mask = loss_mask * (1 - rollout.tool_mask.to(device))
        if args.mask_truncated_completions:
            loss_mask[truncated] = 0
        batch["loss_mask"] = loss_mask
        scores = scores.to(device).float()
        if self.needs_reference:
            with self.reference_context(self.ref_model):
                ref = self.ref_model if self.ref_model is not None else self.policy  # PEFT: adapter disabled
                batch["ref_logp"] = self._no_grad_forward(ref, batch)
        if ADVANTAGES[args.advantage_estimator].critic:
            batch["old_values"] = self._no_grad_forward(acc.unwrap_model(self.model), batch, values=True)

        # everything below sees the batch of all processes
        g = {k: self._gather_rows(batch[k]) for k in ("loss_mask", "old_logp", "ref_logp", "old_values",
                                                      "completion_ids") if k in batch}
        g_truncated, mask = self._gather_rows(truncated), g["loss_mask"]
        shaped = shape_rewards(self._gather_rows(scores), mask, self.reward_shaping(), truncated=g_truncated,
                               logp=g["old_logp"], ref_logp=g.get("ref_logp"))
        self._record_rollout(g, shaped.penalized_scores, g_truncated)
        inp = AdvantageInput(scores=shaped.scores, mask=mask, group_size=args.num_generations, layout="prompt_major",
                             token_rewards=shaped.token_rewards, values=g.get("old_values"))
        advantages, returns = compute_advantages(args.advantage_estimator, inp, **self._options("advantage_estimator"))
        mine = slice(acc.process_index * N, (acc.process_index + 1) * N)
        batch["advantages"] = advantages[mine, :C].float()
        if returns is not None:
            batch["returns"] = returns[mine, :C].float()
        if args.kl_in_reward:
            batch.pop("ref_logp", None)  # the KL is in the advantages already
        self._episodes += mask.shape[0]
        return self._micro_batches(batch)

    def reward_shaping(self) -> RewardShaping:
        """The config's reward-shaping switches (`core.shaping`), read when a batch is shaped (PPO's adaptive
        controller sets `beta` just before)."""
        args = self.args
        return RewardShaping(missing_eos_penalty=args.missing_eos_penalty, normalize=args.normalize_reward,
                             clip_range=args.reward_clip_range, kl_in_reward=args.kl_in_reward, kl_coef=args.beta,
                             kl_estimator=args.kl_estimator, per_token=ADVANTAGES[args.advantage_estimator].per_token,
                             token_level_kl=args.token_level_kl, whiten=args.whiten_rewards)

    def _options(self, what: str) -> dict:
        """The config fields named by the options of the configured `what`, "advantage_estimator" or "policy_loss";
        an option without a field raises (config_options)."""
        registry = ADVANTAGES if what == "advantage_estimator" else POLICY_LOSSES
        return config_options(self.args, what, registry[getattr(self.args, what)])

    # A micro-batch is a dict of tensors (Trainer moves it to the device), B rows of one generation batch:
    #   prompt_ids (B, P) left-padded         prompt_mask (B, P)      completion_ids (B, C) right-padded
    #   completion_mask (B, C) 1 up to and including the stop token (attention)
    #   loss_mask (B, C) completion_mask, 0 for masked truncated rows   advantages (B, C), 0 on padding
    #   old_logp (B, C) log pi_old, the sampler's   ref_logp (B, C) only with beta > 0 and the KL in the loss
    #   vllm_logp (B, C) only with use_vllm: vLLM's log-prob of each sampled token (old_logp is then the policy's)
    #   old_values, returns (B, C) only with a critic
    #   denominator, token_denominator: scalars, this optimizer step's global counts / processes
    #   old_is_current: bool, the policy has not moved since sampling (old_logp = logp.detach())
    #   rollout_row (B,) each row's index in its rollout (to find its sampler record)
    #   last_of_generation: bool, the generation batch's last micro-batch (its record is then let go)
    def _micro_batches(self, batch: dict) -> list[dict]:
        """Split into micro-batches (shuffled per pass when the policy moves within a batch), each carrying the
        global denominators of its optimizer step."""
        args = self.args
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
            mb = _trim({k: v[idx] for k, v in batch.items()}, args.pad_to_multiple_of)
            denominator, token_denominator = counts[i // ga]
            if not self.global_denominator:  # bnpo: this micro-batch's own count
                denominator = count(mb["loss_mask"], L).clamp(min=1).double() * ga
            mb.update(denominator=denominator.float(), token_denominator=token_denominator.float(),
                      old_is_current=self.old_is_current, last_of_generation=i == len(rows) - 1)
            micro.append(mb)
        return micro

    # ------------------------------------------------------------------ loss
    def forward(self, model, mb: dict, with_values: bool = False, with_entropy: bool = False, replay: bool = False):
        """(log-probs (B, C) at the sampling temperature, entropy (B, C) or None, values (B, C) or None).
        Without a critic, each distinct prompt of the micro-batch is computed once (`completion_logprobs`).
        `replay`: the policy's forward, which may take its linear outputs from the sampler's record."""
        if not with_values:
            record = None
            if replay and self._replay is not None and mb.get("old_is_current") and "rollout_row" in mb:
                # the generation batch's last micro-batch is the record's last use: let it go layer by layer
                record = (self._replay, mb["rollout_row"], bool(mb.get("last_of_generation")))
            logp, entropy = completion_logprobs(model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                                mb["completion_mask"], self.args.temperature, with_entropy,
                                                replay=record)
            return logp, entropy, None
        ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
        attention = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
        C = mb["completion_ids"].shape[1]
        logp, entropy, _, out = token_logprobs(model, ids, attention, num_scored=C, temperature=self.args.temperature,
                                               with_entropy=with_entropy, return_outputs=True)
        values = out.value[:, -(C + 1):-1].float() if with_values else None
        return logp, entropy, values

    @property
    def experience(self) -> tuple[dict, ...]:
        """The current generation batch's micro-batches (`make_experience`), in training order."""
        return tuple(self._buffer)

    @property
    def holds_replay_record(self) -> bool:
        """Whether the sampler's recorded linear outputs (`accel/replay.py`) are still kept for the micro-batches to come."""
        return self._replay is not None

    def training_step(self, model, inputs, num_items_in_batch=None):
        index = inputs["micro_index"]
        if index == 0 or not self._buffer:
            # FSDP2 shards policy + critic as one module: the sampler's policy-alone forwards gather through it
            loading.route_through_fsdp_root(model, self.policy)
            self._replay = None  # the last batch's record goes before sampling the next
            self._buffer = self.make_experience(inputs)
        loss = super().training_step(model, self._buffer[index], num_items_in_batch)
        self._next_micro = index + 1
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        critic = ADVANTAGES[args.advantage_estimator].critic
        logp, entropy, values = self.forward(model, inputs, with_values=critic, with_entropy=True, replay=True)
        if inputs.get("last_of_generation"):
            self._replay = None  # the record's last use (each layer went once the forward read it)
        mask = inputs["loss_mask"]
        old_logp = logp.detach() if inputs["old_is_current"] else inputs["old_logp"]
        per_token, stats = POLICY_LOSSES[args.policy_loss].fn(logp, old_logp, inputs["advantages"], mask,
                                                              **self._options("policy_loss"))
        if "vllm_logp" in inputs and args.vllm_importance_sampling_correction:  # sampled by vLLM, not by pi_old
            per_token = per_token * truncated_importance_weights(old_logp, inputs["vllm_logp"],
                                                                 args.vllm_importance_sampling_clip_max)
        policy_avg = masked_mean(per_token.detach(), mask)
        metrics = {"loss/policy_avg": policy_avg, "policy_loss": policy_avg}  # TRL's name and the classic one
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

    # ------------------------------------------------------------------ metrics and samples
    def _record_rollout(self, g: dict, scores: Tensor, truncated: Tensor):
        mask = g["loss_mask"]
        k, eos = self.args.num_generations, self.processing_class.eos_token_id
        groups = scores.view(-1, k)
        group_std = groups.std(1) if k > 1 else torch.zeros_like(groups[:, 0])
        metrics = {"reward": scores.mean(), "reward_std": group_std.mean() if k > 1 else scores.std(),
                   "frac_reward_zero_std": (group_std < 1e-8).float().mean(), "objective/scores": scores.mean(),
                   "completions/mean_length": mask.sum(1).float().mean(),
                   "completions/clipped_ratio": truncated.float().mean(),
                   "objective/entropy": -masked_sum(g["old_logp"], mask, dim=1).mean(),
                   "val/num_eos_tokens": ((g["completion_ids"] == eos) & mask.bool()).sum().float()}
        if "ref_logp" in g:
            kl = masked_sum(g["old_logp"] - g["ref_logp"], mask, dim=1)  # k1, summed per sequence
            non_score = -self.args.beta * masked_sum(kl_penalty(g["old_logp"], g["ref_logp"], self.args.kl_estimator),
                                                     mask, dim=1)
            metrics.update({"objective/kl": kl.mean(), "objective/non_score_reward": non_score.mean(),
                            "objective/rlhf_reward": (scores + non_score).mean()})
        self.record({name: float(v) for name, v in metrics.items()}, "train")

    def _record_rewards(self, per_function: Tensor):
        table = self._gather_rows(per_function.to(self.accelerator.device))
        for j, name in enumerate(self.reward_scorer.names):
            col = table[:, j][~torch.isnan(table[:, j])]
            if col.numel():
                self.record({f"rewards/{name}/mean": col.mean().item(),
                             f"rewards/{name}/std": col.std().item() if col.numel() > 1 else 0.0}, "train")

    def _keep_samples(self, prompts, texts, per_function):
        """Gather this batch's samples from every process when a table is due (a `num_sample_generations`
        point now, or the next logging step with `log_completions`); write the table now if it is a point."""
        args, step = self.args, self.state.global_step
        every = max(1, self.state.max_steps // args.num_sample_generations) if args.num_sample_generations else 0
        sample_now = bool(every) and step % every == 0 and step != self._last_sample_step
        if not (args.log_completions or sample_now):
            self._samples = None
            return
        from accelerate.utils import gather_object

        scores = {name: per_function[:, j].tolist() for j, name in enumerate(self.reward_scorer.names)}
        extra = dict(getattr(self, "_extra_columns", {}))
        for column, values in extra.items():
            if len(values) != len(texts):
                raise ValueError(f"log_extra({column!r}, values): {len(values)} values for {len(texts)} completions; "
                                 "give one value per completion (the reward function's `completions`)")
        if self.accelerator.num_processes > 1:
            prompts, texts = gather_object(list(prompts)), gather_object(list(texts))
            scores = {name: gather_object(v) for name, v in scores.items()}
            extra = {column: gather_object(list(v)) for column, v in extra.items()}
        self._samples = (prompts, texts, scores, extra)
        if sample_now:
            self._last_sample_step = step
            if self.is_world_process_zero():
                self.completions_table.write(step, *self._samples)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "learning_rate" in logs:  # a training log
            logs["lr"] = logs["learning_rate"]
            logs["episode"] = self._episodes
            logs["eps"] = self._episodes / max(time.time() - (self._start_time or time.time()), 1e-9)
            if self.args.log_completions and self._samples is not None and self.is_world_process_zero():
                self.completions_table.write(self.state.global_step, *self._samples)
        super().log(logs, start_time)

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`num_generations_eval` completions per eval prompt (1 by default) with the training sampling settings;
        the mean rewards as metrics, and `eval_loss`: the policy loss (plus the in-loss KL) on these completions
        with advantages from their rewards, as TRL computes its eval loss on eval rollouts (no critic
        estimators: their loss needs value targets, so PPO reports rewards only). A dict of datasets is
        evaluated one by one, each with its name in the metric prefix (`eval_<name>_reward`), as Trainer does."""
        from accelerate.utils import gather_object

        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):  # Trainer's periodic evaluation names one of a dict's datasets
            dataset = self.eval_dataset[dataset]
        if isinstance(dataset, dict):
            metrics = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset: give one here or to the trainer")
        self._check_dataset(dataset, "eval_dataset")
        acc, bs = self.accelerator, self.args.per_device_eval_batch_size
        if is_streamed(dataset):  # every process reads the stream and keeps the rows at its positions
            mine = list(itertools.islice(dataset, acc.process_index, None, acc.num_processes))
        else:
            mine = [dataset[i] for i in range(acc.process_index, len(dataset), acc.num_processes)]
        k = self.args.num_generations_eval or 1
        sampling = dataclasses.replace(self.sampling, num_generations=k)
        rows, losses = [], []  # (total reward, per-function rewards, length) per completion; loss per batch
        for s in range(0, len(mine), bs):
            batch = self._collate(mine[s:s + bs])
            prompts = [p for p in batch["prompt"] for _ in range(k)]
            columns = {key: [v for v in values for _ in range(k)] for key, values in batch["columns"].items()}
            rollout, episodes = self.roll_out(batch, prompts, columns, sampling, mode="eval")
            texts, completions, ids = self.decode(rollout, prompts, episodes)
            per_function, total = self.reward_scorer(prompts, completions, ids, columns,
                                                     extra=self._reward_extras("eval"))
            rows += zip(total.tolist(), per_function.tolist(), map(len, ids))
            loss = None if ADVANTAGES[self.args.advantage_estimator].critic else self._eval_loss(rollout, total, k)
            if loss is not None:  # None: the trainer has no eval loss on these rollouts
                losses.append(loss)
        rows = gather_object(rows) if acc.num_processes > 1 else rows
        p = metric_key_prefix
        metrics = {f"{p}_reward": sum(r[0] for r in rows) / max(len(rows), 1),
                   f"{p}_completions/mean_length": sum(r[2] for r in rows) / max(len(rows), 1)}
        if losses:
            losses = gather_object(losses) if acc.num_processes > 1 else losses
            metrics[f"{p}_loss"] = sum(losses) / len(losses)
        for j, name in enumerate(self.reward_scorer.names):
            values = [r[1][j] for r in rows if not math.isnan(r[1][j])]
            if values:
                metrics[f"{p}_rewards/{name}/mean"] = sum(values) / len(values)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _eval_loss(self, rollout: Rollout, scores: Tensor, k: int) -> float | None:
        """The training loss of one eval batch at ratio 1 (old = current): the policy loss with this batch's
        advantages, plus beta * KL where the KL is in the loss."""
        args, device = self.args, self.accelerator.device
        batch = {key: getattr(rollout, key).to(device)
                 for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        mask = batch["completion_mask"] * (1 - rollout.tool_mask.to(device) if rollout.tool_mask is not None else 1)
        logp = self._no_grad_forward(self.policy, batch)
        scores = scores.to(device).float()
        if k < ADVANTAGES[args.advantage_estimator].min_group:  # nothing to compare with: no signal
            advantages = torch.zeros_like(logp)
        else:
            inp = AdvantageInput(scores=scores, mask=mask, group_size=k, layout="prompt_major")
            advantages, _ = compute_advantages(args.advantage_estimator, inp,
                                               **self._options("advantage_estimator"))
        per_token, _ = POLICY_LOSSES[args.policy_loss].fn(logp, logp, advantages[:, :logp.shape[1]].float(), mask,
                                                          **self._options("policy_loss"))
        if args.beta > 0 and not args.kl_in_reward:
            with self.reference_context(self.ref_model):
                ref_logp = self._no_grad_forward(self.ref_model if self.ref_model is not None else self.policy, batch)
            per_token = per_token + args.beta * kl_penalty(logp, ref_logp, args.kl_estimator)
        return float(aggregate_loss(per_token, mask, self.loss_mode, max_length=args.max_completion_length))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        model = self.accelerator.unwrap_model(self.model)
        if isinstance(model, (CausalLMWithValueHead, PolicyWithCritic)):
            output_dir = output_dir or self.args.output_dir
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                model.save_pretrained(output_dir)
                self.processing_class.save_pretrained(output_dir)
                with open(os.path.join(output_dir, "README.md"), "w") as f:  # the model card, as BaseTrainer writes it
                    f.write(self.model_card(os.path.basename(os.path.normpath(output_dir))))
            return
        super().save_model(output_dir, _internal_call)

    # ------------------------------------------------------------------ checkpoints
    # Besides transformers' checkpoint (weights, optimizer, scheduler, global RNGs, trainer state and the data
    # position) and BaseTrainer's, a step depends on the sampler's and the micro-batch shuffle's generators,
    # the episode count and the generation batch in progress: BaseTrainer saves these attributes with each
    # checkpoint, per process. The critic is saved with the policy (`save_model`).
    checkpointed = BaseTrainer.checkpointed + ("generator", "_shuffle", "_episodes", "_last_sample_step",
                                               "_generation_in_progress", "_stream_position")

    @property
    def _stream_position(self) -> dict | None:
        """A streamed train_dataset's place (`_PromptStream`); None (not saved) for other datasets."""
        return dict(self._stream_pos) if is_streamed(self.train_dataset) else None

    @_stream_position.setter
    def _stream_position(self, position: dict):
        self._stream_pos, self._stream_resumed = dict(position), True

    @property
    def _generation_in_progress(self) -> dict:
        """What a checkpoint taken inside a generation batch (several optimizer steps per batch:
        steps_per_generation > gradient_accumulation_steps, or num_iterations > 1) needs to go on: the
        micro-batches not yet trained on and the batch's samples; also metrics not yet logged and the
        sampling time so far (for `eps`). Between generation batches, nothing of the batch is kept."""
        pending = self._next_micro < len(self._buffer)
        return {"buffer": self._buffer if pending else [], "next_micro": self._next_micro if pending else 0,
                "samples": self._samples if pending else None, "plan": self._generation_plan(),
                "elapsed": None if self._start_time is None else time.time() - self._start_time,
                "metrics": {mode: dict(values) for mode, values in self._metrics.items()}}

    def _generation_plan(self) -> dict[str, int]:
        """The settings that cut a generation batch into micro-batches and optimizer steps."""
        names = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                 "num_iterations", "num_generations")
        return {**{n: getattr(self.args, n) for n in names}, "processes": self.accelerator.num_processes}

    def _check_generation_plan(self, state: dict):
        """Refuse to finish a stored generation batch under settings that cut it otherwise (its micro-batches
        would not match the steps left: transformers' loop would index past them)."""
        plan, now = state.get("plan"), self._generation_plan()
        if plan is None:  # written before plans were stored: the batch's length tells
            expected = self.args.steps_per_generation * self.args.num_iterations
            plan, now = {"micro-batches per generation batch": len(state["buffer"])}, \
                {"micro-batches per generation batch": expected}
        changed = {k: (v, now.get(k)) for k, v in plan.items() if now.get(k) != v}
        if changed:
            was = ", ".join(f"{k}={old}" for k, (old, _) in changed.items())
            raise ValueError(
                f"the checkpoint was taken inside a generation batch (micro-batch {state['next_micro']} of "
                f"{len(state['buffer'])}) planned with {was}; this run has "
                f"{', '.join(f'{k}={new}' for k, (_, new) in changed.items())}. Resume with the checkpoint's "
                f"{was} to finish the stored batch (change it later from a checkpoint taken between generation "
                "batches, i.e. save_steps a multiple of the optimizer steps per generation batch), or resume from "
                "an earlier checkpoint taken between generation batches")

    @_generation_in_progress.setter
    def _generation_in_progress(self, state: dict):
        if state["buffer"]:
            self._check_generation_plan(state)
        self._buffer, self._next_micro, self._samples = state["buffer"], state["next_micro"], state["samples"]
        self._replay = None  # kept only within one optimizer step (old == current), never across a checkpoint
        self._start_time = None if state["elapsed"] is None else time.time() - state["elapsed"]
        for mode, values in state["metrics"].items():
            self._metrics[mode].clear()
            self._metrics[mode].update(values)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None):
        # transformers' private loader, overridden because it cannot read policy + critic (the policy is saved
        # as an ordinary causal-LM checkpoint, the critic next to it) and no public hook loads the weights
        unwrapped = self.accelerator.unwrap_model(model if model is not None else self.model)
        if isinstance(unwrapped, (CausalLMWithValueHead, PolicyWithCritic)):
            super()._load_from_checkpoint(resume_from_checkpoint, unwrapped.policy)
            unwrapped.load_critic(resume_from_checkpoint)
        else:
            super()._load_from_checkpoint(resume_from_checkpoint, model)


def _no_dropout(model) -> bool:
    """Whether the training forward computes what eval-mode sampling computed: no dropout anywhere."""
    config = getattr(model, "config", None)
    return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) and not (
        getattr(config, "attention_dropout", 0.0) or 0.0)


def _trim(mb: dict, multiple: int | None = None) -> dict:
    """Drop prompt columns that are padding in every row (left) and completion columns past the longest
    completion (right), rounded up to a multiple of `multiple` (pad_to_multiple_of) where there are columns."""
    keep_p = mb["prompt_mask"].any(0).nonzero()
    start = int(keep_p[0]) if len(keep_p) else mb["prompt_mask"].shape[1] - 1
    width = max(int(mb["completion_mask"].sum(1).max()), 1)
    if multiple:
        width = min(-(-width // multiple) * multiple, mb["completion_mask"].shape[1])
    out = {}
    for key, value in mb.items():
        if key.startswith("prompt"):
            out[key] = value[:, start:]
        elif key.startswith("teacher_prompt"):  # a teacher's own prompt (self-distillation): its own padding
            out[key] = value
        elif value.dim() == 2:
            out[key] = value[:, :width]
        else:
            out[key] = value
    return out
