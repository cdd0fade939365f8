"""GSPO-token (Zheng et al. 2025, "Group Sequence Policy Optimization"), under TRL's class name.

GSPO's sequence-level importance ratio s_i = exp(mean_t log π/π_old) in its token form: every token of
sequence i carries the value s_i and the gradient of its own log π, which allows per-token advantages
(core.policy_losses, importance_sampling_level "sequence_token", the same as posttrain's "sequence").

A preset of the online engine: GRPO's fields and defaults with importance_sampling_level="sequence_token".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


@dataclass
class GSPOTokenConfig(GRPOConfig):
    """GSPO-token's configuration: GRPO's fields with the sequence ratio at every token."""

    importance_sampling_level: str = field(default="sequence_token", metadata={"help": "'sequence_token' "
                                           "(GSPO-token, the same as 'sequence'), or 'token' (GRPO)."})


class GSPOTokenTrainer(GRPOTrainer):
    """GSPO-token on the online engine; same signature as GRPOTrainer."""

    config_class = GSPOTokenConfig
    _tag = "GSPO-token"
    _name = "GSPO-token"
    _citation = """@article{zheng2025group,
    title   = {{Group Sequence Policy Optimization}},
    author  = {Chujie Zheng and Shixuan Liu and Mingze Li and Xiong-Hui Chen and Bowen Yu and Chang Gao and
               Kai Dang and Yuqiong Liu and Rui Men and An Yang and Jingren Zhou and Junyang Lin},
    journal = {arXiv preprint},
    year    = 2025,
    eprint  = {arXiv:2507.18071}
}"""
