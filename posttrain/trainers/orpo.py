"""Odds Ratio Preference Optimization (Hong et al. 2024, "ORPO: Monolithic Preference Optimization
without Reference Model").

ORPO does supervised fine-tuning and preference alignment in one loss, with no reference model: the
chosen completions' negative log-likelihood plus β times the odds-ratio term -log σ(log OR), where
log OR = log odds(p_w) - log odds(p_l), odds(p) = p / (1 - p) and p is a completion's per-token mean
probability exp(mean log π(y_t|x, y_<t)) (`core.contrastive_losses.odds_ratio_loss`). β is the paper's λ.

Departures: the mean log-prob is clamped at -1e-6 before the odds are taken (a completion the model
is certain of has infinite odds); chosen and rejected go through the model in one forward that asks
for the completion logits only (`preference_base.completion_logps`), as in DPO.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.core.contrastive_losses import odds_ratio_loss, token_mean_nll
from posttrain.trainers.preference_base import ReferenceFreePairConfig, ReferenceFreePairTrainer


@dataclass
class ORPOConfig(ReferenceFreePairConfig):
    """Configuration of `ORPOTrainer`, on top of `transformers.TrainingArguments`."""

    beta: float = field(default=0.1, metadata={
        "help": "Weight λ of the odds-ratio term against the chosen completions' NLL (the paper's λ, the "
                "ORPO code's alpha)."})


class ORPOTrainer(ReferenceFreePairTrainer):
    """Preference pairs -> a policy, by NLL on the chosen completions plus ORPO's odds-ratio term."""

    _tag = "orpo"
    _name = "ORPO"
    _citation = """@inproceedings{hong2024orpo,
    title     = {{ORPO: Monolithic Preference Optimization without Reference Model}},
    author    = {Jiwoo Hong and Noah Lee and James Thorne},
    booktitle = {Proceedings of the 2024 Conference on Empirical Methods in Natural Language Processing},
    year      = 2024,
    eprint    = {arXiv:2403.07691}
}"""
    config_class = ORPOConfig

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        beta, mode = self.args.beta, self.mode()
        logps, lengths, mean_logits = self.pair_logps(model, inputs)  # (2B,) each
        B = logps.shape[0] // 2
        mean = logps / lengths.clamp(min=1)  # per-token mean log-probs: the odds are taken of exp(mean)
        ratio_losses, log_odds = odds_ratio_loss(mean[:B], mean[B:], beta=beta)
        nll = token_mean_nll(logps[:B], lengths[:B])
        loss = nll + ratio_losses.mean()

        chosen_rewards, rejected_rewards = (beta * mean[:B]).detach(), (beta * mean[B:]).detach()
        self.record_pairs(chosen_rewards, rejected_rewards, mean, mean_logits, mode)
        self.record({"nll_loss": nll.detach(), "log_odds_ratio": (ratio_losses / -beta).detach().mean(),
                     "log_odds_chosen": log_odds.detach().mean()}, mode)
        if return_outputs:
            return loss, {"rewards_chosen": chosen_rewards, "rewards_rejected": rejected_rewards}
        return loss
