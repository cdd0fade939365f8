"""The online engine's setup: what `OnlineTrainer.__init__` wires together before the loop runs. The policy made
ready to train (and its critic), tools and environments, the sampler's settings, the datasets and reward
functions checked, the reward scorer, the vLLM engine, the reference model, the background sampler of
asynchronous rollouts, and whether the training forward may replay the sampler's linear outputs.

Module functions take the config and return what the trainer keeps; `OnlineSetup` holds the few that are
methods (a preset overrides `uses_reference`). No behaviour of its own: this is online.py's wiring, moved out so
that online.py reads as the loop.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading

import torch
from transformers import TrainerCallback

from posttrain.data.multimodal import image_token_ids
from posttrain.data.tokenize import check_prompts
from posttrain.models import loading
from posttrain.models.modes import disable_dropout
from posttrain.models.value_head import CausalLMWithValueHead, PolicyWithCritic
from posttrain.rollout.generate import SamplingConfig
from posttrain.rollout.images import check_image_prompts, text_tokenizer
from posttrain.rollout.multiturn import Tooling
from posttrain.rollout.rewards import RewardScorer
from posttrain.trainers.base import BaseTrainer, SyncRefModelCallback, as_dataset, check_datasets, is_streamed
from posttrain.trainers.online_async import AsyncRollouts
from posttrain.trainers.online_config import GENERATION_KWARGS, OnlineConfig

logger = logging.getLogger(__name__)


def prepare_policy(policy, args: OnlineConfig, peft_config, value_model, init_kwargs: dict, critics: list[str]):
    """The loaded policy made ready to train (dropout off, the output layer in float32 if asked, the PEFT adapter)
    and the module the trainer trains: the policy, or the policy with its critic for the estimators `critics`
    (the names of the critic estimators)."""
    if args.disable_dropout:
        disable_dropout(policy)
    if args.cast_lm_head_to_fp32 and policy.get_output_embeddings() is not None:
        policy.get_output_embeddings().float()  # the log-probs' last matmul and softmax in float32
    peft_config = BaseTrainer.vision_parts(policy, args, peft_config)  # a VLM: parts frozen, LoRA on its LM only
    policy = loading.apply_peft(policy, peft_config, args.gradient_checkpointing)
    if args.advantage_estimator in critics:  # the critic trains with the policy, in one module
        critic = value_model if value_model is None else loading.load_sequence_classifier(
            value_model, convert_causal_lm=True, **init_kwargs)  # a causal LM: a fresh score head, with a warning
        return policy, CausalLMWithValueHead(policy) if critic is None else PolicyWithCritic(policy, critic)
    if value_model is not None:
        raise ValueError(f"value_model is only used by critic estimators {critics}, "
                         f"not advantage_estimator={args.advantage_estimator!r}")
    return policy, policy


def tooling(args: OnlineConfig, tools, environment_factory, reward_funcs, train_dataset):
    """tools= / environment_factory=: multi-turn rollouts (rollout/multiturn.py) -> (the `Tooling` or None, the
    reward functions, the train dataset). An environment's get_reward() is one more reward function, named after
    its class; without a train_dataset, the environments' reset() supplies the prompts."""
    if not tools and environment_factory is None:
        return None, reward_funcs, train_dataset
    if args.use_vllm and args.vllm_mode == "colocate" and args.vllm_tensor_parallel_size > 1:
        raise ValueError("tools= / environment_factory= with vLLM make one request per turn, and the processes "
                         "sharing a colocated engine (vllm_tensor_parallel_size > 1) would make different numbers "
                         "of them: use vllm_tensor_parallel_size=1 or vllm_mode='server'")
    made = Tooling(tools, environment_factory, max_iterations=args.max_tool_calling_iterations
                   if args.max_tool_calling_iterations is not None else 2 ** 31,
                   timeout=args.tool_call_timeout, max_call_chars=args.max_tool_call_chars,
                   max_result_chars=args.max_tool_result_chars, max_images=args.max_tool_images)
    env_rewards = made.environment_rewards()
    if env_rewards:
        given = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
            else [reward_funcs]
        reward_funcs = given + env_rewards
    if train_dataset is None and environment_factory is not None:  # reset() supplies the prompts
        train_dataset = made.reset_dataset(args)
    return made, reward_funcs, train_dataset


def sampling_config(args: OnlineConfig, processor=None) -> SamplingConfig:
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


def positions(policy, args: OnlineConfig) -> int | None:
    """The model's max_position_embeddings (None if it has none), warning when the configured limits reach past
    it; prompts that do when max_prompt_length is None are warned about once they are seen (`_collate`)."""
    found = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    if found and (args.max_prompt_length or 0) + args.max_completion_length > found:
        logger.warning(f"max_prompt_length={args.max_prompt_length} + max_completion_length="
                       f"{args.max_completion_length} exceeds the model's max_position_embeddings="
                       f"{found}: sequences that long go past the positions it was trained on")
    return found


def checked_inputs(trainer, args: OnlineConfig, processing_class, reward_funcs, train_dataset, eval_dataset,
                   made_tooling, rollout_func):
    """(train_dataset, eval_dataset) as datasets, after refusing what cannot train: no prompts where the trainer
    needs them, rollout_func with tools, no reward; and the datasets' columns and prompts checked here, not at a
    step. With total_episodes, `args.max_steps` is set from it (before transformers asks a stream for it)."""
    name = type(trainer).__name__
    if train_dataset is None and trainer.prompts_required:
        raise ValueError(f"train_dataset is required: {name} samples completions of its prompts "
                         "(or give environment_factory= whose environments' reset() supply them)")
    if rollout_func is not None and made_tooling is not None:
        raise ValueError("rollout_func replaces the built-in sampler, tools and environments included; give "
                         "rollout_func or tools= / environment_factory=, not both")
    if reward_funcs is None or (isinstance(reward_funcs, (list, tuple)) and not reward_funcs):
        raise ValueError("reward_funcs is required: reward functions, reward models, or model names "
                         "(or set reward_model_path, or give an environment_factory whose environments "
                         "have get_reward)")
    train_dataset, eval_dataset = as_dataset(train_dataset), as_dataset(eval_dataset, "eval_dataset")
    if train_dataset is not None:  # None is allowed: PPO's manual loop (generate / step) needs no prompts
        check_datasets(args, train_dataset, eval_dataset)
    trainer._check_dataset(train_dataset, "train_dataset")
    for what, data in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if data is not None and not isinstance(data, dict) and not is_streamed(data):  # here, not at a step
            (check_image_prompts if trainer.vision else check_prompts)(data, processing_class, what)
    if args.total_episodes:  # before transformers asks a stream for max_steps; steps_per_generation
        per_generation = args.per_process_generation * args.world_size  # need not divide into accumulation
        args.max_steps = math.ceil(math.ceil(args.total_episodes / per_generation) * args.steps_per_generation
                                   * args.num_iterations / args.gradient_accumulation_steps)
    return train_dataset, eval_dataset


def reward_scorer(args: OnlineConfig, reward_funcs, reward_processing_classes, processing_class,
                  accelerator) -> RewardScorer:
    """The reward functions and models behind one scorer; with ZeRO-3 / FSDP2 the reward models are sharded like
    the policy."""
    scorer = RewardScorer(reward_funcs, args.reward_weights, reward_processing_classes,
                          tokenizer=text_tokenizer(processing_class), device=accelerator.device,
                          timeout=args.reward_timeout)
    if loading.shards_weights(accelerator):
        scorer.funcs = [loading.prepare_frozen(accelerator, f) if isinstance(f, torch.nn.Module) else f
                        for f in scorer.funcs]
    return scorer


def vllm_engine(args: OnlineConfig, model, policy, accelerator, processing_class):
    """With use_vllm, the vLLM engine the sampler calls (`rollout/vllm_engine.py`); None without."""
    if not args.use_vllm:
        return None
    from posttrain.rollout.vllm_engine import make_engine

    name = model if isinstance(model, str) else getattr(policy.config, "_name_or_path", None)
    extra = {k: v for k, v in (args.generation_kwargs or {}).items() if k not in GENERATION_KWARGS}
    return make_engine(args, name, accelerator, processing_class.pad_token_id, processing_class.eos_token_id, extra,
                       policy=policy)


def replays(args: OnlineConfig, policy, old_is_current: bool, critic: bool) -> bool:
    """Whether the training forward takes the sampler's linear outputs (accel/replay.py): only when the policy
    cannot have moved since sampling, in float32 without dropout, compile or checkpointing, and not with dynamic
    sampling (its batch joins rows of several rollouts; the record indexes one)."""
    return (args.replay_linear_outputs and old_is_current and not critic
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


class OnlineSetup:
    """The setup methods of `OnlineTrainer`: the reference model, the background sampler, the dataset's columns."""

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
