"""Nash-MD (Munos et al. 2023, "Nash Learning from Human Feedback").

Nash mirror descent towards the Nash equilibrium of a preference game. For each prompt the policy samples
y and the geometric mixture of policy and reference, π_mix ∝ π^(1-c) π_ref^c (c = `mixture_coef`), samples
y' (`rollout.backends.GeometricMixture`); the ranker gives P = P(y beats y') = σ(r(y) - r(y')), and y
trains the policy by REINFORCE on P with 0.5 as the control variate, plus a REINFORCE estimate of
β KL(π || π_ref) (`core.preference_losses.nash_md_loss`; the `nash_md` advantage estimator holds P - 0.5).

A preset of `OnlineDPOTrainer`; `beta` and `mixture_coef` may be lists, one per epoch.

Departures: as Online DPO's (online_dpo.py). With a judge, P = σ(1 - 0) or σ(0 - 1) (posttrain's judges give
verdicts, not probabilities); TRL asks the judge for a probability. Several reward functions are summed
(weighted) into one score (TRL takes one). No vLLM.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.core.masked import masked_mean, masked_sum
from posttrain.core.preference_losses import nash_md_loss
from posttrain.rollout.backends import GeometricMixture
from posttrain.rollout.generate import default_backend
from posttrain.trainers.online import OnlineTrainer
from posttrain.trainers.online_config import estimator_help
from posttrain.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer, Pairs, per_epoch, schedule


@dataclass
class NashMDConfig(OnlineDPOConfig):
    """Nash-MD's configuration: Online DPO's fields plus `mixture_coef`."""

    mixture_coef: list[float] = field(default_factory=lambda: [0.5], metadata={"help": "The reference's share c of "
                                      "the geometric mixture π^(1-c) π_ref^c that samples each pair's second "
                                      "completion, in [0, 1]; a list gives one per epoch, the last for the epochs "
                                      "after it."})
    advantage_estimator: str = field(default="nash_md", metadata={"help": estimator_help(
                                     "Nash-MD: 'nash_md' (P - 0.5 on the policy's completion).")})

    def _check(self):
        if isinstance(self.mixture_coef, str):  # from the command line, one value
            self.mixture_coef = [float(v) for v in self.mixture_coef.split(",")]
        values = schedule(self.mixture_coef, "mixture_coef")
        if not all(0.0 <= v <= 1.0 for v in values):
            raise ValueError(f"mixture_coef must be in [0, 1] (the reference's share of the mixture), got {list(values)}")
        self.mixture_coef = values[0] if len(values) == 1 else list(values)
        super()._check()


class NashMDTrainer(OnlineDPOTrainer):
    """Nash-MD on the online engine; same signature as OnlineDPOTrainer."""

    config_class = NashMDConfig
    _tag = "nash-md"
    _name = "Nash-MD"
    _citation = """@inproceedings{munos2024nash,
    title     = {{Nash Learning from Human Feedback}},
    author    = {R{\\'e}mi Munos and Michal Valko and Daniele Calandriello and Mohammad Gheshlaghi Azar and Mark Rowland
                 and Zhaohan Daniel Guo and Yunhao Tang and Matthieu Geist and Thomas Mesnard and C{\\^o}me Fiegel
                 and Andrea Michi and Marco Selvi and Sertan Girgin and Nikola Momchev and Olivier Bachem and
                 Daniel J. Mankowitz and Doina Precup and Bilal Piot},
    booktitle = {Forty-first International Conference on Machine Learning},
    year      = 2024
}"""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.replays = False  # the mixture's rows were not decoded by the policy alone: nothing to replay

    @property
    def mixture_coef(self) -> float:
        """This epoch's mixture coefficient (TRL's `trainer.mixture_coef`)."""
        return per_epoch(self.args.mixture_coef, self.state.epoch)

    def sample_completions(self, prompt_ids, sampling=None, continue_turn=None, vision=None):
        if sampling is not None:  # evaluation: the policy's own samples
            return super().sample_completions(prompt_ids, sampling, continue_turn, vision=vision)
        if vision is not None:
            raise ValueError(f"{type(self).__name__} samples text prompts only (its second sampler takes no images)")
        ref = self.ref_model if self.ref_model is not None else self.policy
        mixture = GeometricMixture(default_backend(self.policy), default_backend(ref), self.mixture_coef,
                                   ref_context=lambda: self.reference_context(self.ref_model))
        return self.sample_pair(prompt_ids, mixture, contextlib.nullcontext())  # it enters the context per call

    def policy_logprobs(self, model, inputs: dict) -> Tensor:
        """The policy's completions (rows 0, 2, ...) alone go through the training forward: the mixture's (rows 1,
        3, ...) take no part in the loss, so scoring them would only add their positions to the forward and to a
        backward that carries zeros through them (a third of the packed positions at 32-token completions). Their
        rows of the result are zeros (no gradient), read by nothing."""
        own = {k: inputs[k][0::2] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        logp, _, _ = self.forward(model, own)
        return torch.stack([logp, torch.zeros_like(logp)], dim=1).flatten(0, 1)

    def pair_losses(self, pairs: Pairs, logp: Tensor, inputs: dict) -> tuple[Tensor, dict]:
        mask = inputs["loss_mask"][0::2]  # the policy's completions; the mixture's are not trained on
        policy_logp, ref_logp = logp[0::2], inputs["ref_logp"][0::2]
        probability = masked_mean(inputs["advantages"][0::2], mask, dim=1) + 0.5
        losses = nash_md_loss(policy_logp, ref_logp, mask, probability, self.args.beta)
        keep = pairs.valid
        score = ((probability - 0.5) * masked_sum(policy_logp, mask, dim=1)).detach()
        kl = masked_sum(policy_logp - ref_logp, mask, dim=1).detach()
        margin = (pairs.logps[0::2] - pairs.ref_logps[0::2]).detach()
        return losses, {"loss/score": score[keep].mean(), "loss/kl": kl[keep].mean(),
                        "rewards/probabilities": probability[keep].mean(),
                        "logps/chosen": pairs.logps[0::2].detach()[keep].mean(),
                        "logps/rejected": pairs.ref_logps[0::2][keep].mean(),
                        "rewards/margins": margin[keep].mean(), "rewards/accuracies": (margin > 0)[keep].float().mean(),
                        "beta": self.args.beta, "mixture_coef": self.mixture_coef}

    def record_pairs(self, pairs: Pairs, metrics: dict):
        if not bool(pairs.valid.any()):  # every pair left out of the loss: no means
            return
        self.record({k: float(v) for k, v in metrics.items()}, "train")  # Nash-MD's own (TRL's names)

    def _record_rollout(self, g: dict, scores: Tensor, truncated: Tensor):
        OnlineTrainer._record_rollout(self, g, scores, truncated)
        self.record({"rewards/chosen": float(scores[0::2].mean()), "rewards/rejected": float(scores[1::2].mean())},
                    "train")
        self.record_sources(truncated)

