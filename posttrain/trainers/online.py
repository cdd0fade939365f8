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

With `max_staleness` > 0 (asynchronous rollouts, `online_async.py`), steps 1-3 of the next generation batches
run in a background thread, by a copy of the policy up to `max_staleness` optimizer steps old, while the current
batch trains; old_logp is then that policy's and the clipped ratio corrects for the staleness.

The configuration, `OnlineConfig`, lives in `online_config.py` (imported here); what flows between the
phases is `core.batch.Experience`; evaluation, metrics and checkpointed state are mixins in `online_eval.py`,
`online_metrics.py` and `online_state.py`.

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
import logging
import math
import os
import threading
import time
from collections import defaultdict

import torch
from torch import Tensor
from transformers import TrainerCallback

from posttrain.core.advantages import ADVANTAGES, AdvantageInput, compute_advantages
from posttrain.core.batch import Experience
from posttrain.core.dynamic_sampling import informative_groups, kept_rows
from posttrain.core.importance import IMPORTANCE_CORRECTIONS
from posttrain.core.kl import kl_penalty
from posttrain.core.masked import AGGREGATIONS, aggregate_loss, count_tokens, masked_mean, masked_var, top_quantile_mask
from posttrain.core.policy_losses import POLICY_LOSSES, clipped_value_loss, entropy_bonus
from posttrain.core.shaping import RewardShaping, normalize_then_sum, shape_rewards
from posttrain.data.multimodal import image_token_ids
from posttrain.data.tokenize import check_prompts, encode_prompt
from posttrain.forward.completions import completion_logprobs
from posttrain.forward.logprobs import token_logprobs
from posttrain.forward.vision import forward_inputs, has_images, row_part
from posttrain.models import loading
from posttrain.models.modes import disable_dropout
from posttrain.models.value_head import CausalLMWithValueHead, PolicyWithCritic
from posttrain.rollout.combine import take_rows
from posttrain.rollout.generate import Rollout, SamplingConfig, generate
from posttrain.rollout.images import (check_image_prompts, encode_image_prompts, has_image_prompts, load_policy,
                                      text_tokenizer)
from posttrain.rollout.multiturn import Tooling, engine_turns, rollout_from_func
from posttrain.rollout.rewards import RewardScorer
from posttrain.trainers.base import (BaseTrainer, SyncRefModelCallback, as_dataset, check_datasets,
                                     classic_arguments, is_streamed, seed_run)
from posttrain.trainers.online_async import AsyncRollouts, Sampled, gather_rows
from posttrain.trainers.online_config import GENERATION_KWARGS, OnlineConfig, config_options, shaping_steps
from posttrain.trainers.online_eval import OnlineEvaluation
from posttrain.trainers.online_metrics import OnlineMetrics
from posttrain.trainers.online_state import OnlineCheckpoints
from posttrain.trainers.prompts import (PromptBatches, _collate_streamed, _PromptStream, new_stream_position,
                                        top_up_prompts)

logger = logging.getLogger(__name__)


def _prepare_policy(policy, args: OnlineConfig, peft_config, value_model, init_kwargs: dict):
    """The loaded policy made ready to train (dropout off, the output layer in float32 if asked, the PEFT adapter)
    and the module the trainer trains: the policy, or the policy with its critic for critic estimators."""
    if args.disable_dropout:
        disable_dropout(policy)
    if args.cast_lm_head_to_fp32 and policy.get_output_embeddings() is not None:
        policy.get_output_embeddings().float()  # the log-probs' last matmul and softmax in float32
    peft_config = BaseTrainer.vision_parts(policy, args, peft_config)  # a VLM: parts frozen, LoRA on its LM only
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
    if args.use_vllm and args.vllm_mode == "colocate" and args.vllm_tensor_parallel_size > 1:
        raise ValueError("tools= / environment_factory= with vLLM make one request per turn, and the processes "
                         "sharing a colocated engine (vllm_tensor_parallel_size > 1) would make different numbers "
                         "of them: use vllm_tensor_parallel_size=1 or vllm_mode='server'")
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


def _sampling_config(args: OnlineConfig, processor=None) -> SamplingConfig:
    """The sampler's settings from the config, `generation_kwargs` over the fields. With a VLM's `processor`, its
    image tokens are never sampled: a completion's image token would have no image for the training forward."""
    sampling = SamplingConfig(
        max_new_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, num_generations=args.num_generations,
        stop_token_ids=tuple(args.stop_token_ids or ()), stop_strings=tuple(args.stop_strings or ()),
        repetition_penalty=args.repetition_penalty,
        suppress_token_ids=tuple(sorted(image_token_ids(processor))) if processor is not None else ())
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


class OnlineTrainer(OnlineMetrics, OnlineEvaluation, OnlineCheckpoints, BaseTrainer):
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
                (check_image_prompts if self.vision else check_prompts)(data, processing_class, what)
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
                                          tokenizer=text_tokenizer(processing_class), device=self.accelerator.device,
                                          timeout=args.reward_timeout)
        self.reward_processing_classes = reward_processing_classes  # as TRL's trainer exposes them
        if loading.shards_weights(self.accelerator):  # ZeRO-3 / FSDP2: reward models sharded like the policy
            self.reward_scorer.funcs = [loading.prepare_frozen(self.accelerator, f) if isinstance(f, torch.nn.Module)
                                        else f for f in self.reward_scorer.funcs]
        self._set_reference(ref_model, policy, args)
        self.sampling = _sampling_config(args, processing_class if self.vision else None)
        self.vllm, self._vllm_synced_step = None, None  # with use_vllm: the engine, and the step its weights are of
        if args.use_vllm:
            from posttrain.rollout.vllm_engine import make_engine

            name = model if isinstance(model, str) else getattr(policy.config, "_name_or_path", None)
            extra = {k: v for k, v in (args.generation_kwargs or {}).items() if k not in GENERATION_KWARGS}
            self.vllm = make_engine(args, name, self.accelerator, processing_class.pad_token_id,
                                    processing_class.eos_token_id, extra, policy=policy)
        self.generator = torch.Generator().manual_seed(args.seed + 7919 * self.accelerator.process_index)
        self._shuffle = torch.Generator().manual_seed(args.seed + 1)
        self.loss_mode, self.global_denominator = args.loss_aggregation()
        # the policy can move between sampling and training only with several optimizer steps or passes, or sampling ahead
        self.old_is_current = not args.max_staleness and args.num_iterations == 1 and \
            args.steps_per_generation == args.gradient_accumulation_steps
        self.replays = _replays(args, policy, self.old_is_current)
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

    def _async_rollouts(self, train_dataset) -> AsyncRollouts | None:
        """With max_staleness > 0, the background sampler (`online_async.py`); None for the synchronous engine."""
        args, self._sampling_thread = self.args, threading.local()  # in the sampler's thread: its model and metrics
        depth = args.max_staleness // max(self.optimizer_steps_per_generation, 1)
        if not depth:
            return None
        if not self.samples_in_background:
            raise ValueError(f"{type(self).__name__} samples with more than the policy (a teacher, the reference) "
                             "and does not run asynchronous rollouts: set max_staleness=0")
        if train_dataset is not None and is_streamed(train_dataset):
            raise ValueError("max_staleness > 0 samples the next generation batches before their turn, which needs "
                             "a map-style train_dataset (a stream's later prompts are not known ahead): set "
                             "max_staleness=0 or pass a datasets.Dataset")
        rollouts = AsyncRollouts(self, depth)
        self.add_callback(_CloseRollouts(rollouts))
        return rollouts

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
        tok, limit = text_tokenizer(self.processing_class), self.args.max_prompt_length
        vision = None
        if "prompt" in rows[0] and has_image_prompts(rows):  # image prompts: ids with the image tokens, and pixels
            if self.tooling is not None:
                raise ValueError("tools= / environment_factory= with image prompts are not supported yet: the tool "
                                 "schemas and tool turns are rendered by the text chat template")
            prompts = [row["prompt"] for row in rows]
            prompt_ids, vision = encode_image_prompts(self.processing_class, rows, self.args.chat_template_kwargs,
                                                      limit)
        elif "prompt" in rows[0]:
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
        if vision is None:
            return {"prompt": prompts, "prompt_ids": prompt_ids, "columns": columns}
        return {"prompt": prompts, "prompt_ids": prompt_ids, "columns": columns, "vision": vision}

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
                             args.steps_per_generation * args.num_iterations, args.shuffle_dataset, args.seed,
                             ahead=self.rollouts.depth if getattr(self, "rollouts", None) else 0)

    # ------------------------------------------------------------------ rollout
    def sample_completions(self, prompt_ids: list[list[int]], sampling: SamplingConfig | None = None,
                           continue_turn=None, vision: list[dict] | None = None) -> Rollout:
        """Generate `num_generations` completions per prompt with the current policy. With the training
        sampling settings (`sampling` None) and `self.replays`, the rollout keeps the linear outputs.
        continue_turn: a multi-turn rollout's `Episodes`; vision: image prompts' processor outputs (see `generate`)."""
        tok = text_tokenizer(self.processing_class)
        if self.vllm is not None and vision is not None:
            raise ValueError("use_vllm=True does not take image prompts here: posttrain's sampler does (use_vllm=False)")
        background = getattr(self._sampling_thread, "model", None)  # the asynchronous sampler's copy, in its thread
        if self.vllm is not None:  # in the asynchronous sampler's thread, its job has synced the engine already
            if background is None and self.state.global_step != self._vllm_synced_step:  # moved since the last sync
                self.vllm.sync(self.policy)  # its weights, or its LoRA adapter alone (vllm_sync_strategy)
                self.accelerator.wait_for_everyone()  # server mode: the main process sends for all
                self._vllm_synced_step = self.state.global_step
            if continue_turn is not None:  # tools, environments: one vLLM call per turn (multiturn.engine_turns)
                return engine_turns(self.vllm.generate, prompt_ids, sampling or self.sampling, continue_turn,
                                    tok.pad_token_id, tok.eos_token_id)
            return self.vllm.generate(prompt_ids, sampling or self.sampling)
        return generate(background or self.policy, prompt_ids, sampling or self.sampling, pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id, tokenizer=tok, generator=self.generator,
                        record_linears=self.replays and sampling is None, continue_turn=continue_turn, vision=vision)

    def roll_out(self, inputs: dict, prompts: list, columns: dict, sampling: SamplingConfig | None = None,
                 mode: str = "train"):
        """(rollout, episodes or None) for a batch of prompts, `prompts` / `columns` repeated per completion.

        The user's `rollout_func(prompts, trainer)` when given (its extra fields join `columns`); else the
        sampler, multi-turn with tools or environments (each row's environment joins `columns` as
        `environments`, for `get_reward`)."""
        tok = text_tokenizer(self.processing_class)
        if self.rollout_func is not None:
            rollout, extra = rollout_from_func(self.rollout_func(prompts, self), len(prompts), tok.pad_token_id,
                                               tok.eos_token_id)
            columns.update(extra)
            return rollout, None
        if self.tooling is None:
            vision = inputs.get("vision")  # passed only with images: subclasses may override the text-only signature
            extra = {} if vision is None else {"vision": vision}
            return self.sample_completions(inputs["prompt_ids"], sampling, **extra), None
        G = (sampling or self.sampling).num_generations
        episodes, environments, prompt_ids = self.tooling.episodes(tok, prompts, columns, G, self.args.max_prompt_length)
        if environments is not None:
            columns["environments"] = environments
            prompts[:] = episodes.prompts  # with reset()'s text: the reward functions get the prompts the model saw
        rollout = self.sample_completions(prompt_ids or inputs["prompt_ids"], sampling, continue_turn=episodes)
        self.record(episodes.metrics(lambda x: self._gather_rows(x.to(self.accelerator.device))), mode)
        return rollout, episodes

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

    def _record_sampled(self, sampled: Sampled):
        """Log what sampling a generation batch gave: its metrics, rewards and samples."""
        for metrics, mode in sampled.records:  # recorded while it was sampled in the background
            self.record(metrics, mode)
        self._record_rewards(sampled.per_function)
        self._keep_samples(sampled.prompts, sampled.texts, sampled.per_function, sampled.extra_columns)

    def dynamic_sampling(self, sampled: Sampled) -> tuple[Rollout, Tensor]:
        """DAPO's dynamic sampling (`core/dynamic_sampling.py`): (rollout, scores) of the groups of this generation
        batch whose rewards differ, topped up from more generation batches (`top_up_prompts`) until every process
        has a batch of them. Every process draws as many batches (the count is agreed), so collectives stay paired."""
        args, k, device = self.args, self.args.num_generations, self.accelerator.device
        needed = args.per_process_generation // k  # groups per process and generation batch
        parts, scores = [sampled.rollout], [sampled.scores]
        informative = informative_groups(sampled.scores.float().cpu(), k)
        while int(self._gather_rows(informative.sum().view(1).to(device)).min()) < needed:
            if 0 < args.max_num_gen_batches <= len(parts):
                raise ValueError(
                    f"dynamic sampling (filter_groups_enable) drew max_num_gen_batches={args.max_num_gen_batches} "
                    f"generation batches and kept {int(informative.sum())} of the {needed} prompt groups one needs "
                    f"(this process): the others' completions all got the same reward, so the task is too easy or "
                    "too hard for the policy, or the reward does not vary; raise max_num_gen_batches (<= 0: no "
                    "limit) or check the reward functions")
            more = self.sample_and_score(self._top_up_prompts())
            self._record_sampled(more)
            parts.append(more.rollout)
            scores.append(more.scores)
            informative = torch.cat([informative, informative_groups(more.scores.float().cpu(), k)])
        counts = torch.tensor([[informative.numel(), int(informative.sum())]], device=device)
        drawn, kept = self._gather_rows(counts).sum(0).tolist()  # groups over all processes
        self.record({"dynamic_sampling/gen_batches": len(parts), "dynamic_sampling/groups_drawn": drawn,
                     "dynamic_sampling/groups_dropped": drawn - kept}, "train")
        rows = kept_rows(informative, k, needed)
        scores = torch.cat(scores)
        return take_rows(parts, rows, self.processing_class.pad_token_id), scores[rows.to(scores.device)]

    def _top_up_prompts(self) -> dict:
        """This process's prompts of one more generation batch for dynamic sampling, collated; read from the
        train dataset in an order of its own whose place (`_top_up_position`) each checkpoint keeps."""
        if self._top_up is None:
            args, acc = self.args, self.accelerator
            self._top_up = top_up_prompts(self.train_dataset, is_streamed(self.train_dataset),
                                          args.per_process_generation // args.num_generations, acc.num_processes,
                                          acc.process_index, self._top_up_pos, args.shuffle_dataset, args.seed)
        return self._collate(next(self._top_up))

    @torch.no_grad()
    def sample_and_score(self, inputs: dict) -> Sampled:
        """Sample `num_generations` completions of each prompt of `inputs`, decode them and score them with the
        reward functions: the phase that runs in the background with asynchronous rollouts."""
        k = self.args.num_generations
        prompts = [p for p in inputs["prompt"] for _ in range(k)]
        columns = {key: [v for v in values for _ in range(k)] for key, values in inputs["columns"].items()}
        rollout, episodes = self.roll_out(inputs, prompts, columns)
        texts, completions, ids = self.decode(rollout, prompts, episodes)
        extra_columns = defaultdict(list)
        per_function, scores = self.reward_scorer(prompts, completions, ids, columns,
                                                  extra=self._reward_extras("train", extra_columns))
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            scores = normalize_then_sum(per_function, self.reward_scorer.weights, self.args.num_generations)
        return Sampled(rollout, scores, per_function, prompts, texts, extra_columns, records=[],
                       version=self.state.global_step)

    def _reward_extras(self, mode: str, extra_columns: dict | None = None) -> dict:
        """The keyword arguments TRL passes every reward function besides the data: the trainer state and
        two logging hooks: `log_metric(name, value)` averages a number into the logs; `log_extra(column, values)`
        (one value per completion) adds a column to this batch's completions table (log_completions), kept in
        `extra_columns`."""
        columns = defaultdict(list) if extra_columns is None else extra_columns
        return {"trainer_state": self.state, "log_metric": lambda name, value: self.record({name: float(value)}, mode),
                "log_extra": lambda column, values: columns[column].extend(values)}

    def record(self, metrics: dict, mode: str | None = None):
        """BaseTrainer.record; in the asynchronous sampler's thread, kept with the batch being sampled (as floats)
        and recorded when the batch trains."""
        kept = getattr(self._sampling_thread, "records", None)
        if kept is None:
            return super().record(metrics, mode)
        kept.append(({name: float(v.detach().float().mean()) if isinstance(v, Tensor) else float(v)
                      for name, v in metrics.items()}, mode or "train"))

    def decode(self, rollout: Rollout, prompts: list, episodes=None):
        """(texts, completions as reward functions get them (messages for chat prompts; a multi-turn
        episode's assistant turns, tool calls and tool results), token-id lists)."""
        lengths = rollout.completion_mask.sum(1).tolist()
        ids = [row[:n] for row, n in zip(rollout.completion_ids.tolist(), lengths)]
        texts = text_tokenizer(self.processing_class).batch_decode(ids, skip_special_tokens=True)
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
        if getattr(self._sampling_thread, "group", None) is not None:  # the asynchronous sampler's own group
            return gather_rows(x, self._sampling_thread.group)
        if x.dim() > 1:
            x = self.accelerator.pad_across_processes(x, dim=1)
        return self.accelerator.gather(x)

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
        batch.replay = rollout.linear_outputs  # the sampler's record, shared by the micro-batches (accel/replay.py)
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
            with self.reference_context(self.ref_model):
                ref = self.ref_model if self.ref_model is not None else self.policy  # PEFT: adapter disabled
                batch.ref_logp = self._no_grad_forward(ref, batch)
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
            mb.old_is_current, mb.last_of_generation = self.old_is_current, i == len(rows) - 1
            if not (self.old_is_current and self.replays):
                mb.replay = None  # the record serves only a forward whose weights are the sampler's
            micro.append(mb)
        return micro

    # ------------------------------------------------------------------ loss
    def forward(self, model, mb: dict, with_values: bool = False, with_entropy: bool = False, replay: bool = False):
        """(log-probs (B, C) at the sampling temperature, entropy (B, C) or None, values (B, C) or None).
        Without a critic, each distinct prompt of the micro-batch is computed once (`completion_logprobs`).
        `replay`: the policy's forward, which may take its linear outputs from the sampler's record."""
        if not with_values:
            record = None
            held = getattr(mb, "replay", None)
            if replay and held is not None and mb.old_is_current and mb.rollout_row is not None:
                # the generation batch's last micro-batch is the record's last use: let it go layer by layer
                record = (held, mb.rollout_row, mb.last_of_generation)
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
        """Whether the sampler's recorded linear outputs (`accel/replay.py`) are still kept for the micro-batches to come."""
        return any(mb.replay is not None and any(t is not None for t in mb.replay.layers)
                   for mb in self._buffer[self._next_micro:])

    def training_step(self, model, inputs, num_items_in_batch=None):
        index = inputs["micro_index"]
        if index == 0 or not self._buffer:
            # FSDP2 shards policy + critic as one module: the sampler's policy-alone forwards gather through it
            loading.route_through_fsdp_root(model, self.policy)
            self._buffer = []  # the last batch's micro-batches (and any record) go before sampling the next
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


def _replays(args: OnlineConfig, policy, old_is_current: bool) -> bool:
    """Whether the training forward takes the sampler's linear outputs (accel/replay.py): only when the policy
    cannot have moved since sampling, in float32 without dropout, compile or checkpointing, and not with dynamic
    sampling (its batch joins rows of several rollouts; the record indexes one)."""
    return (args.replay_linear_outputs and old_is_current and not ADVANTAGES[args.advantage_estimator].critic
            and not (args.bf16 or args.fp16 or args.torch_compile or args.gradient_checkpointing)
            and _no_dropout(policy) and not args.filter_groups_enable)


def _no_dropout(model) -> bool:
    """Whether the training forward computes what eval-mode sampling computed: no dropout anywhere."""
    config = getattr(model, "config", None)
    return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) and not (
        getattr(config, "attention_dropout", 0.0) or 0.0)


class _CloseRollouts(TrainerCallback):
    """At the end of training: drop the batches sampled ahead that no step will train on."""

    def __init__(self, rollouts: AsyncRollouts):
        self.rollouts = rollouts

    def on_train_end(self, args, state, control, **kwargs):
        self.rollouts.close()
