"""Direct Preference Optimization and its pairwise relatives.

DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model") fits a policy to preference pairs without a reward model: with
ρ = log π(y|x) - log π_ref(y|x), the loss is -log σ(β (ρ_chosen - ρ_rejected)). The variants
(hinge, IPO, robust, EXO, DiscoPOP, AOT, BCO-pair, SPPO-hard, NCA, APO, length-normalised
sigmoid, SimPO, SFT) and the f-divergence margins are pure functions registered in
`core/preference_losses.py`; this file only prepares batches and calls `dpo_loss`. LD-DPO
(`ld_alpha`) reweights the policy's token log-probs and WPO (`use_weighting`) the pairs' losses,
both from `core/preference_losses.py` too.

Where this implementation departs from the papers / common practice:
* chosen and rejected go through the model in one forward pass ([chosen; rejected] stacked
  along the batch), and the model computes logits for the completion columns only;
* log-probs are sums over completion tokens for every loss (IPO included); SimPO,
  sigmoid_norm and sft divide by the completion length themselves, and sft's NLL is a mean over
  pairs of per-token means (not one mean over all tokens of the batch);
* AOT sorts the margins of each micro-batch on each process, so its loss depends on the
  micro-batch split (as in TRL);
* LD-DPO reweights the policy's log-probs only (the reference's stay plain sums, as in TRL);
  WPO's pair weight is capped at 1;
* `f_divergence_type` other than reverse KL is refused for losses that do not read the pair's
  margin (TRL ignores it there);
* the running reward mean δ of `bco_pair` is folded in once per optimizer step, so results do
  not depend on how a step is split into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.core.preference_losses import (DPO_LOSSES, F_DIVERGENCES, PreferenceInput, check_label_smoothing,
                                               dpo_loss, dpo_rewards, ld_token_weights, wpo_weights)
from posttrain.forward.completions import completion_logps, completion_token_logps
from posttrain.trainers.base import classic_arguments
from posttrain.trainers.preference_base import PreferenceConfig, PreferenceTrainer


@dataclass
class DPOConfig(PreferenceConfig):
    """Configuration of `DPOTrainer`, on top of `transformers.TrainingArguments`."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (AdamW)."})
    beta: float = field(default=0.1, metadata={
        "help": "Inverse temperature β: how far the policy may move from the reference (higher: closer). "
                "For IPO it plays the paper's τ; for SimPO it scales the length-normalised log-probs."})
    loss_type: str | list[str] = field(default="sigmoid", metadata={
        "help": f"DPO loss, or a list of losses summed with `loss_weights`; one of {sorted(DPO_LOSSES)} "
                "(see core/preference_losses.py). "
                f"{sorted(n for n, s in DPO_LOSSES.items() if s.reference_free)} are reference-free: alone or "
                "together they load no reference model."})
    loss_weights: list[float] | None = field(default=None, metadata={
        "help": "Weights of the losses in `loss_type` (a list of the same length); default all 1."})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "Probability ε in [0, 0.5] that a preference label is flipped (conservative DPO for 'sigmoid', "
                "the noise rate for 'robust', which needs ε < 0.5); only "
                f"{sorted(n for n, s in DPO_LOSSES.items() if s.max_label_smoothing is not None)} accept it."})
    f_divergence_type: str = field(default="reverse_kl", metadata={
        "help": "f-DPO (Wang et al. 2023): the divergence from the reference that the margin losses (sigmoid, "
                "hinge, ipo, robust, exo_pair, discopop) regularise with; the margin becomes "
                "f'(π/π_ref)(chosen) - f'(π/π_ref)(rejected).",
        "choices": list(F_DIVERGENCES)})
    f_alpha_divergence_coef: float = field(default=1.0, metadata={
        "help": "α > 0 of f_divergence_type='alpha_divergence' (f'(u) = (1 - u^-α)/α; α = 1 is the forward KL, "
                "α -> 0 the reverse KL)."})
    discopop_tau: float = field(default=0.05, metadata={
        "help": "τ of loss_type 'discopop': how sharply σ(βh/τ) switches from the logistic to the exponential "
                "loss."})
    simpo_gamma: float | None = field(default=None, metadata={
        "help": "SimPO's target margin γ; None: γ = 0.5 β (the paper's γ/β = 0.5)."})
    rpo_alpha: float | None = field(default=None, metadata={
        "help": "RPO (Pang et al., 2024): add rpo_alpha x the chosen completions' mean per-token negative "
                "log-likelihood to the loss, so the chosen log-probs do not drift down with the rejected ones "
                "(None: off)."})
    ld_alpha: float | None = field(default=None, metadata={
        "help": "LD-DPO (Liu et al., 2024), in [0, 1]: in the policy's log-prob of each completion, weight the "
                "tokens beyond the shorter completion of its pair by ld_alpha, so the loss is less driven by "
                "length (None: off; the reference's log-probs are not reweighted). Builds the completion "
                "logits whole."})
    use_weighting: bool = field(default=False, metadata={
        "help": "WPO (Zhou et al., 2024): weight each pair's loss by min(1, exp(w_chosen + w_rejected)), w the "
                "completion's per-token mean of log π(y_t) - log Σ_v π(v)^2 under the current policy (detached), "
                "so pairs the policy would itself sample count more. Builds the completion logits whole."})

    def _check(self):
        super()._check()
        types = self.loss_types
        if not types:
            raise ValueError("loss_type is empty; give a loss name or a list of loss names")
        unknown = [t for t in types if t not in DPO_LOSSES]
        if unknown:
            hint = "; older TRL's 'aot_pair' is 'aot_unpaired'" if "aot_pair" in unknown else ""
            raise ValueError(f"unknown loss_type {unknown}; choose from {sorted(DPO_LOSSES)}{hint}")
        if self.loss_weights is not None and len(self.loss_weights) != len(types):
            raise ValueError(f"loss_weights has {len(self.loss_weights)} entries but loss_type has {len(types)} "
                             f"({types}); give one weight per loss type")
        if self.rpo_alpha is not None and self.rpo_alpha < 0:
            raise ValueError(f"rpo_alpha must be >= 0 (or None to turn the NLL term off), got {self.rpo_alpha}")
        check_label_smoothing(types, self.label_smoothing)
        if self.f_divergence_type not in F_DIVERGENCES:
            raise ValueError(f"f_divergence_type must be one of {sorted(F_DIVERGENCES)}, "
                             f"got {self.f_divergence_type!r}")
        if self.f_divergence_type != "reverse_kl" and not any("f_divergence" in DPO_LOSSES[t].options for t in types):
            raise ValueError(f"f_divergence_type={self.f_divergence_type!r} changes the margin of "
                             f"{sorted(n for n, s in DPO_LOSSES.items() if 'f_divergence' in s.options)}; "
                             f"loss_type {types} has none of them")
        if self.f_alpha_divergence_coef <= 0:
            raise ValueError(f"f_alpha_divergence_coef must be > 0, got {self.f_alpha_divergence_coef}")
        if self.discopop_tau <= 0:
            raise ValueError(f"discopop_tau must be > 0, got {self.discopop_tau}")
        if self.use_weighting and any(DPO_LOSSES[t].per_quantile for t in types):
            raise ValueError(f"use_weighting weights each pair's loss, but loss_type {types} has losses of sorted "
                             "batch quantiles (aot, aot_unpaired), which belong to no pair; unset use_weighting")
        if self.ld_alpha is not None and not 0 <= self.ld_alpha <= 1:
            raise ValueError(f"ld_alpha must be in [0, 1] (or None for plain log-probs), got {self.ld_alpha}")
        if all(DPO_LOSSES[t].reference_free for t in types) and (self.sync_ref_model or self.precompute_ref_log_probs):
            raise ValueError(f"loss_type {types} uses no reference model; unset sync_ref_model and "
                             "precompute_ref_log_probs")

    @property
    def loss_types(self) -> list[str]:
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)


class DPOTrainer(PreferenceTrainer):
    """Preference pairs -> a policy that prefers the chosen completions (DPO and pairwise variants)."""

    _tag = "dpo"
    _name = "DPO"
    _citation = """@inproceedings{rafailov2023direct,
    title     = {{Direct Preference Optimization: Your Language Model is Secretly a Reward Model}},
    author    = {Rafael Rafailov and Archit Sharma and Eric Mitchell and Christopher D. Manning and Stefano Ermon
                 and Chelsea Finn},
    booktitle = {Advances in Neural Information Processing Systems 36 (NeurIPS 2023)},
    year      = 2023,
    eprint    = {arXiv:2305.18290}
}"""
    paired = True

    def __init__(self, model, ref_model=None, args: DPOConfig | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, peft_config=None,
                 callbacks=None, optimizers=(None, None), compute_metrics=None, **kwargs):
        # kwargs: TRL's older conventions (tokenizer=, DPOConfig fields such as beta=), see classic_arguments
        args, processing_class = classic_arguments("DPOTrainer", DPOConfig, args, processing_class, kwargs)
        types = args.loss_types
        self.reference_free = all(DPO_LOSSES[t].reference_free for t in types)
        if self.reference_free and ref_model is not None:
            raise ValueError(f"loss_type {types} is reference-free; do not pass a ref_model")
        self.uses_reward_mean = "bco_pair" in types
        super().__init__(model, ref_model, args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers, needs_reference=not self.reference_free,
                         compute_metrics=compute_metrics)

    def policy_logps(self, model, ids, mask, cmask, model_inputs=None):
        """The policy's completion log-probs for the loss (2B,: LD-DPO-weighted with ld_alpha), the plain
        sums (2B,: for the NLL and the logs), lengths (2B,), mean logits (2B,) and the WPO pair weights
        (B,) or None. With ld_alpha or use_weighting the per-token path is taken."""
        args = self.args
        if args.ld_alpha is None and not args.use_weighting:
            logps, lengths, mean_logits = completion_logps(model, ids, mask, cmask, paired=True,
                                                           model_inputs=model_inputs)
            return logps, logps, lengths, mean_logits, None
        token_logps, scored, logits = completion_token_logps(model, ids, mask, cmask, model_inputs)
        plain = (token_logps * scored).sum(-1)
        logps = plain if args.ld_alpha is None else (token_logps * ld_token_weights(scored, args.ld_alpha)).sum(-1)
        lengths = scored.sum(-1)
        with torch.no_grad():
            mean_logits = (logits.float().mean(-1) * scored).sum(-1) / lengths.clamp(min=1)
        pair_weights = wpo_weights(token_logps, logits, scored) if args.use_weighting else None
        return logps, plain, lengths, mean_logits, pair_weights

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, mode = self.args, self.mode()
        ids, mask, cmask = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
        B = ids.shape[0] // 2
        # the reference first: its temporaries are freed before the policy's activations exist
        if self.reference_free:
            ref_chosen = ref_rejected = None
        elif "ref_chosen_logps" in inputs:
            ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            extra = inputs.get("model_inputs")  # passed only with images: subclasses may keep the text-only signature
            ref = self.reference_logps(ids, mask, cmask, *([extra] if extra else []))
            ref_chosen, ref_rejected = ref[:B], ref[B:]
        logps, plain, lengths, mean_logits, pair_weights = self.policy_logps(model, ids, mask, cmask,
                                                                            inputs.get("model_inputs"))
        inp = PreferenceInput(logps[:B], logps[B:], ref_chosen, ref_rejected, lengths[:B], lengths[B:])

        options = {}
        if self.uses_reward_mean:
            options["delta"] = self.reward_mean.mean
        if "simpo" in args.loss_types and args.simpo_gamma is not None:
            options["simpo_gamma"] = args.simpo_gamma
        if "discopop" in args.loss_types:
            options["discopop_tau"] = args.discopop_tau
        if args.f_divergence_type != "reverse_kl":
            options.update(f_divergence=args.f_divergence_type, f_alpha=args.f_alpha_divergence_coef)
        losses = dpo_loss(inp, args.loss_types, args.beta, args.label_smoothing, args.loss_weights, **options)
        if pair_weights is not None:
            losses = losses * pair_weights
        loss = losses.mean()
        if args.rpo_alpha is not None:  # RPO: NLL of the chosen completions, per token
            nll = (-plain[:B] / lengths[:B].clamp(min=1)).mean()
            loss = loss + args.rpo_alpha * nll
            self.record({"nll_loss": nll.detach()}, mode)

        if self.reference_free:  # SimPO's implicit reward: β × mean token log-prob
            chosen_rewards = (args.beta * logps[:B] / lengths[:B].clamp(min=1)).detach()
            rejected_rewards = (args.beta * logps[B:] / lengths[B:].clamp(min=1)).detach()
        else:
            chosen_rewards, rejected_rewards = dpo_rewards(inp, args.beta)
        if self.uses_reward_mean:
            self.add_pending_rewards(torch.cat([chosen_rewards, rejected_rewards]))
        self.record_pairs(chosen_rewards, rejected_rewards, plain, mean_logits, mode)
        self.count_tokens(mask, mode)
        if return_outputs:
            return loss, {"rewards_chosen": chosen_rewards, "rewards_rejected": rejected_rewards}
        return loss
