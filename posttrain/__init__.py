"""posttrain: post-train transformer language models on one small shared core.

Public names are imported lazily so that `import posttrain` stays fast.
"""

from __future__ import annotations

import importlib
import logging

from posttrain import _moved
from posttrain.accel import threads as _threads

__version__ = "0.1.0"

_threads.configure()  # before torch loads: thread count from the CPU share, no long spin (accel/threads.py)
# bitsandbytes (QLoRA), imported by peft when installed, warns at import on CPUs with AVX512-BF16 that its optional
# hub kernel package `kernels` is missing; its own CPU kernels serve, so the line is noise in every run
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
_moved.install()  # old import paths of moved modules (e.g. posttrain.data.builtin) keep working

_EXPORTS = {
    "SFTConfig": "posttrain.trainers.sft", "SFTTrainer": "posttrain.trainers.sft",
    "RewardConfig": "posttrain.trainers.reward", "RewardTrainer": "posttrain.trainers.reward",
    "DPOConfig": "posttrain.trainers.dpo", "DPOTrainer": "posttrain.trainers.dpo",
    "BCOConfig": "posttrain.trainers.bco", "BCOTrainer": "posttrain.trainers.bco",
    "KTOConfig": "posttrain.trainers.kto", "KTOTrainer": "posttrain.trainers.kto",
    "OnlineConfig": "posttrain.trainers.online", "OnlineTrainer": "posttrain.trainers.online",
    "GRPOConfig": "posttrain.trainers.grpo", "GRPOTrainer": "posttrain.trainers.grpo",
    "RLOOConfig": "posttrain.trainers.rloo", "RLOOTrainer": "posttrain.trainers.rloo",
    "PPOConfig": "posttrain.trainers.ppo", "PPOTrainer": "posttrain.trainers.ppo",
    "ReinforcePPConfig": "posttrain.trainers.reinforce_pp", "ReinforcePPTrainer": "posttrain.trainers.reinforce_pp",
    "OnlineDPOConfig": "posttrain.trainers.online_dpo", "OnlineDPOTrainer": "posttrain.trainers.online_dpo",
    "XPOConfig": "posttrain.trainers.xpo", "XPOTrainer": "posttrain.trainers.xpo",
    "NashMDConfig": "posttrain.trainers.nash_md", "NashMDTrainer": "posttrain.trainers.nash_md",
    "GMPOConfig": "posttrain.trainers.gmpo", "GMPOTrainer": "posttrain.trainers.gmpo",
    "GSPOTokenConfig": "posttrain.trainers.gspo_token", "GSPOTokenTrainer": "posttrain.trainers.gspo_token",
    "GRPOWithReplayBufferConfig": "posttrain.trainers.grpo_replay_buffer",
    "GRPOWithReplayBufferTrainer": "posttrain.trainers.grpo_replay_buffer",
    "A2POConfig": "posttrain.trainers.a2po", "A2POTrainer": "posttrain.trainers.a2po",
    "AsyncGRPOConfig": "posttrain.trainers.async_grpo", "AsyncGRPOTrainer": "posttrain.trainers.async_grpo",
    "PairwiseJudge": "posttrain.judges", "RewardModelJudge": "posttrain.judges",
    "OpenAIPairwiseJudge": "posttrain.judges", "WinRateCallback": "posttrain.callbacks", "win_rate": "posttrain.judges",
    "PlotCallback": "posttrain.callbacks", "generation_accuracy": "posttrain.eval",
    "load_builtin": "posttrain.tasks.builtin", "task_dataset": "posttrain.tasks.builtin", "zen": "posttrain.tasks.builtin",
    "AutoModelForCausalLMWithValueHead": "posttrain.models.value_head",
    "AutoModelForSeq2SeqLMWithValueHead": "posttrain.models.value_head",
    "load_causal_lm": "posttrain.models.loading", "load_tokenizer": "posttrain.models.loading",
    "NonFiniteError": "posttrain.trainers.guards", "CheckpointError": "posttrain.trainers.guards",
    "OutputDirInUseError": "posttrain.trainers.guards", "SaveError": "posttrain.trainers.guards",
    "DistillationConfig": "posttrain.trainers.distillation", "DistillationTrainer": "posttrain.trainers.distillation",
    "GKDConfig": "posttrain.trainers.gkd", "GKDTrainer": "posttrain.trainers.gkd",
    "MiniLLMConfig": "posttrain.trainers.minillm", "MiniLLMTrainer": "posttrain.trainers.minillm",
    "IWOPDConfig": "posttrain.trainers.iw_opd", "IWOPDTrainer": "posttrain.trainers.iw_opd",
    "GOLDConfig": "posttrain.trainers.gold", "GOLDTrainer": "posttrain.trainers.gold",
    "SDFTConfig": "posttrain.trainers.sdft", "SDFTTrainer": "posttrain.trainers.sdft",
    "SDPOConfig": "posttrain.trainers.sdpo", "SDPOTrainer": "posttrain.trainers.sdpo",
    "ServerDistillationConfig": "posttrain.trainers.server_distillation",
    "ServerDistillationTrainer": "posttrain.trainers.server_distillation",
    "AsyncDistillationConfig": "posttrain.trainers.server_distillation",
    "AsyncDistillationTrainer": "posttrain.trainers.server_distillation",
    "TeacherServer": "posttrain.rollout.teacher_server", "TeacherServerError": "posttrain.rollout.teacher_server",
    "TrlParser": "posttrain.scripts", "ScriptArguments": "posttrain.scripts", "ModelConfig": "posttrain.scripts",
    "DatasetConfig": "posttrain.scripts", "DatasetMixtureConfig": "posttrain.scripts", "get_dataset": "posttrain.scripts",
    "get_peft_config": "posttrain.scripts", "get_quantization_config": "posttrain.scripts",
    "get_kbit_device_map": "posttrain.scripts",
    # TRL's helper names (trl.data_utils, trl.chat_template_utils, trl.rewards, callbacks, collators)
    **{name: "posttrain.data.utils" for name in (
        "apply_chat_template", "maybe_apply_chat_template", "extract_prompt", "maybe_extract_prompt",
        "unpair_preference_dataset", "maybe_unpair_preference_dataset", "is_conversational",
        "is_conversational_from_value", "maybe_convert_to_chatml", "pack_dataset", "truncate_dataset")},
    **{name: "posttrain.models.chat_templates" for name in (
        "clone_chat_template", "get_training_chat_template", "add_response_schema", "supports_tool_calling")},
    **{name: "posttrain.tasks.rewards" for name in (
        "accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_cosine_scaled_reward",
        "get_repetition_penalty_reward", "get_soft_overlong_punishment")},
    **{name: "posttrain.callbacks" for name in (
        "LogCompletionsCallback", "SyncRefModelCallback", "RichProgressCallback", "BEMACallback",
        "MergeModelCallback", "WeaveCallback")},
    "create_reference_model": "posttrain.models.reference",
    **{name: "posttrain.data.collators" for name in (
        "DataCollatorForLanguageModeling", "DataCollatorForPreference", "DataCollatorForUnpairedPreference")},
    "ORPOConfig": "posttrain.trainers.orpo", "ORPOTrainer": "posttrain.trainers.orpo",
    "CPOConfig": "posttrain.trainers.cpo", "CPOTrainer": "posttrain.trainers.cpo",
    "TPOConfig": "posttrain.trainers.tpo", "TPOTrainer": "posttrain.trainers.tpo",
    "PRMConfig": "posttrain.trainers.prm", "PRMTrainer": "posttrain.trainers.prm",
    "ProcessRewardFunction": "posttrain.rollout.process_rewards",
    "task_stepwise_dataset": "posttrain.tasks.builtin",
    "GFPOConfig": "posttrain.trainers.gfpo", "GFPOTrainer": "posttrain.trainers.gfpo",
    "GPGConfig": "posttrain.trainers.gpg", "GPGTrainer": "posttrain.trainers.gpg",
    "DPPOConfig": "posttrain.trainers.dppo", "DPPOTrainer": "posttrain.trainers.dppo",
    "MaxRLConfig": "posttrain.trainers.maxrl", "MaxRLTrainer": "posttrain.trainers.maxrl",
    # vision-language models (docs/vision.md); prepare_multimodal_messages is TRL's trl.data_utils name
    "prepare_multimodal_messages": "posttrain.data.multimodal",
    "vision_dataset": "posttrain.tasks.vision", "vision_preference_dataset": "posttrain.tasks.vision",
    "load_vision_lm": "posttrain.models.loading", "load_processor": "posttrain.models.loading",
    "vision_accuracy": "posttrain.eval",
    "ShowImageEnv": "posttrain.tasks.vision", "vision_tool_dataset": "posttrain.tasks.vision",
    "vision_tool_traces": "posttrain.tasks.vision", "vision_tool_reward": "posttrain.tasks.vision",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
