"""GMPO: Geometric-Mean Policy Optimization (Zhao et al. 2025, "Geometric-Mean Policy Optimization").

GRPO with the geometric mean of the token importance ratios in place of their arithmetic mean: each
sequence's objective is A exp(mean_t clip(log ρ_t)), clipped in log space (the `gmpo` policy loss of
core.policy_losses). The geometric mean is far less sensitive to one outlier ratio, so the clip range is
wider: `epsilon` (and `epsilon_high`) are log-space bounds, (e^-0.4, e^0.4) by default.

A preset of the online engine: GRPO's fields with policy_loss / loss_type "gmpo" and epsilon 0.4.

Departures: TRL's GMPOConfig keeps GRPO's loss_type, which its loss ignores; here loss_type is "gmpo" (the
sequence mean the loss uses). TRL's clip_ratio/* metrics are posttrain's policy/clipfrac_avg (tokens held at
a bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.core.policy_losses import POLICY_LOSSES
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


@dataclass
class GMPOConfig(GRPOConfig):
    """GMPO's configuration: GRPO's fields, the geometric-mean loss and its log-space clip range."""

    epsilon: float = field(default=0.4, metadata={"help": "Lower clip bound in log space: log ρ_t >= -epsilon "
                           "(GMPO recommends 0.4)."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clip bound in log space: log ρ_t <= "
                                       "epsilon_high (None: epsilon)."})
    policy_loss: str = field(default="gmpo", metadata={"help": "A core.policy_losses loss: "
                             f"{', '.join(POLICY_LOSSES)}."})
    loss_type: str = field(default="gmpo", metadata={"help": "Loss aggregation; 'gmpo': one loss per sequence, "
                           "averaged over sequences (see OnlineConfig)."})


class GMPOTrainer(GRPOTrainer):
    """GMPO on the online engine; same signature as GRPOTrainer."""

    config_class = GMPOConfig
    _tag = "GMPO"
    _name = "GMPO"
    _citation = """@article{zhao2025geometric,
    title   = {{Geometric-Mean Policy Optimization}},
    author  = {Yuzhong Zhao and Yue Liu and Junpeng Liu and Jingye Chen and Xun Wu and Yaru Hao and Tengchao Lv and
               Shaohan Huang and Lei Cui and Qixiang Ye and Fang Wan and Furu Wei},
    journal = {arXiv preprint},
    year    = 2025,
    eprint  = {arXiv:2507.20673}
}"""
