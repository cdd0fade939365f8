"""Direct Preference Optimization and its pairwise relatives.

DPO (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a
Reward Model") fits a policy to preference pairs without a reward model: with
ρ = log π(y|x) - log π_ref(y|x), the loss is -log σ(β (ρ_chosen - ρ_rejected)). The variants
(hinge, IPO, robust, BCO-pair, SPPO-hard, NCA, APO, SimPO) are pure functions in
`core/preference_losses.py`; this file only prepares batches and calls `dpo_loss`.

Where this implementation departs from the papers / common practice:
* chosen and rejected go through the model in one forward pass ([chosen; rejected] stacked
  along the batch), and the model computes logits for the completion columns only;
* log-probs are sums over completion tokens for every loss (IPO included); SimPO divides by
  the completion length itself;
* the running reward mean δ of `bco_pair` is folded in once per optimizer step, so results do
  not depend on how a step is split into micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.core.preference_losses import DPO_LOSSES, PreferenceInput, dpo_loss, dpo_rewards
from posttrain.models import loading
from posttrain.trainers.base import BaseConfig, SyncRefModelCallback
from posttrain.trainers.preference_base import (PreferenceCollator, PreferenceTrainer, check_beta_and_lengths,
                                                  completion_logps)

SMOOTHABLE = ("sigmoid", "robust", "simpo")  # losses with a label-smoothed form
REFERENCE_FREE = ("simpo",)


@dataclass
class DPOConfig(BaseConfig):
    """Configuration of `DPOTrainer`, on top of `transformers.TrainingArguments`."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (AdamW)."})
    beta: float = field(default=0.1, metadata={
        "help": "Inverse temperature β: how far the policy may move from the reference (higher: closer). "
                "For IPO it plays the paper's τ; for SimPO it scales the length-normalised log-probs."})
    max_length: int | None = field(default=1024, metadata={
        "help": "Maximum tokens of prompt + completion. Pairs whose prompt alone reaches it are dropped; "
                "longer completions are cut (a warning says how many)."})
    max_prompt_length: int | None = field(default=None, metadata={
        "help": "Keep only the last this many prompt tokens (None: no prompt limit besides max_length)."})
    max_completion_length: int | None = field(default=None, metadata={
        "help": "Cut completions to this many tokens (None: only max_length limits them)."})
    loss_type: str | list[str] = field(default="sigmoid", metadata={
        "help": f"DPO loss, or a list of losses summed with `loss_weights`; one of {sorted(DPO_LOSSES)}. "
                "'simpo' alone is reference-free (no reference model is loaded)."})
    loss_weights: list[float] | None = field(default=None, metadata={
        "help": "Weights of the losses in `loss_type` (a list of the same length); default all 1."})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "Probability ε that a preference label is flipped (conservative DPO for 'sigmoid', the noise "
                "rate for 'robust'); only sigmoid, robust and simpo accept it."})
    simpo_gamma: float | None = field(default=None, metadata={
        "help": "SimPO's target margin γ; None: γ = 0.5 β (the paper's γ/β = 0.5)."})
    rpo_alpha: float | None = field(default=None, metadata={
        "help": "RPO (Pang et al., 2024): add rpo_alpha x the chosen completions' mean per-token negative "
                "log-likelihood to the loss, so the chosen log-probs do not drift down with the rejected ones "
                "(None: off)."})
    precompute_ref_log_probs: bool = field(default=False, metadata={
        "help": "Score the train (and eval) data with the reference once before training, store the "
                "log-probs as dataset columns and free the reference model."})
    sync_ref_model: bool = field(default=False, metadata={
        "help": "TR-DPO: every `ref_model_sync_steps` steps set ref <- α·policy + (1-α)·ref."})
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "α of the reference sync (TR-DPO)."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "Optimizer steps between reference syncs."})
    disable_dropout: bool = field(default=True, metadata={
        "help": "Set every dropout probability of the model to 0, so policy and reference log-probs are comparable."})

    def _check(self):
        types = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        if not types:
            raise ValueError("loss_type is empty; give a loss name or a list of loss names")
        unknown = [t for t in types if t not in DPO_LOSSES]
        if unknown:
            raise ValueError(f"unknown loss_type {unknown}; choose from {sorted(DPO_LOSSES)}")
        if self.loss_weights is not None and len(self.loss_weights) != len(types):
            raise ValueError(f"loss_weights has {len(self.loss_weights)} entries but loss_type has {len(types)} "
                             f"({types}); give one weight per loss type")
        check_beta_and_lengths(self)
        if self.rpo_alpha is not None and self.rpo_alpha < 0:
            raise ValueError(f"rpo_alpha must be >= 0 (or None to turn the NLL term off), got {self.rpo_alpha}")
        if self.label_smoothing and any(t not in SMOOTHABLE for t in types):
            raise ValueError(f"label_smoothing={self.label_smoothing} applies only to {SMOOTHABLE}; "
                             f"set it to 0 for loss_type {types}")
        if "robust" in types and not 0 <= self.label_smoothing < 0.5:
            raise ValueError("loss_type 'robust' needs 0 <= label_smoothing < 0.5 (the label-noise rate)")
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError("sync_ref_model updates the reference during training, so its log-probs cannot be "
                             "precomputed; set precompute_ref_log_probs=False or sync_ref_model=False")
        if all(t in REFERENCE_FREE for t in types) and (self.sync_ref_model or self.precompute_ref_log_probs):
            raise ValueError(f"loss_type {types} uses no reference model; unset sync_ref_model and "
                             "precompute_ref_log_probs")
        if not 0 <= self.ref_model_mixup_alpha <= 1 or self.ref_model_sync_steps < 1:
            raise ValueError("ref_model_mixup_alpha must be in [0, 1] and ref_model_sync_steps >= 1")

    @property
    def loss_types(self) -> list[str]:
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)


class DPOTrainer(PreferenceTrainer):
    """Preference pairs -> a policy that prefers the chosen completions (DPO and pairwise variants)."""

    _tag = "dpo"
    paired = True

    def __init__(self, model, ref_model=None, args: DPOConfig | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, peft_config=None,
                 callbacks=None, optimizers=(None, None)):
        args = args or DPOConfig()
        types = args.loss_types
        self.reference_free = all(t in REFERENCE_FREE for t in types)
        if self.reference_free and ref_model is not None:
            raise ValueError(f"loss_type {types} is reference-free; do not pass a ref_model")
        if args.sync_ref_model and ref_model is None and (peft_config is not None or loading.is_peft_model(model)):
            raise ValueError("sync_ref_model needs a separate reference model, but with a PEFT model the "
                             "reference is the adapter-disabled policy; pass ref_model= or unset sync_ref_model")
        self.uses_reward_mean = "bco_pair" in types
        super().__init__(model, ref_model, args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers, needs_reference=not self.reference_free)
        if args.sync_ref_model:
            self.add_callback(SyncRefModelCallback(self.ref_model, args.ref_model_mixup_alpha, args.ref_model_sync_steps))
        self.ref_precomputed = False
        if args.precompute_ref_log_probs:
            self.train_dataset = self.add_reference_columns(self.train_dataset)
            if isinstance(self.eval_dataset, dict):
                self.eval_dataset = {k: self.add_reference_columns(v) for k, v in self.eval_dataset.items()}
            elif self.eval_dataset is not None:
                self.eval_dataset = self.add_reference_columns(self.eval_dataset)
            self.ref_model, self.ref_precomputed = None, True  # the reference is no longer needed: free it

    @torch.no_grad()
    def add_reference_columns(self, dataset):
        """The dataset plus `ref_chosen_logps` / `ref_rejected_logps`, scored once by the reference."""
        collate = PreferenceCollator(self.processing_class.pad_token_id, paired=True)
        chosen, rejected = [], []
        size = self.args.per_device_eval_batch_size
        for start in range(0, len(dataset), size):
            batch = collate([dataset[i] for i in range(start, min(start + size, len(dataset)))])
            batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
            logps = self.reference_logps(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
            half = logps.shape[0] // 2
            chosen += logps[:half].tolist()
            rejected += logps[half:].tolist()
        return dataset.add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps", rejected)

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
            ref = self.reference_logps(ids, mask, cmask)
            ref_chosen, ref_rejected = ref[:B], ref[B:]
        logps, lengths, mean_logits = completion_logps(model, ids, mask, cmask, paired=True)
        inp = PreferenceInput(logps[:B], logps[B:], ref_chosen, ref_rejected, lengths[:B], lengths[B:])

        options = {}
        if self.uses_reward_mean:
            options["delta"] = self.reward_mean.mean
        if "simpo" in args.loss_types and args.simpo_gamma is not None:
            options["simpo_gamma"] = args.simpo_gamma
        losses = dpo_loss(inp, args.loss_types, args.beta, args.label_smoothing, args.loss_weights, **options)
        loss = losses.mean()
        if args.rpo_alpha is not None:  # RPO: NLL of the chosen completions, per token
            nll = (-logps[:B] / lengths[:B].clamp(min=1)).mean()
            loss = loss + args.rpo_alpha * nll
            self.record({"nll_loss": nll.detach()}, mode)

        if self.reference_free:  # SimPO's implicit reward: β × mean token log-prob
            chosen_rewards = (args.beta * logps[:B] / lengths[:B].clamp(min=1)).detach()
            rejected_rewards = (args.beta * logps[B:] / lengths[B:].clamp(min=1)).detach()
        else:
            chosen_rewards, rejected_rewards = dpo_rewards(inp, args.beta)
        if self.uses_reward_mean:
            self.add_pending_rewards(torch.cat([chosen_rewards, rejected_rewards]))
        self.record({
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": logps[:B].detach().mean(),
            "logps/rejected": logps[B:].detach().mean(),
            "logits/chosen": mean_logits[:B].mean(),
            "logits/rejected": mean_logits[B:].mean(),
        }, mode)
        self.count_tokens(mask, mode)
        if return_outputs:
            return loss, {"chosen_rewards": chosen_rewards, "rejected_rewards": rejected_rewards}
        return loss
