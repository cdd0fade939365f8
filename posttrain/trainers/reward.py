"""Reward modelling: a sequence classifier with one output trained on preference pairs.

Bradley-Terry model (Bradley & Terry 1952) as used for RLHF reward models (Ouyang et al. 2022,
"Training language models to follow instructions with human feedback"): the probability that
the chosen completion beats the rejected one is σ(r(x, y_c) - r(x, y_r)); the loss is its
negative log-likelihood, `core.preference_losses.pairwise_reward_loss`. Optional per-pair
`margin` column (Llama 2, Touvron et al. 2023) and reward centring (Eisenstein et al. 2023).

Departures: a pair's prompt goes through the model once: each pair is one sequence
[prompt | chosen | rejected] whose block mask lets each completion see the prompt and itself only
(`forward.logprobs.pack_pairs`), and each completion's score is read at its last token, so the
model computes what the two [prompt | completion] rows would give, up to float rounding, on
P + C_c + C_r tokens instead of 2 P + C_c + C_r. Under sdpa (document attention,
`accel.document_attention`) a batch's pairs go through the model as ONE padding-free row, each
pair attending under its own block mask: one forward per batch, no padding. Models whose
attention takes no block mask, or
whose score head is not a plain map of the last hidden state, get the two rows stacked along the
batch instead. Ranked data (several responses per prompt) expands to every ordered pair.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.accel import document_attention
from posttrain.core.log_softmax import length_groups
from posttrain.core.preference_losses import pairwise_reward_loss
from posttrain.forward.logprobs import attention_kind, pack_pairs
from posttrain.models.loading import is_peft_model, peft_for_task
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


_SCORE_HEADS = weakref.WeakKeyDictionary()  # model -> (its score head, that head if plain else None)


def plain_score_head(model, input_ids: Tensor):
    """The model's score head if its output is `score(hidden_states[-1])` at the last non-pad token, else None.

    That is what the packed forward needs: it reads the hidden state at each completion's last
    token and applies the head itself. Looked up through a DDP wrapper and a (non prompt-learning)
    PEFT wrapper, and checked once per model and head on the first 8 tokens of `input_ids`."""
    inner = getattr(model, "module", model)  # DDP
    if is_peft_model(inner):
        if inner.active_peft_config.is_prompt_learning:  # virtual tokens: the packed positions would not hold
            return None
        inner = inner.base_model.model
    head = getattr(inner, "score", None)
    known = _SCORE_HEADS.get(model)
    if known is not None and known[0] is head:
        return known[1]
    plain = isinstance(head, torch.nn.Module) and attention_kind(model) in ("sdpa", "eager")
    if plain:
        ids = input_ids[:1, :8]
        pad = getattr(inner.config, "pad_token_id", None)
        # the model's own pooling: the last token that is not padding
        last = -1 if pad is None else int((torch.arange(ids.shape[1], device=ids.device) * (ids[0] != pad)).argmax())
        training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.autocast(ids.device.type, enabled=False):
                out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
                plain = bool(out.hidden_states) and torch.allclose(head(out.hidden_states[-1][:, last]).float(),
                                                                   out.logits.float(), rtol=1e-4, atol=1e-4)
        finally:
            model.train(training)
    _SCORE_HEADS[model] = (head, head if plain else None)
    return head if plain else None


def pair_rewards(model, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor,
                 per_forward: int | None = None) -> Tensor:
    """Scores (2B,) of preference pairs, chosen rows first, as the paired collator lays them out (in the
    dtype of the model's output).

    input_ids, attention_mask, completion_mask: (2B, T) right-padded [prompt | completion] rows.
    Where the model allows (`plain_score_head`), each pair is one packed sequence [prompt | chosen |
    rejected] and the head reads each completion's last token; under document attention all pairs go
    in one padding-free row (`_flat_pair_rewards`); otherwise, on CPU, where a forward costs little
    beyond its tokens, pairs of uneven length go in groups of similar length (`length_groups`,
    `per_forward` = 16 tokens by default) so that less of the work is padding. Else the 2B rows go
    through the model as they are.
    """
    head = plain_score_head(model, input_ids)
    if head is None:
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, 0]
    if document_attention.active(model):
        return _flat_pair_rewards(model, head, input_ids, attention_mask, completion_mask)
    B = input_ids.shape[0] // 2
    if per_forward is None and input_ids.device.type == "cpu":
        per_forward = 16
    pair_lengths = (attention_mask[:B].sum(-1) + completion_mask[B:].sum(-1)).tolist()
    groups = [list(range(B))] if per_forward is None else length_groups(pair_lengths, per_forward)
    rows = [torch.tensor(g + [B + i for i in g], device=input_ids.device) for g in groups]
    scores = []
    for r in rows:
        packed = pack_pairs(input_ids[r], attention_mask[r], completion_mask[r])
        hidden = model(**packed.model_inputs(model), output_hidden_states=True, use_cache=False).hidden_states[-1]
        scores.append(head(packed.at_last(hidden, by_slot=True))[:, 0])  # (2b,): the group's chosen, its rejected
    return torch.cat(scores)[torch.cat(rows).argsort()]


def _flat_pair_rewards(model, head, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor) -> Tensor:
    """`pair_rewards` in one forward under document attention: every pair's [prompt | chosen | rejected]
    tokens side by side in ONE row with no padding, each pair one sequence (`cu_seq_lens_q`) under its own
    block mask (a block-diagonal (1, 1, N, N) mask whose diagonal blocks document attention reads), so a
    batch is one forward whatever its pairs' lengths: no padding, and one gradient per weight."""
    packed = pack_pairs(input_ids, attention_mask, completion_mask)  # (B, L)
    inputs, where = packed.one_row_inputs()
    hidden = model(**inputs, output_hidden_states=True, use_cache=False).hidden_states[-1]  # (1, N, H)
    last = where.gather(1, packed.last_at)  # (B, 2) each completion's last token in the row
    return head(hidden[0, last.t().reshape(-1)])[:, 0]  # (2B,): chosen rows first, as the collator lays them out


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
                         peft_config=peft_for_task(peft_config, "SEQ_CLS", "a reward model is a sequence classifier"),
                         callbacks=callbacks, optimizers=optimizers,
                         needs_reference=False, model_kind="seq-cls", compute_metrics=compute_metrics)
        if not self.vision:  # each batch's pairs as one padding-free row, each pair attending within itself
            document_attention.enable(self.accelerator.unwrap_model(self.model))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = self.mode()
        mask = inputs["attention_mask"]
        B = mask.shape[0] // 2
        if self.vision:  # each row with its images, as it is: image tokens must meet their image features
            rewards = model(input_ids=inputs["input_ids"], attention_mask=mask,
                            **inputs["model_inputs"]).logits[:, 0].float()
        else:
            rewards = pair_rewards(model, inputs["input_ids"], mask, inputs["completion_mask"]).float()  # (2B,)
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
