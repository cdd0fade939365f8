"""XPO: Exploratory Preference Optimization (Xie et al. 2024, "Exploratory Preference Optimization:
Harnessing Implicit Q*-Approximation for Sample-Efficient RLHF").

Online DPO with an exploration bonus. For each prompt the policy samples y and the frozen reference
samples ỹ; the ranker orders the pair, and the loss is the DPO loss of the ordered pair plus α log π(ỹ)
(`core.preference_losses.xpo_exploration`): lowering the likelihood of the reference's own samples pushes
the policy to explore beyond them (α = 1e-5 by default, as TRL's: a gentle push).

Ties. The paper labels each pair by a draw from the preference, P(y ≻ ỹ), which is 1/2 when the rewards
tie. TRL instead lets the policy's completion win every tie, and that rule, not the bonus, is what such a
run learns most: a tie (about 30% of the pairs on the built-in `reverse` task, mostly two wrong answers of
equal partial credit) raises the policy's own answer and lowers the reference's with weight about β/2 =
0.05, 5000 times α. The demo's XPO stage (40 steps from its SFT checkpoint) took held-out accuracy from
0.25 to 0.17 under TRL's rule and to 0.29 with ties as no preference. So ties state no preference (the
`preference_or_tie` estimator) and train on the loss expected under a fair coin's label
(`core.preference_losses.tied_pair_loss`), which pulls the two log-ratios together;
advantage_estimator="preference_pair" restores TRL's rule.

The bonus is the paper's (α Σ log π(ỹ), ỹ the reference's sample, minimised) and TRL's (α times the policy's
summed log-prob of the reference's completion, added to the DPO loss) in sign and scale: at α = 1e-5 and a
summed log-prob near -10 it is about 1e-4 a pair, far below the DPO term, so it neither helps nor harms at
this size. Greedy accuracy from the slow test's SFT checkpoint is noisy for every pair trainer: the
checkpoint stops just before the tiny model "gets" reversal, and 100 held-out prompts give a binomial std of
about 0.04. With the slow test's settings (60 steps of 32 pairs): on its own checkpoint (0.15 greedy, 0.424
sampled) XPO ends at 0.25 / 0.553 (0.12 / 0.473 before the reference's log-probs of its own samples came from
its sampler: float rounding that moved the run) and Online DPO at 0.20 / 0.544; on the same recipe's checkpoint built at one
thread (0.18 / 0.432), seeds 42, 1, 2, 3, XPO ends at 0.29, 0.18, 0.25, 0.26 greedy and 0.53-0.56 sampled,
Online DPO at 0.24, 0.13, 0.20, 0.16 and 0.52-0.54. XPO's sampled reward rose in every run; its greedy
accuracy moves with the checkpoint and the seed as Online DPO's does.

A preset of `OnlineDPOTrainer`: the pair's second completion comes from the reference
(`OnlineDPOTrainer.sample_pair`), with its log-probs under the reference, so the reference's forward scores the
policy's completions only; `alpha` may be a list, one per epoch, as `beta`.

Departures: as Online DPO's (online_dpo.py); tied pairs as above (TRL: the policy's completion wins); the
loss types are every pairwise loss of core.preference_losses (TRL: sigmoid, ipo); no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.core.preference_losses import xpo_exploration
from posttrain.trainers.online import OnlineTrainer
from posttrain.trainers.online_config import estimator_help
from posttrain.trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer, Pairs, per_epoch, schedule


@dataclass
class XPOConfig(OnlineDPOConfig):
    """XPO's configuration: Online DPO's fields plus the exploration weight `alpha`."""

    alpha: list[float] = field(default_factory=lambda: [1e-5], metadata={"help": "Weight α of the exploration "
                               "term α log π(ỹ), ỹ the reference's sample; a list gives one per epoch, the last "
                               "for the epochs after it."})
    advantage_estimator: str = field(default="preference_or_tie", metadata={"help": estimator_help(
                                     "XPO: 'preference_or_tie' (a tie is no preference: the loss expected under a "
                                     "fair coin's label); 'preference_pair' lets the policy's completion win ties, "
                                     "as TRL.")})

    def _check(self):
        if isinstance(self.alpha, str):  # from the command line, one value
            self.alpha = [float(v) for v in self.alpha.split(",")]
        values = schedule(self.alpha, "alpha")
        self.alpha = values[0] if len(values) == 1 else list(values)  # as TRL: one value is a float
        super()._check()


class XPOTrainer(OnlineDPOTrainer):
    """XPO on the online engine; same signature as OnlineDPOTrainer."""

    config_class = XPOConfig
    _tag = "xpo"
    _name = "XPO"
    _citation = """@article{xie2024exploratory,
    title   = {{Exploratory Preference Optimization: Harnessing Implicit Q*-Approximation for Sample-Efficient RLHF}},
    author  = {Tengyang Xie and Dylan J. Foster and Akshay Krishnamurthy and Corby Rosset and Ahmed Awadallah and
               Alexander Rakhlin},
    journal = {arXiv preprint},
    year    = 2024,
    eprint  = {arXiv:2405.21046}
}"""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.replays = False  # the reference's rows were not decoded by the policy: nothing to replay

    @property
    def alpha(self) -> float:
        """This epoch's α (TRL's `trainer.alpha`)."""
        return per_epoch(self.args.alpha, self.state.epoch)

    def sample_completions(self, prompt_ids, sampling=None, continue_turn=None, vision=None):
        if sampling is not None:  # evaluation: the policy's own samples
            return super().sample_completions(prompt_ids, sampling, continue_turn, vision=vision)
        if vision is not None:
            raise ValueError(f"{type(self).__name__} samples text prompts only (its second sampler takes no images)")
        return self.sample_pair(prompt_ids, self.ref_model if self.ref_model is not None else self.policy)

    def reference_logprobs(self, batch) -> Tensor:
        """Rows 1, 3, ... are the reference's own samples: the reference's sampler already gave their log-probs at
        the sampling temperature (`old_logp` there; equal to its forward's up to float rounding), so only the
        policy's rows (0, 2, ...) go through the reference's forward. Rollouts not made by `sample_pair` (a
        rollout_func, tools): every row, as the engine scores them."""
        if self.rollout_func is not None or self.tooling is not None:
            return super().reference_logprobs(batch)
        policy_rows = {k: batch[k][0::2] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        scored = super().reference_logprobs(policy_rows)
        return torch.stack([scored, batch["old_logp"][1::2].to(scored.dtype)], dim=1).flatten(0, 1)

    def pair_losses(self, pairs: Pairs, logp: Tensor, inputs: dict) -> tuple[Tensor, dict]:
        dpo, _ = super().pair_losses(pairs, logp, inputs)
        exploration = xpo_exploration(pairs.logps[1::2], self.alpha)  # rows 1, 3, ...: the reference's samples
        keep = pairs.valid
        return dpo + exploration, {"loss/dpo": dpo.detach()[keep].mean(), "loss/xpo": exploration.detach()[keep].mean(),
                                   "alpha": self.alpha}

    def _record_rollout(self, g: dict, scores: Tensor, truncated: Tensor):
        OnlineTrainer._record_rollout(self, g, scores, truncated)  # XPO's margin is model - ref, not |chosen - rejected|
        model, ref = scores[0::2], scores[1::2]
        self.record({"objective/model_scores": float(model.mean()), "objective/ref_scores": float(ref.mean()),
                     "objective/scores_margin": float((model - ref).mean())}, "train")
        self.record_sources(truncated)
