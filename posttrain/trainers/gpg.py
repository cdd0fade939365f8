"""GPG: Group Policy Gradient (Chu et al. 2026, "GPG: A Simple and Strong Reinforcement Learning Baseline for
Model Reasoning").

GRPO reduced to the plain policy gradient: no critic, no reference model, no KL (beta 0), advantages centred on
the group mean without the std division (scale_rewards "none"). One change remains: a group whose completions
all got the same score has zero advantages, gives no gradient, yet counts in the loss's denominator and so
shrinks the update. GPG divides the loss by the share of completions in informative groups (the paper's eq. 7,
alpha = B / (B - M), M the completions of all-equal groups). Here that is the engine's `rows_in_loss` hook: with
`bias_correction` the completions of all-equal groups leave the loss, so the registered aggregation's global
denominator (completions for loss_type "grpo", tokens for "bnpo"/"dapo") counts only informative ones.

A preset of the online engine: GRPO's fields with TRL's GPGConfig defaults (beta 0.0, scale_rewards "none",
loss_type "grpo") plus `bias_correction`. With one generation batch per optimizer step and the ratio 1 at the
point of evaluation, the clipped surrogate's gradient is the policy gradient, as in TRL.

Departures: with a token-count aggregation ("bnpo", "dapo") the denominator is the informative completions'
tokens, exactly, where TRL multiplies the whole-batch token mean by the completion share (exact only at equal
lengths); TRL's requirement that steps_per_generation * num_iterations divide gradient_accumulation_steps is not
needed, as the denominator is global to each optimizer step; the paper's resampling below a valid-share
threshold is left out, as in TRL. Settings that silence a completion's tokens while keeping its advantage, or add
terms the correction would rescale, are refused as TRL refuses them; so are `missing_eos_penalty` and
`multi_objective_aggregation="normalize_then_sum"`, which make a group's advantages differ where its summed
scores are equal. TRL's `router_aux_loss_coef` has no counterpart (posttrain adds no MoE auxiliary loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from posttrain.rollout.generate import Rollout
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


@dataclass
class GPGConfig(GRPOConfig):
    """GPG's configuration: GRPO's fields with GPG's defaults and the bias correction."""

    beta: float = field(default=0.0, metadata={"help": "KL coefficient. GPG has no KL constraint: 0.0, so no "
                        "reference model is loaded."})
    scale_rewards: str = field(default="none", metadata={"help": "As GRPOConfig's ('group', 'batch', 'none'); GPG "
                               "centres on the group mean without dividing by the std: 'none'."})
    loss_type: str = field(default="grpo", metadata={"help": "Loss aggregation as GRPOConfig's; 'grpo' (one token "
                           "mean per completion) makes the bias correction count completions."})
    bias_correction: bool = field(default=True, metadata={"help": "Leave the completions of groups whose scores "
                                  "are all equal (zero advantage, no gradient) out of the loss's denominator: the "
                                  "loss is divided by the share of informative completions (GPG's eq. 7)."})

    def _check(self):
        super()._check()
        if not self.bias_correction:
            return
        refused = [name for name, on in [
            ("beta != 0 (the KL term would be rescaled with the policy loss)", self.beta != 0),
            ("mask_truncated_completions=True", self.mask_truncated_completions),
            ("top_entropy_quantile < 1.0", self.top_entropy_quantile < 1.0),
            ("off_policy_mask_threshold", self.off_policy_mask_threshold is not None),
            ("entropy_coef != 0 (the bonus would be rescaled with the policy loss)", self.entropy_coef != 0),
            ("missing_eos_penalty (it separates completions of a group whose scores are equal)",
             self.missing_eos_penalty is not None),
            ("multi_objective_aggregation='normalize_then_sum' (a group's advantages can differ where its summed "
             "scores are equal)", self.multi_objective_aggregation == "normalize_then_sum"),
        ] if on]
        if refused:
            raise ValueError(f"GPG's bias_correction counts the completions whose group scores differ; it cannot "
                             f"be exact with {', '.join(refused)}. Change these, or set bias_correction=False")


class GPGTrainer(GRPOTrainer):
    """GPG on the online engine; same signature as GRPOTrainer."""

    config_class = GPGConfig
    _tag = "GPG"
    _name = "GPG"
    _citation = """@inproceedings{chu2026gpg,
    title     = {{GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning}},
    author    = {Xiangxiang Chu and Hailang Huang and Xiao Zhang and Fei Wei and Yong Wang},
    booktitle = {International Conference on Learning Representations},
    year      = 2026,
    eprint    = {arXiv:2504.02546}
}"""

    def rows_in_loss(self, rollout: Rollout, scores: Tensor) -> Tensor | None:
        if not self.args.bias_correction:
            return None
        return informative_rows(scores, self.args.num_generations)


def informative_rows(scores: Tensor, group_size: int) -> Tensor:
    """(N,) bool: the completions of groups (consecutive `group_size` rows) whose scores are not all equal."""
    groups = scores.reshape(-1, group_size)
    varied = (groups != groups[:, :1]).any(dim=1)
    return varied.repeat_interleave(group_size)
