"""Binary Classifier Optimization (Jung et al. 2024, "Binary Classifier Optimization for Large
Language Model Alignment").

BCO trains on unpaired feedback (a completion and a thumbs-up or thumbs-down) by treating the
implicit reward r = β (log π(y|x) - log π_ref(y|x)) as the logit of a binary classifier:
desirable rows minimise -log σ(r - δ), undesirable ones -log σ(-(r - δ)), where the reward
shift δ is the running mean of all rewards seen so far (`core.preference_losses.bco_loss`).
Optionally, underlying-distribution matching (UDM, section 3.3) weighs each undesirable row by
the density ratio p_desirable(x) / p_undesirable(x) of its prompt, estimated by a logistic
regression on frozen prompt embeddings (`models/embedding.py`).

Departures: δ is folded in once per optimizer step (every micro-batch of a step sees the same
δ, so gradient accumulation does not change the result) and saved next to the weights of every
checkpoint (`save_model`) and read back by `train(resume_from_checkpoint=...)`. The density
ratios are computed once, before training, as a dataset column. Paired preference data is
split into one desirable and one undesirable row per pair. `generate_during_eval` writes its
samples to a file and the console rather than to Weights & Biases (`trainers/eval_samples.py`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from torch import Tensor

from posttrain.core.preference_losses import bco_loss
from posttrain.forward.completions import completion_logps
from posttrain.models.embedding import DensityRatioClassifier, embed_texts
from posttrain.trainers.base import BaseConfig, classic_arguments, is_streamed, map_datasets
from posttrain.trainers.preference_base import PreferenceTrainer, check_beta_and_lengths


@dataclass
class BCOConfig(BaseConfig):
    """Configuration of `BCOTrainer`, on top of `transformers.TrainingArguments`."""

    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (AdamW)."})
    beta: float = field(default=0.1, metadata={"help": "β scaling the implicit reward log π/π_ref."})
    max_length: int | None = field(default=1024, metadata={
        "help": "Maximum tokens of prompt + completion. Rows whose prompt alone reaches it are dropped; "
                "longer completions are cut (a warning says how many)."})
    max_prompt_length: int | None = field(default=None, metadata={
        "help": "Keep only the last this many prompt tokens (None: no prompt limit besides max_length)."})
    max_completion_length: int | None = field(default=None, metadata={
        "help": "Cut completions to this many tokens (None: only max_length limits them)."})
    prompt_sample_size: int = field(default=1024, metadata={
        "help": "UDM: prompts of each class (desirable, undesirable) sampled to fit the density-ratio classifier."})
    min_density_ratio: float = field(default=0.5, metadata={"help": "UDM: lower clip of the density ratio."})
    max_density_ratio: float = field(default=10.0, metadata={"help": "UDM: upper clip of the density ratio."})
    disable_dropout: bool = field(default=True, metadata={
        "help": "Set every dropout probability of the model to 0, so policy and reference log-probs are comparable."})
    generate_during_eval: bool = field(default=False, metadata={
        "help": "At each evaluation, sample completions of per_device_eval_batch_size eval prompts from the policy "
                "and the reference: printed as a table (Prompt | Policy | Ref Model) and appended to "
                "<output_dir>/eval_completions.jsonl."})

    def _check(self):
        check_beta_and_lengths(self)
        if self.prompt_sample_size < 1:
            raise ValueError(f"prompt_sample_size must be >= 1, got {self.prompt_sample_size}")
        if not 0 < self.min_density_ratio <= self.max_density_ratio:
            raise ValueError(f"need 0 < min_density_ratio <= max_density_ratio, got "
                             f"{self.min_density_ratio} and {self.max_density_ratio}")


class BCOTrainer(PreferenceTrainer):
    """Unpaired (or paired, split) feedback -> a policy, by BCO's reward-shifted binary classification."""

    _tag = "bco"
    _name = "BCO"
    _citation = """@article{jung2024binary,
    title   = {{Binary Classifier Optimization for Large Language Model Alignment}},
    author  = {Seungjae Jung and Gunsoo Han and Daniel Wontae Nam and Kyoung-Woon On},
    journal = {arXiv preprint arXiv:2404.04656},
    year    = 2024
}"""
    paired = False
    uses_reward_mean = True

    def __init__(self, model, ref_model=None, args: BCOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, data_collator=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, embedding_func=None, embedding_tokenizer=None,
                 compute_metrics=None, **kwargs):
        # kwargs: TRL's older conventions (tokenizer=, BCOConfig fields such as beta=), see classic_arguments
        args, processing_class = classic_arguments("BCOTrainer", BCOConfig, args, processing_class, kwargs)
        if embedding_func is not None and is_streamed(train_dataset):
            raise ValueError("embedding_func (UDM) fits its prompt classifier on the whole train_dataset, which a "
                             "streamed dataset (IterableDataset) does not give; pass a datasets.Dataset")
        if embedding_func is not None and embedding_tokenizer is None:
            raise ValueError("embedding_func needs its tokenizer: pass embedding_tokenizer=")
        super().__init__(model, ref_model, args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers, compute_metrics=compute_metrics)
        self.density_classifier = None
        if embedding_func is not None:
            self._match_distributions(embedding_func, embedding_tokenizer)

    # ------------------------------------------------------------------ UDM
    def _match_distributions(self, embedding_func, embedding_tokenizer):
        """Fit the prompt classifier and give every row a `udm_weight` (density ratio if undesirable, else 1)."""
        args = self.args
        decode = self.processing_class.decode
        labels = self.train_dataset["label"]
        rng = random.Random(args.seed)
        self._embedding = (embedding_func, embedding_tokenizer)
        classes = []
        for wanted in (True, False):
            rows = [i for i, label in enumerate(labels) if label == wanted]
            rows = rng.sample(rows, min(args.prompt_sample_size, len(rows)))
            texts = [decode(ids, skip_special_tokens=True) for ids in self.train_dataset.select(rows)["prompt_ids"]]
            classes.append(self.embed(texts))
        self.density_classifier = DensityRatioClassifier.fit(*classes)
        self.train_dataset = self.add_udm_weights(self.train_dataset)
        self.eval_dataset = map_datasets(self.add_udm_weights, self.eval_dataset)

    def embed(self, texts: list[str]) -> Tensor:
        """(N, D) prompt embeddings, each process embedding its share of `texts` (shared_pass)."""
        def compute(rows):
            return embed_texts(*self._embedding, [texts[i] for i in rows], device=self.accelerator.device)

        return self.shared_pass(len(texts), compute, 64, "prompt embeddings")

    def add_udm_weights(self, dataset):
        """The dataset plus `udm_weight`: the density ratio of each undesirable row's prompt, 1 for desirable rows
        (a streamed eval dataset is left unweighted)."""
        if is_streamed(dataset) or "udm_weight" in dataset.column_names:
            return dataset
        args, decode = self.args, self.processing_class.decode
        undesirable = {i: decode(ids, skip_special_tokens=True)
                       for i, (ids, label) in enumerate(zip(dataset["prompt_ids"], dataset["label"])) if not label}
        unique = sorted(set(undesirable.values()))
        ratio = {}
        if unique:
            emb = self.embed(unique)
            values = self.density_classifier.density_ratio(emb, args.min_density_ratio, args.max_density_ratio)
            ratio = dict(zip(unique, values.tolist()))
        weights = [ratio[undesirable[i]] if i in undesirable else 1.0 for i in range(len(dataset))]
        return dataset.add_column("udm_weight", weights)

    def prepare_eval_dataset(self, dataset, name: str = "eval"):
        dataset = super().prepare_eval_dataset(dataset, name)
        if getattr(self, "density_classifier", None) is None:  # None too while the trainer is being built
            return dataset
        return self.add_udm_weights(dataset)

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = self.mode()
        ids, mask, cmask, labels = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"], inputs["label"]
        ref_logps = self.reference_logps(ids, mask, cmask)  # first: its temporaries go before the policy's
        logps = completion_logps(model, ids, mask, cmask)[0]
        delta = self.reward_mean.mean
        losses, rewards = bco_loss(logps, ref_logps, labels, beta=self.args.beta, delta=delta,
                                   weights=inputs.get("udm_weight"))
        loss = losses.mean()
        self.add_pending_rewards(rewards)
        self.record({"delta": delta}, mode)
        self.record_unpaired(rewards, logps.detach(), labels, mode)
        self.count_tokens(mask, mode)
        return (loss, {"rewards": rewards}) if return_outputs else loss
