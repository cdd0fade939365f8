"""REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
Language Models").

PPO's tricks without a critic: the reward is the score at the last token minus a per-token KL
penalty to the reference policy (k1, beta); scores are normalised (z-score over the batch) and
clipped; the advantage of token t is the return-to-go sum_{s>=t} gamma^(s-t) r_s, whitened over
every token of the (global) batch; the policy minimises PPO's clipped surrogate.

A preset of the online engine: advantage_estimator="reinforce_pp" ("reinforce_pp_baseline"
subtracts each prompt's group mean score first), KL in the reward per token,
normalize_reward, reward_clip_range. Nothing else is new: a config, not an engine.

Departure: several completions per prompt by default (num_generations=4); the paper's setting
is one, which works too (the whitening is over the batch, not the group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.trainers.online import OnlineConfig, OnlineTrainer
from posttrain.trainers.online_config import estimator_help


@dataclass
class ReinforcePPConfig(OnlineConfig):
    """REINFORCE++'s configuration: the online engine's fields with REINFORCE++ defaults."""

    num_generations: int = field(default=4, metadata={"help": "Completions per prompt (1 is the paper's setting)."})
    advantage_estimator: str = field(default="reinforce_pp", metadata={"help": estimator_help(
                                     "REINFORCE++ is 'reinforce_pp', or 'reinforce_pp_baseline' (group mean "
                                     "score subtracted first).")})
    beta: float = field(default=0.01, metadata={"help": "Per-token KL penalty coefficient in the reward."})
    kl_estimator: str = field(default="k1", metadata={"help": "KL estimator of the penalty."})
    kl_in_reward: bool = field(default=True, metadata={"help": "REINFORCE++ puts the KL penalty in the reward."})
    token_level_kl: bool = field(default=True, metadata={"help": "A KL penalty at every token."})
    normalize_reward: bool = field(default=True, metadata={"help": "Z-score the scores over the batch."})
    reward_clip_range: float | None = field(default=10.0, metadata={"help": "Clip the (normalised) scores to [-c, c]."})
    loss_type: str = field(default="token_mean", metadata={"help": "Loss aggregation (see OnlineConfig)."})


class ReinforcePPTrainer(OnlineTrainer):
    """REINFORCE++ on the online engine; same signature as GRPOTrainer (plus ref_model)."""

    config_class = ReinforcePPConfig
    _tag = "REINFORCE++"
    _name = "REINFORCE++"
    _citation = """@article{hu2025reinforce,
    title   = {{REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models}},
    author  = {Jian Hu},
    journal = {arXiv preprint},
    year    = 2025,
    eprint  = {arXiv:2501.03262}
}"""

    def __init__(self, model, reward_funcs=None, args: ReinforcePPConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, ref_model=None, tools=None, environment_factory=None,
                 rollout_func=None, **kwargs):
        # kwargs: TRL's older conventions (tokenizer=, config fields), see OnlineTrainer
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, reward_processing_classes=reward_processing_classes,
                         callbacks=callbacks, optimizers=optimizers, peft_config=peft_config, ref_model=ref_model,
                         tools=tools, environment_factory=environment_factory, rollout_func=rollout_func, **kwargs)
