"""IW-OPD: Importance-Weighted On-Policy Distillation ("On the Position Bias of On-Policy Distillation", 2026).

On-policy distillation's sampled-token signal, a_t = log q_teacher(y_t) - log q_student(y_t) for each token the
student sampled, is a per-token advantage (the negated single-sample reverse KL). Late tokens follow prefixes on
which the student has already drifted from what the teacher would write, where the teacher's supervision is least
reliable; IW-OPD weights each token by how little of the completion's total |a| came before it,
w_t = 1 + γ (1 - Σ_{s<t} |a_s| / Σ_s |a_s|), and minimises -Σ_t w_t a_t log q_student(y_t) (a policy gradient with
advantage w_t a_t; `core.advantages.iw_opd`). With `distillation_objective="jsd"` the trainer is the distillation
preset's generalised JSD instead.

The distillation preset (`posttrain.trainers.distillation`) with IW-OPD's loss: its sampler, teacher (local, or a
teacher server's sampled-token log-probs), micro-batches and global token denominators; the advantage is the
registered estimator, the loss per token -w_t a_t log q(y_t) averaged as the engine's other token losses.

Departures from TRL: the student's log-probs behind a_t are the training forward's, detached (one optimizer step
per generation batch: the sampler's own); the loss is averaged over the optimizer step's tokens of all processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from posttrain.core.advantages import AdvantageInput, compute_advantages, iw_opd_weights
from posttrain.core.masked import aggregate_loss, masked_mean
from posttrain.forward.completions import completion_logprobs
from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer

OBJECTIVES = ("iw_opd", "jsd")


@dataclass
class IWOPDConfig(DistillationConfig):
    """TRL's IWOPDConfig: DistillationConfig's fields and defaults plus IW-OPD's."""

    distillation_objective: str = field(default="iw_opd", metadata={"help": "'iw_opd': the importance-weighted "
                                        "sampled-token objective; 'jsd': the generalised JSD of DistillationTrainer."})
    iw_opd_gamma: float = field(default=0.5, metadata={"help": "IW-OPD's weight amplification: the first token weighs "
                                "1 + gamma, a token after all of the completion's disagreement 1."})
    iw_opd_epsilon: float = field(default=1e-8, metadata={"help": "Smallest total |teacher - student log-prob| a "
                                  "completion's weights are normalised by."})

    def _check(self):
        super()._check()
        if self.distillation_objective not in OBJECTIVES:
            raise ValueError(f"distillation_objective={self.distillation_objective!r}: choose one of {OBJECTIVES}")
        if self.iw_opd_gamma < 0 or not self.iw_opd_epsilon > 0:
            raise ValueError(f"iw_opd_gamma={self.iw_opd_gamma} must be >= 0 and iw_opd_epsilon="
                             f"{self.iw_opd_epsilon} > 0")
        if self.distillation_objective == "iw_opd":
            if self.lmbda != 1.0:
                raise ValueError(f"distillation_objective='iw_opd' is on-policy: set lmbda=1.0 (got {self.lmbda})")
            if self.reverse_kl_top_1_mode != "sampled":
                raise ValueError("distillation_objective='iw_opd' is defined on the sampled tokens: set "
                                 "reverse_kl_top_1_mode='sampled'")
            if self.use_fused_linear_loss:
                raise ValueError("use_fused_linear_loss=True is for the JSD objective; distillation_objective='iw_opd' "
                                 "reads the sampled tokens' log-probs")


class IWOPDTrainer(DistillationTrainer):
    """IW-OPD on the distillation preset. Signature as TRL's: `IWOPDTrainer(model, teacher_model=None, args=None,
    train_dataset=None, eval_dataset=None, processing_class=None, callbacks=None, optimizers=(None, None),
    peft_config=None)`."""

    config_class = IWOPDConfig
    _tag = "iw-opd"
    _name = "IW-OPD"
    _citation = """@article{iwopd2026,
    title   = {{On the Position Bias of On-Policy Distillation}},
    journal = {arXiv preprint arXiv:2606.22600},
    year    = 2026
}"""

    def teacher_sampled_logprobs(self, mb: dict) -> torch.Tensor:
        """(B, C) the teacher's log-prob of each completion token at `temperature`."""
        if self.teacher_server is not None:
            return self.server_logprobs(mb, 1)["sampled_logp"]
        with self.teacher() as teacher:
            logp, _ = completion_logprobs(teacher, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                          mb["completion_mask"], self.args.temperature)
        return logp

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        if args.distillation_objective == "jsd":
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        mask = inputs["loss_mask"]
        logp, _, _ = self.forward(model, inputs)
        teacher = self.teacher_sampled_logprobs(inputs)
        missing = mask.bool() & ~torch.isfinite(teacher)
        if missing.any():
            raise ValueError(f"no teacher log-prob for {int(missing.sum())} of {int(mask.sum())} completion tokens")
        signal = torch.where(mask.bool(), teacher - logp.detach(), 0.0)  # a_t
        advantages, _ = compute_advantages("iw_opd", AdvantageInput(scores=torch.zeros(len(mask)), mask=mask,
                                                                    token_rewards=signal),
                                           iw_opd_gamma=args.iw_opd_gamma, iw_opd_epsilon=args.iw_opd_epsilon)
        per_token = -advantages * logp
        loss = aggregate_loss(per_token, mask, self.loss_mode, denominator=inputs["denominator"],
                              max_length=args.max_completion_length)
        weights = iw_opd_weights(signal, mask, args.iw_opd_gamma, args.iw_opd_epsilon)
        on = mask.bool()  # every completion holds a token (its EOS at least)
        self.record({"iw_opd/mean_advantage": masked_mean(advantages, mask),
                     "iw_opd/mean_abs_advantage": masked_mean(signal.abs(), mask),
                     "iw_opd/mean_weight": masked_mean(weights, mask),
                     "iw_opd/min_weight": weights.masked_fill(~on, math.inf).min(),
                     "iw_opd/max_weight": weights.masked_fill(~on, -math.inf).max(),
                     "divergence": masked_mean(-signal, mask)}, "train")
        return (loss, None) if return_outputs else loss
