"""Kahneman-Tversky Optimization (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect
Theoretic Optimization").

KTO trains on unpaired feedback. With ρ = log π(y|x) - log π_ref(y|x) and a reference point
z = max(0, KL(π || π_ref)), desirable rows minimise λ_D (1 - σ(β(ρ - z))) and undesirable rows
λ_U (1 - σ(β(z - ρ))) (`core.preference_losses.kto_loss`). z is estimated as in the paper from
mismatched pairs in the batch: completion i is scored after prompt i+1 by the policy and the
reference, z = max(0, mean(logp - ref_logp)), averaged over all processes and detached.

Shares BCO's data path (unpaired rows; pairs are split into a desirable and an undesirable
row) and reference handling. Departures: the policy's forward on the mismatched pairs runs
without gradients (z is a constant in the loss anyway), and the reference scores the matched
and the mismatched rows in one forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.core.preference_losses import kto_loss
from posttrain.trainers.base import BaseConfig
from posttrain.trainers.preference_base import PreferenceTrainer, check_beta_and_lengths, completion_logps


@dataclass
class KTOConfig(BaseConfig):
    """Configuration of `KTOTrainer`, on top of `transformers.TrainingArguments`."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (AdamW)."})
    beta: float = field(default=0.1, metadata={"help": "β scaling the implicit reward log π/π_ref."})
    desirable_weight: float = field(default=1.0, metadata={
        "help": "λ_D, weight of desirable rows; with unbalanced data keep λ_D·n_D / (λ_U·n_U) in [1, 4/3]."})
    undesirable_weight: float = field(default=1.0, metadata={"help": "λ_U, weight of undesirable rows."})
    max_length: int | None = field(default=1024, metadata={
        "help": "Maximum tokens of prompt + completion. Rows whose prompt alone reaches it are dropped; "
                "longer completions are cut (a warning says how many)."})
    max_prompt_length: int | None = field(default=None, metadata={
        "help": "Keep only the last this many prompt tokens (None: no prompt limit besides max_length)."})
    max_completion_length: int | None = field(default=None, metadata={
        "help": "Cut completions to this many tokens (None: only max_length limits them)."})
    disable_dropout: bool = field(default=True, metadata={
        "help": "Set every dropout probability of the model to 0, so policy and reference log-probs are comparable."})

    def _check(self):
        check_beta_and_lengths(self)
        if self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ValueError("desirable_weight and undesirable_weight must be >= 0")
        if self.per_device_train_batch_size < 2:
            raise ValueError("KTO estimates its KL reference point from mismatched pairs within a batch, which "
                             "needs per_device_train_batch_size >= 2")


class KTOTrainer(PreferenceTrainer):
    """Unpaired (or paired, split) feedback -> a policy, by KTO's prospect-theoretic loss."""

    _tag = "kto"
    paired = False
    kl_pairs = True

    def __init__(self, model, ref_model=None, args: KTOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, data_collator=None, callbacks=None,
                 optimizers=(None, None), peft_config=None):
        super().__init__(model, ref_model, args or KTOConfig(), data_collator=data_collator,
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                         peft_config=peft_config, callbacks=callbacks, optimizers=optimizers)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, mode = self.args, self.mode()
        ids, mask, cmask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"], inputs["label"]
        B = labels.shape[0]  # rows [0, B): the data; rows [B, 2B): completion i after prompt i+1
        ref = self.reference_logps(ids, mask, cmask)  # first: its temporaries go before the policy's
        ref_logps, ref_kl_logps = ref[:B], ref[B:]
        with torch.no_grad():
            kl_logps = completion_logps(model, ids[B:], mask[B:], cmask[B:])[0]
        logps = completion_logps(model, ids[:B], mask[:B], cmask[:B])[0]
        kl = self.accelerator.gather((kl_logps - ref_kl_logps).mean().reshape(1)).mean().clamp(min=0)
        losses, rewards = kto_loss(logps, ref_logps, labels, kl, beta=args.beta,
                                   desirable_weight=args.desirable_weight, undesirable_weight=args.undesirable_weight)
        loss = losses.mean()
        self.record({"kl": kl}, mode)
        self.record_unpaired(rewards, logps.detach(), labels, mode)
        self.count_tokens(mask[:B], mode)
        return (loss, {"rewards": rewards}) if return_outputs else loss
