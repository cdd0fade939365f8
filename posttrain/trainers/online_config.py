"""The online engine's configuration: `OnlineConfig`, every field the loop in
`posttrain.trainers.online` reads, with GRPO's defaults; the presets (GRPOConfig, RLOOConfig,
PPOConfig, ReinforcePPConfig) subclass it and change defaults.

Batch semantics: `per_device_train_batch_size` counts completions per micro-batch; each process
generates `per_device_train_batch_size * steps_per_generation` completions at a time, whole
groups of `num_generations`, and trains on them for `steps_per_generation * num_iterations`
micro-batches (`gradient_accumulation_steps` per optimizer step).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from posttrain.core.advantages import ADVANTAGES
from posttrain.core.importance import IMPORTANCE_CORRECTIONS
from posttrain.core.kl import KL_ESTIMATORS
from posttrain.core.masked import AGGREGATIONS
from posttrain.core.policy_losses import POLICY_LOSSES
from posttrain.core.shaping import SHAPING_STEPS
from posttrain.trainers.base import BaseConfig

# TRL's GRPO-family loss_type names -> (aggregation mode, whether the denominator is global); see loss_types()
TRL_LOSS_TYPES = {"grpo": ("seq_mean_token_mean", True), "bnpo": ("token_mean", False),
                  "dr_grpo": ("seq_mean_token_sum_norm", True), "dapo": ("token_mean", True)}
# generation_kwargs keys the sampler honours, each the config field it overrides
GENERATION_KWARGS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens", "do_sample",
                     "stop_strings", "stop_token_ids"}


def loss_types() -> dict[str, tuple[str, bool]]:
    """Every loss_type name -> (aggregation mode, whether its denominator spans the optimizer step): TRL's names,
    each core.masked aggregation mode, and each policy loss registered with an aggregation (that loss_type sets
    policy_loss too). Read from the registries when asked, so a later registration counts."""
    return {**TRL_LOSS_TYPES, **{mode: (mode, True) for mode in AGGREGATIONS},
            **{name: (loss.aggregation, True) for name, loss in POLICY_LOSSES.items() if loss.aggregation}}


def config_options(config, what: str, entry) -> dict:
    """The config fields named by the keyword options of `entry`, the registry entry (ADVANTAGES / POLICY_LOSSES)
    of the config's `what` ("advantage_estimator" / "policy_loss"). An option with no field of its name is an
    error, not silently left at its default."""
    missing = [option for option in entry.options if not hasattr(config, option)]
    if missing:
        raise ValueError(f"{what}={getattr(config, what)!r} ({entry.fn.__module__}.{entry.fn.__qualname__}) takes "
                         f"option(s) {missing}, which {type(config).__name__} has no field for; add a field of that "
                         "name (with its help text) to OnlineConfig, or drop the option from the function")
    return {option: getattr(config, option) for option in entry.options}


def estimator_help(note: str = "") -> str:
    """The advantage_estimator help text: the registered names (core.advantages), then a preset's note."""
    return f"A core.advantages estimator: {', '.join(ADVANTAGES)}." + (f" {note}" if note else "")


@dataclass
class OnlineConfig(BaseConfig):
    """Configuration of the online engine; GRPO's defaults. Every TrainingArguments field applies too."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})
    # ---- rollout
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (the group); must divide "
                                 "per_device_train_batch_size * steps_per_generation."})
    max_prompt_length: int | None = field(default=512, metadata={"help": "Keep the last this many prompt tokens "
                                          "(>= 1; None: no limit)."})
    max_completion_length: int = field(default=256, metadata={"help": "Most tokens generated per completion."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (training log-probs use it too)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass (1.0: off)."})
    top_k: int | None = field(default=0, metadata={"help": "Sample among the k most likely tokens (0/None: off)."})
    min_p: float | None = field(default=0.0, metadata={"help": "Drop tokens below min_p * p_max (0/None: off)."})
    stop_strings: list[str] | None = field(default=None, metadata={"help": "Texts that end a completion besides EOS."})
    stop_token_ids: list[int] | None = field(default=None, metadata={"help": "Tokens that end a completion besides EOS."})
    steps_per_generation: int | None = field(default=None, metadata={"help": "Micro-batches per generation batch "
                                             "and pass (None: gradient_accumulation_steps)."})
    generation_batch_size: int | None = field(default=None, metadata={"help": "Completions per generation over all "
                                              "processes; sets steps_per_generation."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Divide the positive logits (multiply the "
                                      "negative ones) of tokens already in the prompt or completion by this "
                                      "(> 0; 1.0: off), as transformers does. Sampling only: log-probs are the "
                                      "policy's own."})
    generation_kwargs: dict | None = field(default=None, metadata={"help": "Sampler settings that override the "
                                           "fields of the same name: temperature, top_p, top_k, min_p, "
                                           "repetition_penalty, max_new_tokens, do_sample, stop_strings, "
                                           "stop_token_ids; other keys are refused, except with use_vllm, "
                                           "where they go to vLLM's SamplingParams."})
    chat_template_kwargs: dict | None = field(default=None, metadata={"help": "Extra variables for the chat "
                                              "template when rendering conversational prompts (e.g. "
                                              "{'enable_thinking': False})."})
    use_vllm: bool = field(default=False, metadata={"help": "Generate with vLLM (rollout/vllm_engine.py, "
                           "docs/sampler.md) instead of posttrain's sampler: in this process ('colocate') or on a "
                           "`trl vllm-serve` server ('server'), with the policy's weights synced before each "
                           "generation that follows an optimizer step. Needs vLLM and a CUDA GPU (refused "
                           "otherwise). With tools= / environment_factory=, each turn is one vLLM request (its "
                           "prefix cache spares the re-sent context); a rollout_func generates through "
                           "trainer.sample_completions."})
    vllm_mode: str = field(default="colocate", metadata={"help": "'colocate' (vLLM in each training process, "
                           "sharing its GPU) or 'server' (a `trl vllm-serve` server)."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "Server mode: the server's URL "
                                             "(None: http://vllm_server_host:vllm_server_port)."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "Server mode: the server's host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Server mode: the server's HTTP port."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "Server mode: seconds to wait for the "
                                       "server to answer its health check."})
    vllm_group_port: int = field(default=51216, metadata={"help": "Server mode: the port of the NCCL group "
                                 "that carries the weights to the server."})
    vllm_request_timeout: float | None = field(default=1800.0, metadata={"help": "Server mode: the deadline, in "
                                               "seconds, of every request to the server (generation included), "
                                               "of joining the weight-transfer group and of each weight "
                                               "transfer; past it a TimeoutError names what hung (None: wait "
                                               "forever). Collectives between training processes have "
                                               "ddp_timeout."})
    vllm_sync_strategy: str = field(default="weights", metadata={"help": "How the policy reaches vLLM: "
                                    "'weights' (every tensor, a PEFT adapter merged in) or 'lora_adapter' (a "
                                    "LoRA policy's adapter alone, saved under output_dir/vllm_adapter and "
                                    "loaded by vLLM as a LoRA adapter: no merge, no NCCL; in server mode the "
                                    "server must see that path and run with --enable-lora and "
                                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "Colocate mode: the share of GPU "
                                               "memory vLLM takes (weights and KV cache)."})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "Colocate mode: processes per vLLM "
                                           "engine (tensor parallelism); must divide the number of processes."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "Colocate mode: vLLM's context "
                                              "length (None: max_prompt_length + max_completion_length, or the "
                                              "model's)."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "Colocate mode: vLLM's model implementation, "
                                 "'vllm' or 'transformers'."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "Colocate mode: vLLM sleeps (weights "
                                         "to CPU, KV cache freed) outside generation and weight sync."})
    vllm_importance_sampling_correction: bool = field(default=True, metadata={"help": "With use_vllm: weight "
                                                      "each token's policy loss by an importance weight of "
                                                      "pi_old / pi_vllm (pi_old from the policy's forward, pi_vllm "
                                                      "vLLM's sampling log-prob), as vllm_importance_sampling_mode "
                                                      "says (core/importance.py)."})
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata={"help": "How the weight is "
                                               "formed and bounded: " + ", ".join(IMPORTANCE_CORRECTIONS) + " "
                                               "(token: a weight per token; sequence: the product over the "
                                               "completion; truncate: clipped into [clip_min, clip_max]; mask: 0 "
                                               "outside it)."})
    vllm_importance_sampling_clip_max: float = field(default=3.0, metadata={"help": "The upper bound C of the "
                                                     "importance weight (> 0)."})
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={"help": "The lower bound of "
                                                            "the importance weight (>= 0, < clip_max; None: "
                                                            "none)."})
    vllm_importance_sampling_cap: float | None = field(default=None, metadata={"help": "TRL's older name of "
                                                       "vllm_importance_sampling_clip_max (copied into it; None: "
                                                       "unset)."})
    num_generations_eval: int | None = field(default=None, metadata={"help": "Completions per prompt in evaluate() "
                                             "(None: 1)."})
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad each training micro-batch's "
                                           "completions to a multiple of this many tokens (None: the longest)."})
    shuffle_dataset: bool = field(default=True, metadata={"help": "Visit the prompts in a new random order each epoch."})
    max_tool_calling_iterations: int | None = field(default=None, metadata={"help": "With tools= or "
                                                  "environment_factory=: tool-calling turns per rollout, after "
                                                  "which the next turn ends it (None: until max_completion_length, "
                                                  "which counts the fed tool results too)."})
    tool_call_timeout: float = field(default=10.0, metadata={"help": "Seconds a tool call may run; past it the "
                                     "tool message is an error text. A sync tool still running is left in its "
                                     "daemon thread (Python cannot stop a thread) until it returns or the process "
                                     "ends; an async tool is cancelled."})
    max_tool_call_chars: int | None = field(default=16384, metadata={"help": "A <tool_call> block longer than this "
                                            "many characters is not parsed or run: its tool message is an error text "
                                            "(a collapsing policy's degenerate repetitions stay cheap). None: no limit."})
    max_tool_result_chars: int | None = field(default=16384, metadata={"help": "A tool result (or error) longer than "
                                              "this many characters is cut, with a note of how much was cut, before "
                                              "it is fed back (`tools/truncation_rate` counts them). None: no limit."})
    max_tool_images: int | None = field(default=8, metadata={"help": "A vision-language model's rollouts: the most "
                                        "images its tools may return in one episode (they are fed to the model and "
                                        "kept for the training forward); a result past it is fed back as an error "
                                        "text instead. None: no limit."})
    # ---- reward
    reward_timeout: float | None = field(default=600.0, metadata={"help": "Seconds a reward function may take for "
                                         "one batch; past it training stops with an error naming the function "
                                         "(a sync function still running is left in its daemon thread). None: no "
                                         "limit."})
    reward_weights: list[float] | None = field(default=None, metadata={"help": "Weight per reward function (1.0)."})
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata={"help": "With several "
                                             "rewards: 'sum_then_normalize' (weighted sum, then the advantage "
                                             "estimator normalises it) or 'normalize_then_sum' (GDPO: each "
                                             "reward z-scored within its group first, then the weighted sum)."})
    reward_model_path: str | None = field(default=None, metadata={"help": "Reward model (name or path) used when "
                                          "the trainer is given no reward."})
    missing_eos_penalty: float | None = field(default=None, metadata={"help": "Subtracted from the score of a "
                                              "completion without EOS / stop."})
    normalize_reward: bool = field(default=False, metadata={"help": "Z-score the scores over the global batch."})
    reward_clip_range: float | None = field(default=None, metadata={"help": "Clip scores to [-c, c] (after "
                                            "normalize_reward)."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Scale rewards (per token, or per sequence for "
                                 "group estimators) to unit variance, keeping the mean."})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Leave completions without a stop "
                                             "out of the loss."})
    overlong_buffer_len: int | None = SHAPING_STEPS.field("overlong_buffer_len")
    overlong_penalty_factor: float = SHAPING_STEPS.field("overlong_penalty_factor")
    filter_groups_enable: bool = field(default=False, metadata={"help": "Dynamic sampling (DAPO; verl's "
                                       "filter_groups.enable): drop the prompt groups whose rewards are all equal "
                                       "and sample more prompts until the generation batch is full of groups whose "
                                       "rewards differ. Needs num_generations >= 2."})
    max_num_gen_batches: int = field(default=10, metadata={"help": "With filter_groups_enable: the most generation "
                                     "batches drawn to fill one (the first included); past it training stops with "
                                     "an error. <= 0: no limit (verl's default)."})
    # ---- reference and KL
    beta: float = field(default=0.0, metadata={"help": "KL coefficient; 0: no reference model at all."})
    kl_estimator: str = field(default="k3", metadata={"help": "'k1', 'k2', 'k3' or 'abs' (core.kl)."})
    kl_in_reward: bool = field(default=False, metadata={"help": "-beta * KL in the reward (PPO/RLOO) instead of "
                               "beta * KL in the loss (GRPO)."})
    token_level_kl: bool = field(default=False, metadata={"help": "With kl_in_reward and a per-token estimator: a "
                                 "penalty at every token; else the summed KL joins the sequence score."})
    sync_ref_model: bool = field(default=False, metadata={"help": "ref <- alpha * policy + (1 - alpha) * ref every "
                                 "ref_model_sync_steps (TR-DPO); needs beta > 0."})
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "alpha of sync_ref_model, in [0, 1]."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "Steps between reference syncs."})
    # ---- advantages
    advantage_estimator: str = field(default="group_norm", metadata={"help": estimator_help()})
    scale_rewards: str = field(default="group", metadata={"help": "group_norm divides by the 'group' (True) or "
                               "'batch' std, or by nothing: 'none' (False)."})
    normalize_advantage: bool = ADVANTAGES.field("normalize_advantage")
    normalize_advantages: bool | None = field(default=None, metadata={"help": "TRL's RLOO spelling of "
                                              "normalize_advantage (copied into it; None: unset)."})
    gamma: float = ADVANTAGES.field("gamma")
    lam: float = ADVANTAGES.field("lam")
    whiten_advantages: bool = ADVANTAGES.field("whiten_advantages")
    # ---- policy update
    policy_loss: str = field(default="clipped", metadata={"help": "A core.policy_losses loss: "
                             f"{', '.join(POLICY_LOSSES)}."})
    loss_type: str = field(default="dapo", metadata={"help": "'grpo' (per-sequence token means), 'bnpo' (token "
                           "mean per micro-batch), 'dr_grpo' (token sum / max_completion_length), 'dapo' (token "
                           "mean over the step), a core.masked aggregation (" + ", ".join(AGGREGATIONS) + "), or a "
                           "policy loss with its paper's aggregation, which sets policy_loss too (" + ", ".join(
                               f"{name}: {loss.aggregation}" for name, loss in POLICY_LOSSES.items()
                               if loss.aggregation) + ")."})
    num_iterations: int = field(default=1, metadata={"help": "Passes over each generation batch (PPO epochs)."})
    epsilon: float = POLICY_LOSSES.field("epsilon")
    epsilon_high: float | None = POLICY_LOSSES.field("epsilon_high")
    importance_sampling_level: str = field(default="token", metadata={"help": "'token', or 'sequence' (GSPO, "
                                           "in its GSPO-token form; 'sequence_token', TRL's GSPO-token name, is the "
                                           "same)."})
    delta: float | None = field(default=None, metadata={"help": "INTELLECT-2's two-sided clip: the clipped loss's "
                                "ratio is also capped at delta (> 1 + epsilon) where the advantage is negative "
                                "(None: off)."})
    sapo_temperature_pos: float = POLICY_LOSSES.field("sapo_temperature_pos")
    sapo_temperature_neg: float = POLICY_LOSSES.field("sapo_temperature_neg")
    vespo_k_pos: float = POLICY_LOSSES.field("vespo_k_pos")
    vespo_lambda_pos: float = POLICY_LOSSES.field("vespo_lambda_pos")
    vespo_k_neg: float = POLICY_LOSSES.field("vespo_k_neg")
    vespo_lambda_neg: float = POLICY_LOSSES.field("vespo_lambda_neg")
    entropy_coef: float = field(default=0.0, metadata={"help": "Weight of an entropy bonus: loss -= entropy_coef * "
                                "the aggregated token entropy (0: off)."})
    top_entropy_quantile: float = field(default=1.0, metadata={"help": "Train only on the top this share of "
                                        "tokens by entropy, in (0, 1] (Wang et al. 2025; 1.0: every token)."})
    use_bias_correction_kl: bool = field(default=False, metadata={"help": "Weight the per-token KL term by the "
                                         "importance ratio pi/pi_old, so the KL is estimated for the current "
                                         "policy from older samples."})
    off_policy_mask_threshold: float | None = field(default=None, metadata={"help": "Leave out of the loss the "
                                                    "sequences with a negative advantage whose mean log pi_old/pi "
                                                    "exceeds this (DeepSeek-V3.2's off-policy masking; None: off)."})
    cast_lm_head_to_fp32: bool = field(default=False, metadata={"help": "Keep the output layer in float32 (its "
                                       "log-probs more exact under bf16/fp16)."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss (gae)."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value update (gae)."})
    # ---- misc
    disable_dropout: bool = field(default=True, metadata={"help": "No dropout in the policy, so the sampler's "
                                  "log-probs equal the training forward's."})
    replay_linear_outputs: bool = field(default=True, metadata={"help": "When the policy cannot have moved since "
                                        "sampling (num_iterations=1, one optimizer step per generation batch), the "
                                        "training forward takes every decoder layer's linear outputs from the sampler "
                                        "instead of recomputing them (accel/replay.py); the backward is unchanged. "
                                        "Used where the lean CPU decoding step runs (Llama/Qwen2-style float32 "
                                        "models), without dropout, mixed precision, torch_compile or gradient "
                                        "checkpointing."})
    max_staleness: int = field(default=0, metadata={"help": "Asynchronous rollouts: how many optimizer steps old "
                               "the policy that sampled a batch may be when the batch starts training. 0: the "
                               "synchronous engine (sample, then train). With k > 0 the next generation batches "
                               "(k / optimizer steps per generation batch of them) are sampled and scored in a "
                               "background thread by a copy of the policy whose weights are published after each "
                               "step, while the current batch trains; the ratio's old log-probs are the sampling "
                               "policy's (trainers/online_async.py). With use_vllm the worker generates through "
                               "vLLM, synced with each published snapshot. DDP: each process samples its own "
                               "prompts. Not with sharded weights (FSDP, ZeRO-3), a streamed dataset, dynamic "
                               "sampling, or a rollout_func without vLLM."})
    local_rollout_forward_batch_size: int = field(default=64, metadata={"help": "Rows per no-grad forward "
                                                  "(reference log-probs, old values)."})
    total_episodes: int | None = field(default=None, metadata={"help": "Completions to train on (>= 1; sets "
                                       "max_steps). None: max_steps / num_train_epochs decide."})
    log_completions: bool = field(default=False, metadata={"help": "A completions table at every logging step."})
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "Table rows printed (None: all; 0: none, the rows go to completions.jsonl "
                                        "only)."})
    num_sample_generations: int = field(default=0, metadata={"help": "Completion tables (and completions.jsonl "
                                        "rows) at this many evenly spaced steps."})

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        self.top_k, self.min_p = self.top_k or 0, self.min_p or 0.0
        if self.normalize_advantages is not None:
            self.normalize_advantage = self.normalize_advantages
        if isinstance(self.generation_kwargs, str):  # from the command line, as JSON
            import json

            self.generation_kwargs = json.loads(self.generation_kwargs)
        if isinstance(self.chat_template_kwargs, str):
            import json

            self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
        super().__post_init__()

    def loss_type_choices(self) -> dict:
        """The loss_type names this config accepts (a preset whose loss_type means something else overrides it)."""
        return loss_types()

    def loss_aggregation(self) -> tuple[str, bool]:
        """(core.masked aggregation mode, whether its denominator spans the optimizer step) of this config."""
        return loss_types()[self.loss_type]

    @property
    def per_process_generation(self) -> int:
        """Completions each process generates at a time."""
        return self.per_device_train_batch_size * self.steps_per_generation

    def _check(self):
        self._check_batches()
        if self.loss_type in POLICY_LOSSES and POLICY_LOSSES[self.loss_type].aggregation:
            wanted = self.loss_type
            default = type(self).__dataclass_fields__["policy_loss"].default
            if self.policy_loss not in (default, wanted):
                raise ValueError(f"loss_type={self.loss_type!r} uses policy_loss={wanted!r}; policy_loss="
                                 f"{self.policy_loss!r} was also set: unset one of them")
            self.policy_loss = wanted
        self._check_generation()
        self._check_algorithm()
        self._check_staleness()

    def _check_batches(self):
        """Generation and micro-batch sizes fit together (steps_per_generation derived where unset)."""
        bs, ga, k = self.per_device_train_batch_size, self.gradient_accumulation_steps, self.num_generations
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ValueError(f"max_tool_calling_iterations must be >= 0 or None, got {self.max_tool_calling_iterations}")
        if not self.tool_call_timeout > 0:
            raise ValueError(f"tool_call_timeout must be > 0 seconds, got {self.tool_call_timeout}")
        if self.reward_timeout is not None and not self.reward_timeout > 0:
            raise ValueError(f"reward_timeout must be > 0 seconds (or None: no limit), got {self.reward_timeout}")
        for name in ("max_tool_call_chars", "max_tool_result_chars"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 characters (or None: no limit), got {getattr(self, name)}")
        if self.max_tool_images is not None and self.max_tool_images < 0:
            raise ValueError(f"max_tool_images must be >= 0 (or None: no limit), got {self.max_tool_images}")
        if self.generation_batch_size is not None:
            per_step = bs * self.world_size
            if self.generation_batch_size % per_step:
                raise ValueError(f"generation_batch_size={self.generation_batch_size} must be a multiple of "
                                 f"per_device_train_batch_size * processes = {per_step}")
            spg = self.generation_batch_size // per_step
            if self.steps_per_generation not in (None, spg):
                raise ValueError("set generation_batch_size or steps_per_generation, not both")
            if self.steps_per_generation is None:
                self.derive("steps_per_generation", spg)
        if not self.steps_per_generation:
            self.derive("steps_per_generation", ga)
        if k < 1:
            raise ValueError(f"num_generations must be >= 1, got {k}")
        if self.per_process_generation % k:
            raise ValueError(
                f"each process generates whole groups: per_device_train_batch_size * steps_per_generation = {bs} * "
                f"{self.steps_per_generation} = {self.per_process_generation} completions must be a multiple of "
                f"num_generations={k}; set num_generations to a divisor of {self.per_process_generation}, or change "
                f"per_device_train_batch_size / gradient_accumulation_steps / steps_per_generation")

    def _check_generation(self):
        """The sampler's settings: generation_kwargs, vLLM, repetition penalty, evaluation and padding sizes."""
        unknown = sorted(set(self.generation_kwargs or {}) - GENERATION_KWARGS)
        if unknown and not self.use_vllm:  # vLLM takes any SamplingParams keyword
            raise ValueError(f"generation_kwargs {unknown} cannot be honoured by posttrain's sampler; it takes "
                             f"{sorted(GENERATION_KWARGS)} (with use_vllm=True, any vLLM SamplingParams keyword)")
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if not high > 0:
            raise ValueError(f"vllm_importance_sampling_clip_max must be > 0, got {high}")
        if low is not None and not 0 <= low < high:
            raise ValueError(f"vllm_importance_sampling_clip_min must be >= 0 and below vllm_importance_sampling_"
                             f"clip_max={high} (or None: no lower bound), got {low}")
        IMPORTANCE_CORRECTIONS.choose(self.vllm_importance_sampling_mode, "vllm_importance_sampling_mode")
        if self.vllm_request_timeout is not None and not self.vllm_request_timeout > 0:
            raise ValueError(f"vllm_request_timeout must be > 0 seconds (or None: no deadline), got "
                             f"{self.vllm_request_timeout}")
        if self.vllm_sync_strategy not in ("weights", "lora_adapter"):
            raise ValueError(f"vllm_sync_strategy={self.vllm_sync_strategy!r} is unknown; choose 'weights' or "
                             "'lora_adapter'")
        from posttrain.rollout.vllm_engine import check_vllm

        check_vllm(self.vllm_mode, self.use_vllm)  # a known vllm_mode; with use_vllm, vLLM installed and a GPU
        if self.multi_objective_aggregation not in ("sum_then_normalize", "normalize_then_sum"):
            raise ValueError(f"multi_objective_aggregation={self.multi_objective_aggregation!r} is unknown; choose "
                             "'sum_then_normalize' or 'normalize_then_sum'")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0: off), got {self.repetition_penalty}")
        for name in ("num_generations_eval", "pad_to_multiple_of"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {getattr(self, name)}")

    def _check_staleness(self):
        """max_staleness: a whole number of generation batches ahead (what the background sampler cannot do is
        refused when the trainer is built: `online_async.check_background_sampling`)."""
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 optimizer steps (0: synchronous), got {self.max_staleness}")
        if not self.max_staleness:
            return
        steps = max(self.steps_per_generation * self.num_iterations // self.gradient_accumulation_steps, 1)
        if self.max_staleness < steps:
            raise ValueError(f"max_staleness={self.max_staleness}: a generation batch sampled one batch ahead is "
                             f"{steps} optimizer steps old when it starts training (steps_per_generation * "
                             "num_iterations / gradient_accumulation_steps); set max_staleness >= "
                             f"{steps}, or 0 for the synchronous engine")

    def _check_algorithm(self):
        """The registered estimator, loss, aggregation and KL estimator and their options; reference and update."""
        k = self.num_generations
        if not 0 < self.top_entropy_quantile <= 1:
            raise ValueError(f"top_entropy_quantile must be in (0, 1], got {self.top_entropy_quantile}")
        if self.delta is not None and not self.delta > 1 + self.epsilon:
            raise ValueError(f"delta={self.delta} must be > 1 + epsilon = {1 + self.epsilon} (it caps the ratio "
                             "above the clip range)")
        ADVANTAGES.choose(self.advantage_estimator, "advantage_estimator")
        POLICY_LOSSES.choose(self.policy_loss, "policy_loss")
        for name, value, known in [("loss_type", self.loss_type, self.loss_type_choices()),
                                   ("kl_estimator", self.kl_estimator, KL_ESTIMATORS),
                                   ("scale_rewards", self.scale_rewards, ("group", "batch", "none")),
                                   ("importance_sampling_level", self.importance_sampling_level,
                                    ("token", "sequence", "sequence_token"))]:
            if value not in known:
                raise ValueError(f"{name}={value!r} is unknown; choose one of {sorted(known)}")
        estimator = ADVANTAGES[self.advantage_estimator]
        if k < estimator.min_group:  # else every advantage, and gradient, is 0
            raise ValueError(f"advantage_estimator={self.advantage_estimator!r} compares the completions of a "
                             f"prompt with each other: set num_generations >= {estimator.min_group}")
        # options without a field would keep their defaults whatever the config says: refused here, before training
        config_options(self, "advantage_estimator", estimator)
        config_options(self, "policy_loss", POLICY_LOSSES[self.policy_loss])
        ADVANTAGES.check_options(self)  # each option's bound (core.registry.Option)
        POLICY_LOSSES.check_options(self)
        self._check_dynamic_sampling()
        # 0 would read as "no limit" and a negative length would cut the prompt's start instead
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 (prompt tokens kept), got {self.max_prompt_length}; "
                             "set it to None for no limit")
        if self.total_episodes is not None and self.total_episodes < 1:
            raise ValueError(f"total_episodes must be >= 1 completions, got {self.total_episodes}; set it to None "
                             "to train for max_steps / num_train_epochs instead")
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            raise ValueError(f"ref_model_mixup_alpha must be in [0, 1] (the policy's share in each reference sync), "
                             f"got {self.ref_model_mixup_alpha}")
        if self.ref_model_sync_steps < 1:
            raise ValueError(f"ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.sync_ref_model and self.beta == 0:
            raise ValueError("sync_ref_model needs a reference model, which exists only when beta > 0")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.num_iterations < 1 or self.max_completion_length < 1:
            raise ValueError("num_iterations and max_completion_length must be >= 1")


    def _check_dynamic_sampling(self):
        """The registered reward-shaping steps' options, and dynamic sampling's settings."""
        SHAPING_STEPS.check_options(self)
        shaping_steps(self)  # an option without a field is refused here, before training
        if self.overlong_buffer_len is not None and self.overlong_buffer_len > self.max_completion_length:
            raise ValueError(f"overlong_buffer_len={self.overlong_buffer_len} must be <= max_completion_length="
                             f"{self.max_completion_length}: the buffer is the last tokens before the limit")
        if self.filter_groups_enable and self.max_staleness:  # its extra batches would race the background sampler
            raise ValueError("filter_groups_enable samples its extra generation batches in the training thread, "
                             "which asynchronous rollouts (max_staleness > 0) do not support yet: set one of them off")
        if self.filter_groups_enable and self.num_generations < 2:
            raise ValueError("filter_groups_enable drops the groups whose rewards are all equal, which every group "
                             f"of num_generations={self.num_generations} sample is: set num_generations >= 2")


def shaping_steps(config) -> tuple[tuple[str, dict], ...]:
    """(name, options) of each registered reward-shaping step (core.shaping.SHAPING_STEPS) the config turns on,
    i.e. whose `switch` field is not None, for `RewardShaping.steps`."""
    return tuple((name, config_options(config, step.switch, step)) for name, step in SHAPING_STEPS.items()
                 if getattr(config, step.switch, None) is not None)


# ---------------------------------------------------------------- the classic RLOO / PPO field names

def resolve_aliases(config, pairs: list[tuple[str, str]]):
    """Make each (classic name, GRPO name) pair agree: the one set away from its default wins; both set
    to different values is an error."""
    defaults = {f.name: f.default for f in fields(config)}
    for classic, other in pairs:
        a, b = getattr(config, classic), getattr(config, other)
        a_set, b_set = a != defaults[classic], b != defaults[other]
        if a_set and b_set and a != b:
            raise ValueError(f"{classic}={a!r} and {other}={b!r} name the same setting; set only one of them")
        value = a if a_set else b if b_set else defaults[classic]
        setattr(config, classic, value)
        setattr(config, other, value)


def apply_classic_stop(config):
    """stop_token ("eos" or None) / stop_token_id -> stop_token_ids; shared by the classic RLOO and PPO configs."""
    if config.stop_token not in (None, "eos"):
        raise ValueError(f"stop_token={config.stop_token!r}: only 'eos' (or None) is supported; use stop_token_id "
                         "for another token")
    if config.stop_token_id is not None:
        config.stop_token_ids = sorted(set(config.stop_token_ids or []) | {int(config.stop_token_id)})


@dataclass
class ClassicOnlineConfig(OnlineConfig):
    """What the classic RLOO and PPO configurations share: their field names and defaults, each with
    its GRPO-style alias (`_aliases`: (classic name, GRPO name) pairs, resolved by `resolve_aliases`)."""

    _aliases = []
    kl_coef: float = field(default=0.05, metadata={"help": "KL penalty coefficient in the reward (alias: beta)."})
    beta: float = field(default=0.05, metadata={"help": "Alias of kl_coef."})
    kl_estimator: str = field(default="k1", metadata={"help": "KL estimator of the penalty in the reward: 'k1', "
                              "'k2', 'k3' or 'abs'."})
    kl_in_reward: bool = field(default=True, metadata={"help": "The KL penalty goes into the reward (the classic "
                               "trainers' way)."})
    response_length: int = field(default=53, metadata={"help": "Most tokens per completion "
                                 "(alias: max_completion_length)."})
    max_completion_length: int = field(default=53, metadata={"help": "Alias of response_length."})
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each batch (alias: num_iterations)."})
    num_iterations: int = field(default=4, metadata={"help": "Alias of num_ppo_epochs."})
    cliprange: float = field(default=0.2, metadata={"help": "Clip range of the ratio (alias: epsilon)."})
    epsilon: float = field(default=0.2, metadata={"help": "Alias of cliprange."})
    num_mini_batches: int = field(default=1, metadata={"help": "Optimizer steps per pass over a batch: each process "
                                  "generates per_device_train_batch_size * gradient_accumulation_steps * "
                                  "num_mini_batches completions at a time."})
    temperature: float = field(default=0.7, metadata={"help": "Sampling temperature."})
    stop_token: str | None = field(default=None, metadata={"help": "'eos': completions end at EOS (always the case)."})
    stop_token_id: int | None = field(default=None, metadata={"help": "Another token id that ends a completion."})
    num_sample_generations: int = field(default=10, metadata={"help": "Completion tables at this many evenly "
                                        "spaced steps."})
    learning_rate: float = field(default=3e-6, metadata={"help": "Initial AdamW learning rate."})
    sft_model_path: str | None = field(default=None, metadata={"help": "Classic name of the policy to start from, "
                                       "read by `posttrain rloo|ppo`: as in the classic TRL scripts, the policy "
                                       "loads from it (winning over --model_name_or_path, which then names only the "
                                       "tokenizer). The trainers themselves take the policy as `model`/`policy`."})
    exp_name: str | None = field(default=None, metadata={"help": "Classic experiment name: the run_name when "
                                 "run_name is not given."})

    def _check(self):
        if self.exp_name and self.run_name is None:
            self.run_name = self.exp_name
        resolve_aliases(self, self._aliases)
        if self.steps_per_generation is None and self.generation_batch_size is None:
            self.derive("steps_per_generation", self.gradient_accumulation_steps * self.num_mini_batches)
        apply_classic_stop(self)
        super()._check()
