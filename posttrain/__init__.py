"""posttrain: post-train transformer language models on one small shared core.

Public names are imported lazily so that `import posttrain` stays fast.
"""

from __future__ import annotations

import importlib

from posttrain import _moved

__version__ = "0.1.0"

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
    "PairwiseJudge": "posttrain.judges", "RewardModelJudge": "posttrain.judges",
    "OpenAIPairwiseJudge": "posttrain.judges", "WinRateCallback": "posttrain.callbacks", "win_rate": "posttrain.judges",
    "PlotCallback": "posttrain.callbacks", "generation_accuracy": "posttrain.eval",
    "load_builtin": "posttrain.tasks.builtin", "task_dataset": "posttrain.tasks.builtin", "zen": "posttrain.tasks.builtin",
    "AutoModelForCausalLMWithValueHead": "posttrain.models.value_head",
    "AutoModelForSeq2SeqLMWithValueHead": "posttrain.models.value_head",
    "load_causal_lm": "posttrain.models.loading", "load_tokenizer": "posttrain.models.loading",
    "NonFiniteError": "posttrain.trainers.guards", "CheckpointError": "posttrain.trainers.guards",
    "OutputDirInUseError": "posttrain.trainers.guards", "SaveError": "posttrain.trainers.guards",
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
