"""Kahneman-Tversky Optimization (Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect
Theoretic Optimization").

KTO trains on unpaired feedback. With ρ = log π(y|x) - log π_ref(y|x) and a reference point
z = max(0, KL(π || π_ref)), desirable rows minimise λ_D (1 - σ(β(ρ - z))) and undesirable rows
λ_U (1 - σ(β(z - ρ))) (`core.preference_losses.kto_loss`). z is estimated as in the paper from
mismatched pairs in the batch: completion i is scored after prompt i+1 by the policy and the
reference, z = max(0, mean(logp - ref_logp)), averaged over all processes and detached.

`loss_type="apo_zero_unpaired"` swaps in APO-zero on unpaired rows (D'Oosterlinck et al. 2024),
which needs no reference point, so no mismatched rows are built. Both are registered in
`core.preference_losses.UNPAIRED_LOSSES`.

Shares BCO's data path (unpaired rows; pairs are split into a desirable and an undesirable
row) and reference handling, including TR-DPO's reference sync and precomputed reference
log-probs. Departures: the policy's forward on the mismatched pairs runs without gradients
(z is a constant in the loss anyway), and the reference scores the matched and the mismatched
rows in one forward pass. With `precompute_ref_log_probs` the mismatched pairs are fixed once
(row i's prompt with row i+1's completion, in dataset order) so their reference log-probs can be
stored; otherwise they are formed within each batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.core.preference_losses import UNPAIRED_LOSSES
from posttrain.forward.completions import completion_logps
from posttrain.trainers.base import classic_arguments
from posttrain.trainers.preference_base import PreferenceConfig, PreferenceTrainer


@dataclass
class KTOConfig(PreferenceConfig):
    """Configuration of `KTOTrainer`, on top of `transformers.TrainingArguments`."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (AdamW)."})
    beta: float = field(default=0.1, metadata={"help": "β scaling the implicit reward log π/π_ref."})
    loss_type: str = field(default="kto", metadata={
        "help": "'kto': KTO's loss against the KL reference point; 'apo_zero_unpaired': APO-zero on unpaired "
                "rows (desirable up, undesirable down, no reference point).",
        "choices": list(UNPAIRED_LOSSES)})
    desirable_weight: float = field(default=1.0, metadata={
        "help": "λ_D, weight of desirable rows; with unbalanced data keep λ_D·n_D / (λ_U·n_U) in [1, 4/3]."})
    undesirable_weight: float = field(default=1.0, metadata={"help": "λ_U, weight of undesirable rows."})

    def _check(self):
        super()._check()
        if self.loss_type not in UNPAIRED_LOSSES:
            raise ValueError(f"loss_type must be one of {sorted(UNPAIRED_LOSSES)}, got {self.loss_type!r}")
        if self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ValueError("desirable_weight and undesirable_weight must be >= 0")
        if UNPAIRED_LOSSES[self.loss_type].uses_kl and not self.precompute_ref_log_probs \
                and self.per_device_train_batch_size < 2:
            raise ValueError("KTO estimates its KL reference point from mismatched pairs within a batch, which "
                             "needs per_device_train_batch_size >= 2 (or precompute_ref_log_probs=True, which "
                             "fixes the pairs in the dataset)")


class KTOTrainer(PreferenceTrainer):
    """Unpaired (or paired, split) feedback -> a policy, by KTO's prospect-theoretic loss."""

    _tag = "kto"
    _name = "KTO"
    _citation = """@article{ethayarajh2024kto,
    title   = {{KTO: Model Alignment as Prospect Theoretic Optimization}},
    author  = {Kawin Ethayarajh and Winnie Xu and Niklas Muennighoff and Dan Jurafsky and Douwe Kiela},
    journal = {arXiv preprint arXiv:2402.01306},
    year    = 2024
}"""
    paired = False

    def __init__(self, model, ref_model=None, args: KTOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, data_collator=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, compute_metrics=None, **kwargs):
        # kwargs: TRL's older conventions (tokenizer=, KTOConfig fields such as beta=), see classic_arguments
        args, processing_class = classic_arguments("KTOTrainer", KTOConfig, args, processing_class, kwargs)
        self.loss = UNPAIRED_LOSSES[args.loss_type]
        self.kl_pairs = self.loss.uses_kl  # the collator appends the mismatched rows only when z is needed
        self.reference_columns = ("ref_logps", "ref_kl_logps") if self.kl_pairs else ("ref_logps",)
        super().__init__(model, ref_model, args, data_collator=data_collator,
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                         peft_config=peft_config, callbacks=callbacks, optimizers=optimizers,
                         compute_metrics=compute_metrics)

    def add_reference_columns(self, dataset):
        if self.kl_pairs:  # fix the mismatched pairs, so their reference log-probs can be stored
            column = "completion" if self.vision else "completion_ids"  # a vision row keeps its messages
            completions = dataset[column]
            dataset = dataset.add_column(f"kl_{column}", completions[1:] + completions[:1])
        return super().add_reference_columns(dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, mode = self.args, self.mode()
        ids, mask, cmask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"], inputs["label"]
        B = labels.shape[0]  # rows [0, B): the data; with kl_pairs rows [B, 2B): the mismatched pairs
        # the reference first: its temporaries go before the policy's
        vision = inputs.get("model_inputs")  # a VLM's images: its rows are scored together, in one forward
        ref = inputs["ref_logps"] if "ref_logps" in inputs else self.reference_logps(ids, mask, cmask, *([vision] if vision else []))
        every = completion_logps(model, ids, mask, cmask, model_inputs=vision)[0] if vision else None
        kl = None
        if self.kl_pairs:
            ref_kl_logps = inputs["ref_kl_logps"] if "ref_kl_logps" in inputs else ref[B:]
            with torch.no_grad():
                kl_logps = every[B:].detach() if vision else completion_logps(model, ids[B:], mask[B:], cmask[B:])[0]
            kl = self.accelerator.gather((kl_logps - ref_kl_logps).mean().reshape(1)).mean().clamp(min=0)
        logps = every[:B] if vision else completion_logps(model, ids[:B], mask[:B], cmask[:B])[0]
        losses, rewards = self.loss.fn(logps, ref[:B], labels, kl, beta=args.beta,
                                       desirable_weight=args.desirable_weight,
                                       undesirable_weight=args.undesirable_weight)
        loss = losses.mean()
        if kl is not None:
            self.record({"kl": kl}, mode)
        self.record_unpaired(rewards, logps.detach(), labels, mode)
        self.count_tokens(mask[:B], mode)
        return (loss, {"rewards": rewards}) if return_outputs else loss
