"""DPPO: Divergence Proximal Policy Optimization (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement
Learning").

PPO's ratio clip over-restrains rare tokens (a small change of a small probability is a large ratio) and
under-restrains likely ones. DPPO keeps the policy near the sampling policy by a divergence of the two at each
sampled token instead: a token whose divergence exceeds ε_high while the policy raises its probability for a
positive advantage, or exceeds ε while it lowers it for a negative one, is left out of the loss; the others train
with the policy gradient weighted by the detached importance ratio, capped at `clip_ratio_c`
(`core.policy_losses.dppo`, divergences "binary_tv" |π - π_old| and "binary_kl" the Bernoulli KL).

A preset of the online engine: GRPO's fields with TRL's DPPOConfig defaults (policy_loss "dppo", loss_type
"dapo", epsilon = epsilon_high = 0.15; the paper suggests 0.05 for the KL divergences).

Departures: the top-K divergences ("topk_tv", "topk_kl", and `divergence_topk`) are refused: they need the
sampler's top-K log-probs stored with each rollout, which posttrain's sampler does not record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.core.policy_losses import DPPO_DIVERGENCES, POLICY_LOSSES
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


@dataclass
class DPPOConfig(GRPOConfig):
    """DPPO's configuration: GRPO's fields, the divergence trust region and its thresholds."""

    policy_loss: str = field(default="dppo", metadata={"help": "A core.policy_losses loss: "
                             f"{', '.join(POLICY_LOSSES)}."})
    loss_type: str = field(default="dapo", metadata={"help": "Loss aggregation; DPPO takes 'dapo' only (the token "
                           "mean over the optimizer step), as TRL."})
    divergence_type: str = POLICY_LOSSES.field("divergence_type")
    divergence_topk: int = field(default=20, metadata={"help": "K of TRL's top-K divergences ('topk_tv', "
                                 "'topk_kl'), which posttrain refuses; kept for TRL's configs."})
    clip_ratio_c: float = POLICY_LOSSES.field("clip_ratio_c")
    epsilon: float = field(default=0.15, metadata={"help": "Divergence threshold δ_low: a token moving its "
                           "probability down for a negative advantage past it is left out (0.15 for TV, 0.05 "
                           "suggested for KL)."})
    epsilon_high: float | None = field(default=0.15, metadata={"help": "Divergence threshold δ_high: a token "
                                       "moving its probability up for a positive advantage past it is left out."})

    def _check(self):
        if self.divergence_type in ("topk_tv", "topk_kl"):
            raise ValueError(f"divergence_type={self.divergence_type!r} needs the sampler's top-K log-probs of "
                             f"every rollout, which posttrain does not record; choose one of {DPPO_DIVERGENCES}")
        if self.divergence_type not in DPPO_DIVERGENCES:
            raise ValueError(f"divergence_type must be one of {DPPO_DIVERGENCES}, got {self.divergence_type!r}")
        if self.divergence_topk < 1:
            raise ValueError(f"divergence_topk must be >= 1, got {self.divergence_topk}")
        if self.clip_ratio_c <= 0:
            raise ValueError(f"clip_ratio_c must be > 0, got {self.clip_ratio_c}")
        for name, value, wanted in [("loss_type", self.loss_type, "dapo"), ("top_entropy_quantile",
                                    self.top_entropy_quantile, 1.0), ("off_policy_mask_threshold",
                                    self.off_policy_mask_threshold, None)]:
            if value != wanted:
                raise ValueError(f"DPPO supports {name}={wanted!r} only (as TRL), got {value!r}")
        super()._check()


class DPPOTrainer(GRPOTrainer):
    """DPPO on the online engine; same signature as GRPOTrainer."""

    config_class = DPPOConfig
    _tag = "DPPO"
    _name = "DPPO"
    _citation = """@article{qi2026rethinking,
    title   = {{Rethinking the Trust Region in LLM Reinforcement Learning}},
    author  = {Penghui Qi and Xiangxin Zhou and Zichen Liu and Tianyu Pang and Chao Du and Min Lin and Wee Sun Lee},
    journal = {arXiv preprint},
    year    = 2026,
    eprint  = {arXiv:2602.04879}
}"""
