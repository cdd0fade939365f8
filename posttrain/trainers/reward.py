"""Reward modelling: a sequence classifier with one output trained on preference pairs.

Bradley-Terry model (Bradley & Terry 1952) as used for RLHF reward models (Ouyang et al. 2022,
"Training language models to follow instructions with human feedback"): the probability that
the chosen completion beats the rejected one is σ(r(x, y_c) - r(x, y_r)); the loss is its
negative log-likelihood, `core.preference_losses.pairwise_reward_loss`. Optional per-pair
`margin` column (Llama 2, Touvron et al. 2023) and reward centring (Eisenstein et al. 2023).

Departures: chosen and rejected are scored in one forward pass ([chosen; rejected] stacked
along the batch); ranked data (several responses per prompt) expands to every ordered pair.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

from posttrain.core.preference_losses import pairwise_reward_loss
from posttrain.trainers.base import BaseConfig, classic_arguments
from posttrain.trainers.preference_base import PreferenceTrainer


@dataclass
class RewardConfig(BaseConfig):
    """Configuration of `RewardTrainer`, on top of `transformers.TrainingArguments`."""

    max_length: int | None = field(default=1024, metadata={
        "help": "Maximum tokens of prompt + completion. Pairs whose prompt alone reaches it are dropped; "
                "longer completions are cut (a warning says how many)."})
    center_rewards_coefficient: float | None = field(default=None, metadata={
        "help": "Weight of mean((r_chosen + r_rejected)^2), which keeps rewards centred on 0 "
                "(Eisenstein et al. 2023); None or 0 turns it off."})
    disable_dropout: bool = field(default=True, metadata={"help": "Set every dropout probability of the model to 0."})

    def _check(self):
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise ValueError(f"center_rewards_coefficient must be >= 0, got {self.center_rewards_coefficient}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {self.max_length}")


def _seq_cls_peft(peft_config):
    """A LoRA-style config must have task_type SEQ_CLS, which makes the fresh score head trainable."""
    if peft_config is None or getattr(peft_config, "task_type", "SEQ_CLS") == "SEQ_CLS":
        return peft_config
    if getattr(peft_config, "task_type", None) is None:
        return dataclasses.replace(peft_config, task_type="SEQ_CLS")
    raise ValueError(f"a reward model is a sequence classifier: peft_config.task_type must be 'SEQ_CLS' "
                     f"(so the score head is trained), got {peft_config.task_type!r}")


class RewardTrainer(PreferenceTrainer):
    """Preference pairs -> a scalar reward model (sequence classifier with one output)."""

    _tag = "reward"
    _name = "Reward modelling"
    _citation = """@inproceedings{ouyang2022training,
    title     = {{Training language models to follow instructions with human feedback}},
    author    = {Long Ouyang and Jeff Wu and Xu Jiang and Diogo Almeida and Carroll L. Wainwright and Pamela Mishkin
                 and Chong Zhang and Sandhini Agarwal and Katarina Slama and Alex Ray and others},
    booktitle = {Advances in Neural Information Processing Systems 35 (NeurIPS 2022)},
    year      = 2022,
    eprint    = {arXiv:2203.02155}
}"""
    paired = True
    keep_columns = ("margin",)

    def __init__(self, model, args: RewardConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, peft_config=None, callbacks=None,
                 optimizers=(None, None), compute_metrics=None, ref_model=None, **kwargs):
        # kwargs: TRL's older conventions (tokenizer=, RewardConfig fields such as max_length=), see classic_arguments
        args, processing_class = classic_arguments("RewardTrainer", RewardConfig, args, processing_class, kwargs)
        if ref_model is not None:  # the classic examples pass one
            warnings.warn("RewardTrainer: a reward model has no reference model; ref_model is ignored", UserWarning,
                          stacklevel=2)
        super().__init__(model, None, args, data_collator=data_collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         peft_config=_seq_cls_peft(peft_config), callbacks=callbacks, optimizers=optimizers,
                         needs_reference=False, model_kind="seq-cls", compute_metrics=compute_metrics)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = self.mode()
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        B = ids.shape[0] // 2
        rewards = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, 0].float()  # (2B,)
        chosen, rejected = rewards[:B], rewards[B:]
        loss = pairwise_reward_loss(chosen, rejected, inputs.get("margin"), self.args.center_rewards_coefficient or 0.0)
        gathered = self.accelerator.gather_for_metrics(rewards.detach())
        self.record({
            "accuracy": (chosen > rejected).float().mean(),
            "margin": (chosen - rejected).detach().mean(),
            "rewards/mean": gathered.mean().item(),
            "rewards/min": gathered.min().item(),
            "rewards/max": gathered.max().item(),
        }, mode)
        self.count_tokens(mask, mode)
        if return_outputs:
            return loss, {"rewards_chosen": chosen, "rewards_rejected": rejected}
        return loss
