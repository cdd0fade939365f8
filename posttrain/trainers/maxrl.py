"""MaxRL (Tajwar et al. 2026, "Maximum Likelihood Reinforcement Learning"), under TRL's class name.

Reinforcement learning with a 0/1 reward maximises E_x[p(x)], a prompt's pass rate p; maximum likelihood would
maximise E_x[log p(x)], whose gradient weighs each prompt by 1/p. MaxRL gets that weighting by dividing each
group's centred rewards by the group's mean reward instead of its std ("p-normalisation",
`core.advantages.p_norm`): A_i = (r_i - mean) / (|mean| + 1e-6).

A preset of the online engine: GRPO's fields and defaults (TRL's MaxRLConfig adds no field) with
advantage_estimator="p_norm".

Departures: TRL warns at config time that `scale_rewards` is ignored unless it is "none" (so with GRPO's
default "group" it always warns); here `scale_rewards` is simply not read by the estimator and nothing is
printed. TRL logs `frac_reward_zero_mean` (the share of groups whose mean reward is 0); posttrain's
`frac_reward_zero_std` (every such group with 0/1 rewards has zero std too) is logged as for every preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.online_config import estimator_help


@dataclass
class MaxRLConfig(GRPOConfig):
    """MaxRL's configuration: GRPO's fields with the p-normalised advantage."""

    advantage_estimator: str = field(default="p_norm", metadata={"help": estimator_help(
        "MaxRL: 'p_norm', reward minus the group mean divided by the group mean.")})


class MaxRLTrainer(GRPOTrainer):
    """MaxRL on the online engine; same signature as GRPOTrainer."""

    config_class = MaxRLConfig
    _tag = "maxrl"
    _name = "MaxRL"
    _citation = """@misc{tajwar2026maximumlikelihoodreinforcementlearning,
    title  = {{Maximum Likelihood Reinforcement Learning}},
    author = {Fahim Tajwar and Guanning Zeng and Yueer Zhou and Yuda Song and Daman Arora and Yiding Jiang and
              Jeff Schneider and Ruslan Salakhutdinov and Haiwen Feng and Andrea Zanette},
    year   = 2026,
    eprint = {arXiv:2602.02710}
}"""
