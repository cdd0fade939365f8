"""Triple Preference Optimization (Saeidi et al. 2024, "Triple Preference Optimization: Achieving Better
Alignment using a Single Step Optimization").

TPO learns from triples: a prompt's gold `reference` completion, a `chosen` and a `rejected` one. In one
step it fits the gold answer (its NLL per token, weight `tpo_alpha`) and prefers chosen over rejected by a
reference-free pair loss of the policy's own log-probs (no reference model: the "reference" is the gold
answer, not a reference policy). `loss_type` picks the pair loss from
`core.contrastive_losses.MARGIN_LOSSES`: sigmoid and hinge on summed log-probs, ipo and tpo-l (TPO-L:
target margin `tpo_l_gamma`) on per-token means.

Departures: the gold completions go through the model in a forward of their own (the pair in one
forward that shares each prompt, `preference_base.completion_logps`), skipped with tpo_alpha = 0; the
per-token entropy and mean token accuracy TRL logs are not computed (they need the whole vocabulary's
logits, which the completion log-probs never build).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.core.contrastive_losses import MARGIN_LOSSES, check_margin_options, margin_loss, token_mean_nll
from posttrain.forward.completions import completion_logps
from posttrain.trainers.preference_base import TRUNCATION_MODES, PairDataConfig, ReferenceFreePairTrainer

TPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "tpo-l")


@dataclass
class TPOConfig(PairDataConfig):
    """Configuration of `TPOTrainer`, on top of `transformers.TrainingArguments`."""

    learning_rate: float = field(default=5e-7, metadata={"help": "Peak learning rate (AdamW)."})
    truncation_mode: str = field(default="keep_start", metadata={
        "help": "What survives when prompt + completion exceed max_length: 'keep_start' keeps the whole prompt and "
                "cuts the completions' ends, 'keep_end' cuts the prompt's start first (see PairDataConfig).",
        "choices": list(TRUNCATION_MODES)})
    loss_type: str = field(default="sigmoid", metadata={
        "help": "Pair loss of chosen over rejected: 'sigmoid' (TPO), 'hinge' (SLiC), 'ipo', 'tpo-l' (length-"
                "normalised, target margin tpo_l_gamma). See core/contrastive_losses.py.",
        "choices": list(TPO_LOSS_TYPES)})
    beta: float = field(default=0.01, metadata={
        "help": "Inverse temperature β of the pair loss; for 'ipo' the paper's regularisation τ."})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "Probability ε in [0, 0.5] that a preference label is flipped; only 'sigmoid' and 'tpo-l' have "
                "a smoothed form."})
    tpo_alpha: float = field(default=1.0, metadata={
        "help": "Weight of the gold (`reference`) completions' NLL per token; 0 turns the term and its forward off."})
    tpo_l_gamma: float = field(default=0.5, metadata={
        "help": "TPO-L's target reward margin γ, used only with loss_type='tpo-l'."})

    def _check(self):
        super()._check()
        check_margin_options(self.loss_type, TPO_LOSS_TYPES, self.label_smoothing, list(TPO_LOSS_TYPES),
                             "'sigmoid' or 'tpo-l'", "tpo_alpha", self.tpo_alpha)


class TPOTrainer(ReferenceFreePairTrainer):
    """(prompt, reference, chosen, rejected) triples -> a policy: NLL on the gold answer plus a pair loss."""

    _tag = "tpo"
    _name = "TPO"
    _citation = """@article{saeidi2024triple,
    title   = {{Triple Preference Optimization: Achieving Better Alignment using a Single Step Optimization}},
    author  = {Amir Saeidi and Shivanshu Verma and Aswin RRV and Kashif Rasul and Chitta Baral},
    journal = {arXiv preprint arXiv:2405.16681},
    year    = 2024
}"""
    config_class = TPOConfig
    extra_completions = ("reference",)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, mode = self.args, self.mode()
        spec = MARGIN_LOSSES[args.loss_type]
        logps, lengths, mean_logits = self.pair_logps(model, inputs)  # (2B,) each
        B = logps.shape[0] // 2
        scored = logps / lengths.clamp(min=1) if spec.length_normalised else logps
        losses = margin_loss(args.loss_type, scored[:B] - scored[B:], beta=args.beta,
                             label_smoothing=args.label_smoothing, gamma=args.tpo_l_gamma)
        loss = losses.mean()
        if args.tpo_alpha:
            gold_logps, gold_lengths, _ = completion_logps(model, inputs["reference_input_ids"],
                                                           inputs["reference_attention_mask"],
                                                           inputs["reference_completion_mask"])
            nll = token_mean_nll(gold_logps, gold_lengths)
            loss = loss + args.tpo_alpha * nll
            self.record({"nll_loss": nll.detach()}, mode)

        chosen_rewards, rejected_rewards = (args.beta * scored[:B]).detach(), (args.beta * scored[B:]).detach()
        self.record_pairs(chosen_rewards, rejected_rewards, scored, mean_logits, mode)
        if return_outputs:
            return loss, {"rewards_chosen": chosen_rewards, "rewards_rejected": rejected_rewards}
        return loss
