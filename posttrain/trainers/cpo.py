"""Contrastive Preference Optimization (Xu et al. 2024, "Contrastive Preference Optimization: Pushing the
Boundaries of LLM Performance in Machine Translation") and its reference-free relatives.

CPO drops DPO's reference model: the loss is a pair loss of the policy's own log-probs,
-log σ(β (log π(y_w|x) - log π(y_l|x))), plus `cpo_alpha` x the chosen completions' NLL (the
behaviour-cloning regulariser). `loss_type` picks the pair loss from `core.contrastive_losses.MARGIN_LOSSES`:
sigmoid and hinge on summed log-probs, ipo and simpo (SimPO, Meng et al. 2024: target margin
`simpo_gamma`) on per-token means. `alpha` != 0 reshapes each reward log p into AlphaPO's
(1 - p^(-α)) / α (Gupta et al. 2025); `loss_type="alphapo"` is shorthand for simpo with cpo_alpha = 0.
SimPO with cpo_alpha > 0 is CPO-SimPO.

Departures: none in the loss. As in DPO, chosen and rejected go through the model in one forward that
asks for the completion logits only (`preference_base.completion_logps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.core.contrastive_losses import (MARGIN_LOSSES, alphapo_rewards, check_margin_options, margin_loss,
                                               token_mean_nll)
from posttrain.trainers.preference_base import ReferenceFreePairConfig, ReferenceFreePairTrainer

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


@dataclass
class CPOConfig(ReferenceFreePairConfig):
    """Configuration of `CPOTrainer`, on top of `transformers.TrainingArguments`."""

    beta: float = field(default=0.1, metadata={
        "help": "Inverse temperature β of the pair loss; for 'ipo' the paper's regularisation τ."})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "Probability ε in [0, 0.5] that a preference label is flipped (conservative loss); only 'sigmoid' "
                "and 'simpo' have a smoothed form."})
    loss_type: str = field(default="sigmoid", metadata={
        "help": "Pair loss: 'sigmoid' (CPO), 'hinge' (SLiC), 'ipo', 'simpo' (SimPO, target margin simpo_gamma), or "
                "'alphapo' (shorthand: loss_type='simpo' and cpo_alpha=0; set alpha too). See "
                "core/contrastive_losses.py.",
        "choices": [*CPO_LOSS_TYPES, "alphapo"]})
    cpo_alpha: float = field(default=1.0, metadata={
        "help": "Weight of the behaviour-cloning term, the chosen completions' NLL per token (0: pure SimPO)."})
    simpo_gamma: float = field(default=0.5, metadata={
        "help": "SimPO's target reward margin γ, used only with loss_type='simpo'."})
    alpha: float = field(default=0.0, metadata={
        "help": "AlphaPO's reward shape: each reward log p becomes (1 - p^(-alpha)) / alpha, for every loss type "
                "(0: the plain log-probability)."})

    def __post_init__(self):
        if self.loss_type == "alphapo":  # TRL's shorthand, resolved before the checks
            self.loss_type, self.cpo_alpha = "simpo", 0.0
        super().__post_init__()

    def _check(self):
        super()._check()
        check_margin_options(self.loss_type, CPO_LOSS_TYPES, self.label_smoothing, [*CPO_LOSS_TYPES, "alphapo"],
                             "'sigmoid' or 'simpo'", "cpo_alpha", self.cpo_alpha)


class CPOTrainer(ReferenceFreePairTrainer):
    """Preference pairs -> a policy, by a reference-free pair loss plus behaviour cloning on the chosen."""

    _tag = "cpo"
    _name = "CPO"
    _citation = """@inproceedings{xu2024contrastive,
    title     = {{Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in Machine
                 Translation}},
    author    = {Haoran Xu and Amr Sharaf and Yunmo Chen and Weiting Tan and Lingfeng Shen and Benjamin Van Durme
                 and Kenton Murray and Young Jin Kim},
    booktitle = {Forty-first International Conference on Machine Learning (ICML 2024)},
    year      = 2024,
    eprint    = {arXiv:2401.08417}
}"""
    config_class = CPOConfig

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, mode = self.args, self.mode()
        spec = MARGIN_LOSSES[args.loss_type]
        logps, lengths, mean_logits = self.pair_logps(model, inputs)  # (2B,) each
        B = logps.shape[0] // 2
        scored = logps / lengths.clamp(min=1) if spec.length_normalised else logps
        rewards = alphapo_rewards(scored, args.alpha)  # (2B,)
        losses = margin_loss(args.loss_type, rewards[:B] - rewards[B:], beta=args.beta,
                             label_smoothing=args.label_smoothing, gamma=args.simpo_gamma)
        loss = losses.mean()
        if args.cpo_alpha:  # the NLL forward costs nothing extra: it reads the chosen rows' log-probs
            nll = token_mean_nll(logps[:B], lengths[:B])
            loss = loss + args.cpo_alpha * nll
        else:
            nll = logps.new_zeros(())

        chosen_rewards, rejected_rewards = (args.beta * rewards[:B]).detach(), (args.beta * rewards[B:]).detach()
        self.record_pairs(chosen_rewards, rejected_rewards, scored, mean_logits, mode)
        self.record({"nll_loss": nll.detach()}, mode)
        if return_outputs:
            return loss, {"rewards_chosen": chosen_rewards, "rewards_rejected": rejected_rewards}
        return loss
