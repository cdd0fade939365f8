"""GFPO: Group Filtered Policy Optimization (Shrivastava et al. 2025, "Sample More to Think Less: Group
Filtered Policy Optimization for Concise Reasoning").

GRPO that samples more completions per prompt and trains on the best few: a user's `group_filter_func`
scores each group's completions (shortest, highest reward per token, ...), the `num_remains_in_group`
highest-scored of each group are kept, and the advantages are GRPO's computed over the kept ones only
(their mean the baseline, their std the scale); the others are left out of the loss. Filtering on length
teaches concise answers without a length penalty in the reward.

A preset of the online engine: GRPO's fields plus `num_remains_in_group`, the `group_filtered_norm`
advantage estimator (core.advantages) and the engine's `rows_in_loss` hook. Without `num_remains_in_group`
(TRL's default, None) it trains as GRPO.

group_filter_func(group_completions, group_rewards) -> group_scores: lists per group (prompt) of its
num_generations completions (as the reward functions get them), their rewards, and one number per completion;
higher is kept. Evaluation is not filtered, as in TRL.

Departures: the left-out completions stay in the batch with no tokens in the loss (TRL drops them), so the
logged rewards and completions are all of the sampled ones (TRL logs the kept ones); per_device_train_batch_size
counts every sampled completion. A multi-turn rollout's completions, and with DAPO's dynamic sampling
(filter_groups_enable) every completion, reach the filter as text.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.rollout.generate import Rollout
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.online_config import estimator_help

logger = logging.getLogger(__name__)


@dataclass
class GFPOConfig(GRPOConfig):
    """GFPO's configuration: GRPO's fields plus how many completions of each group are kept."""

    num_remains_in_group: int | None = field(default=None, metadata={"help": "Completions of each group kept by "
                                             "group_filter_func and trained on, >= 2 and < num_generations (None: "
                                             "no filter, GRPO)."})
    advantage_estimator: str = field(default="group_filtered_norm", metadata={"help": estimator_help(
                                     "GFPO: 'group_filtered_norm' (GRPO's advantages over the kept completions).")})

    def _check(self):
        n = self.num_remains_in_group
        if n is not None and not 2 <= n < self.num_generations:
            raise ValueError(f"num_remains_in_group={n} must be >= 2 (a kept group needs a baseline) and < "
                             f"num_generations={self.num_generations} (else nothing is filtered)")
        super()._check()


class GFPOTrainer(GRPOTrainer):
    """GFPO on the online engine. TRL's signature: GRPOTrainer's with `group_filter_func` after
    `reward_processing_classes`."""

    config_class = GFPOConfig
    _tag = "GFPO"
    _name = "GFPO"
    _citation = """@article{shrivastava2025sample,
    title   = {{Sample More to Think Less: Group Filtered Policy Optimization for Concise Reasoning}},
    author  = {Vaishnavi Shrivastava and Ahmed Awadallah and Vidhisha Balachandran and Shivam Garg and Harkirat Behl
               and Dimitris Papailiopoulos},
    journal = {arXiv preprint},
    year    = 2025,
    eprint  = {arXiv:2508.09726}
}"""

    def __init__(self, model, reward_funcs=None, args: GFPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, group_filter_func=None,
                 callbacks=None, optimizers=(None, None), peft_config=None, **kwargs):
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, reward_processing_classes=reward_processing_classes,
                         callbacks=callbacks, optimizers=optimizers, peft_config=peft_config, **kwargs)
        self.group_filter_func = group_filter_func
        self.num_remains_in_group = self.args.num_remains_in_group
        if group_filter_func is None and self.num_remains_in_group is not None:
            raise ValueError(f"num_remains_in_group={self.num_remains_in_group} needs a group_filter_func to "
                             "rank each group's completions")
        if group_filter_func is not None and self.num_remains_in_group is None:
            logger.warning("group_filter_func is not used: num_remains_in_group is not set (GFPO trains as GRPO)")

    def rows_in_loss(self, rollout: Rollout, scores: Tensor) -> Tensor | None:
        n, k = self.num_remains_in_group, self.args.num_generations
        if n is None or self.group_filter_func is None:
            return None
        # the completions as the reward functions got them (chat messages for chat prompts)
        prompts = self.batch_prompts or [""] * rollout.completion_ids.shape[0]
        _, completions, _ = self.decode(rollout, prompts)
        groups = len(completions) // k
        ranked = self.group_filter_func(group_completions=[completions[i * k:(i + 1) * k] for i in range(groups)],
                                        group_rewards=scores.view(groups, k).tolist())
        ranks = check_filter_scores(ranked, groups, k)
        kept = torch.zeros(groups, k, dtype=torch.bool)
        kept.scatter_(1, ranks.topk(n, dim=1).indices, True)
        return kept.flatten()


def check_filter_scores(scores, groups: int, k: int) -> Tensor:
    """group_filter_func's answer as a (groups, k) float tensor; a clear error unless it is one finite number per
    completion of each group."""
    if not isinstance(scores, (list, tuple, Tensor)) or len(scores) != groups:
        raise ValueError(f"group_filter_func must return one list of scores per group ({groups} groups), got "
                         f"{type(scores).__name__} of length {len(scores) if hasattr(scores, '__len__') else '?'}")
    for i, row in enumerate(scores):
        if len(row) != k:
            raise ValueError(f"group_filter_func: group {i} has {k} completions but {len(row)} scores")
        bad = [v for v in (row.tolist() if isinstance(row, Tensor) else row)
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
        if bad:
            raise ValueError(f"group_filter_func: group {i}'s scores must be finite numbers, got {bad[:3]}")
    return torch.tensor([[float(v) for v in row] for row in scores], dtype=torch.float64)
