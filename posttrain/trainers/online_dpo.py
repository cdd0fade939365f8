"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback").

For each prompt the policy samples two completions; a ranker (reward functions / reward models, or a
pairwise judge) says which is better; the pair trains the policy with a DPO-family loss against a frozen
reference, exactly as offline DPO would train on it:

    h = (log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l)),   loss = -log σ(β h)  (sigmoid)

A preset of the online engine: num_generations=2, the `preference_pair` advantage estimator (+1 on the
chosen completion, -1 on the rejected: core.advantages), and the pairwise losses of
`core.preference_losses` (`loss_type`: sigmoid, ipo, hinge, ...). Sampling, reward scoring,
missing_eos_penalty, reference log-probs, checkpoints, streaming and LoRA are the engine's. `beta` may be
a list: the epoch's β (the last one once the list is used up). XPO and Nash-MD (`xpo.py`, `nash_md.py`)
subclass this trainer and change the second sample and the loss.

Departures: TRL 1.16 allows loss_type "sigmoid" and "ipo"; every pairwise loss of core.preference_losses is
accepted here (not the batch-quantile AOT losses). `max_length` bounds the prompt before sampling
(max_prompt_length = max_length - max_new_tokens) instead of cutting the prompt's left end after it. A judge's
verdict becomes the scores 1 (win) and 0 (loss) of the pair (0.5 each where it gives none), so
missing_eos_penalty applies to judged pairs too. The config's `beta` holds the current epoch's β once training
runs (the list stays in `beta_schedule`). One optimizer step per generation batch (num_iterations=1,
steps_per_generation = gradient_accumulation_steps), as TRL: the two completions of a pair always share a
micro-batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.core.masked import masked_sum
from posttrain.core.preference_losses import DPO_LOSSES, PreferenceInput, dpo_loss, tied_pair_loss
from posttrain.rollout.generate import Rollout, generate
from posttrain.trainers.online import OnlineConfig, OnlineTrainer
from posttrain.trainers.online_config import estimator_help, resolve_aliases


def per_epoch(value, epoch: float | None):
    """A scalar, or from a list the value of this epoch (the last one for later epochs), as TRL schedules β."""
    if isinstance(value, (list, tuple)):
        return value[min(int(epoch or 0), len(value) - 1)]
    return value


def schedule(value, name: str) -> tuple[float, ...]:
    """A float or a non-empty list of floats, as a tuple; a clear error otherwise."""
    values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{name} must be a number or a non-empty list of numbers (one per epoch), got {value!r}")
    return tuple(float(v) for v in values)


@dataclass
class OnlineDPOConfig(OnlineConfig):
    """Online DPO's configuration: TRL's OnlineDPOConfig fields and defaults on the online engine's."""

    learning_rate: float = field(default=5e-7, metadata={"help": "Initial AdamW learning rate."})
    num_generations: int = field(default=2, metadata={"help": "Completions per prompt: a pair (2; nothing else)."})
    max_new_tokens: int = field(default=64, metadata={"help": "Most tokens per completion (alias: "
                                "max_completion_length)."})
    max_completion_length: int = field(default=64, metadata={"help": "Alias of max_new_tokens."})
    max_length: int | None = field(default=512, metadata={"help": "Most prompt + completion tokens: with "
                                   "max_prompt_length unset, prompts keep their last max_length - max_new_tokens "
                                   "tokens (None: no limit)."})
    max_prompt_length: int | None = field(default=None, metadata={"help": "Keep the last this many prompt tokens "
                                          "(None: max_length - max_new_tokens)."})
    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature."})
    beta: list[float] = field(default_factory=lambda: [0.1], metadata={"help": "β of the DPO loss (for ipo, the "
                              "paper's τ); a list gives one per epoch, the last for the epochs after it."})
    loss_type: str = field(default="sigmoid", metadata={"help": "The pairwise loss, a core.preference_losses "
                           "name: " + ", ".join(n for n, s in DPO_LOSSES.items() if not s.per_quantile) + "."})
    judge: str | None = field(default=None, metadata={"help": "TRL's judge name; posttrain takes the judge as an "
                              "object (OnlineDPOTrainer(judge=...), a posttrain.judges.PairwiseJudge), so a name "
                              "here is refused."})
    kl_estimator: str = field(default="k1", metadata={"help": "KL estimator of the logged objective/kl and "
                              "non_score_reward (k1, as TRL logs them); the loss holds no KL term."})
    advantage_estimator: str = field(default="preference_pair", metadata={"help": estimator_help(
                                     "Online DPO ranks each pair: 'preference_pair'.")})

    def __post_init__(self):
        if isinstance(self.beta, str):  # from the command line, one value
            self.beta = [float(v) for v in self.beta.split(",")]
        self.beta_schedule = schedule(self.beta, "beta")
        self.beta = self.beta_schedule[0]  # the engine reads one number; the trainer sets each epoch's
        super().__post_init__()

    def loss_type_choices(self) -> dict:
        return {name: spec for name, spec in DPO_LOSSES.items() if not spec.per_quantile}

    def loss_aggregation(self) -> tuple[str, bool]:
        return "seq_mean_token_mean", True  # denominators count sequences: two per pair

    def _check(self):
        resolve_aliases(self, [("max_new_tokens", "max_completion_length")])
        if self.max_prompt_length is None and self.max_length is not None:
            if self.max_length <= self.max_completion_length:
                raise ValueError(f"max_length={self.max_length} leaves no room for the prompt beside "
                                 f"max_new_tokens={self.max_completion_length}; raise max_length or set "
                                 "max_prompt_length")
            self.derive("max_prompt_length", self.max_length - self.max_completion_length)
        if self.judge is not None:
            raise ValueError(f"judge={self.judge!r}: pass the judge object to the trainer (judge=RewardModelJudge(...) "
                             "or another posttrain.judges.PairwiseJudge); judge names are not resolved")
        if self.num_generations != 2:
            raise ValueError(f"{type(self).__name__} trains on pairs: num_generations must be 2, got "
                             f"{self.num_generations}")
        if self.per_device_train_batch_size % 2:
            raise ValueError(f"per_device_train_batch_size={self.per_device_train_batch_size} counts completions, "
                             "two per prompt: it must be even so that each pair shares its micro-batch")
        if any(b <= 0 for b in self.beta_schedule):
            raise ValueError(f"beta must be > 0 (it scales the DPO margin), got {list(self.beta_schedule)}")
        if self.num_iterations != 1:
            raise ValueError(f"num_iterations={self.num_iterations}: online preference training takes one pass over "
                             "each generation batch")
        if self.use_vllm and type(self) is not OnlineDPOConfig:
            raise ValueError(f"{type(self).__name__} samples from the reference model too: use_vllm is not supported")
        super()._check()
        if self.steps_per_generation != self.gradient_accumulation_steps:
            raise ValueError(f"steps_per_generation={self.steps_per_generation} must equal gradient_accumulation_steps "
                             f"={self.gradient_accumulation_steps}: one optimizer step per generation batch")


def judge_reward(judge):
    """A posttrain pairwise judge as a reward function of the pair rows [a0, b0, a1, b1, ...]: the judge's winner
    scores 1 and the loser 0; a pair without a verdict scores 0.5 each."""

    def reward(prompts, completions, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        ranks = judge.judge(prompts[0::2], list(zip(texts[0::2], texts[1::2])))
        return [s for r in ranks for s in ((0.5, 0.5) if r not in (0, 1) else (1.0, 0.0) if r == 0 else (0.0, 1.0))]

    reward.__name__ = "judge"
    return reward


@dataclass
class Pairs:
    """The pairs of a micro-batch whose rows are [first_0, second_0, first_1, ...], as sequence sums (P,)."""

    logps: Tensor  # (B,) log π of each row's completion, summed over its tokens (with gradient)
    ref_logps: Tensor  # (B,) the same under the reference
    first_chosen: Tensor  # (P,) bool: the pair's first row is the chosen one
    valid: Tensor  # (P,) bool: both rows have tokens in the loss (mask_truncated_completions may drop one)
    preference: PreferenceInput  # chosen / rejected sums and lengths
    tied: Tensor  # (P,) bool: the estimator labelled neither row (a tie, `preference_or_tie`): no preference

    @staticmethod
    def of(logp: Tensor, ref_logp: Tensor, mask: Tensor, signs: Tensor) -> Pairs:
        """logp, ref_logp, mask (B, T); signs (B,) > 0 on the chosen rows."""
        logps, ref_logps = masked_sum(logp, mask, dim=1), masked_sum(ref_logp, mask, dim=1)
        lengths = mask.sum(1).float()
        first = signs[0::2] > 0

        def pick(x: Tensor, chosen: bool) -> Tensor:
            return torch.where(first if chosen else ~first, x[0::2], x[1::2])

        preference = PreferenceInput(pick(logps, True), pick(logps, False), pick(ref_logps, True),
                                     pick(ref_logps, False), pick(lengths, True), pick(lengths, False))
        in_loss = mask.sum(1) > 0
        tied = (signs[0::2] == 0) & (signs[1::2] == 0)
        return Pairs(logps, ref_logps, first, in_loss[0::2] & in_loss[1::2], preference, tied)


class OnlineDPOTrainer(OnlineTrainer):
    """Online DPO on the online engine; TRL's signature (ref_model second, reward_funcs or judge)."""

    config_class = OnlineDPOConfig
    _tag = "online-dpo"
    samples_in_background = False  # samples with a teacher / the reference too (max_staleness refused)
    _name = "Online DPO"
    _citation = """@article{guo2024direct,
    title   = {{Direct Language Model Alignment from Online AI Feedback}},
    author  = {Shangmin Guo and Biao Zhang and Tianlin Liu and Tianqi Liu and Misha Khalman and Felipe Llinares
               and Alexandre Ram{\\'e} and Thomas Mesnard and Yao Zhao and Bilal Piot and Johan Ferret and
               Mathieu Blondel},
    journal = {arXiv preprint},
    year    = 2024,
    eprint  = {arXiv:2402.04792}
}"""

    def __init__(self, model, ref_model=None, reward_funcs=None, judge=None, args: OnlineDPOConfig | None = None,
                 data_collator=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, peft_config=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), preprocess_logits_for_metrics=None, **kwargs):
        if "reward_model" in kwargs:  # TRL's earlier name of reward_funcs
            if reward_funcs is not None:
                raise ValueError("pass reward_funcs or reward_model (its earlier name), not both")
            reward_funcs = kwargs.pop("reward_model")
        for name, value in (("data_collator", data_collator), ("compute_metrics", compute_metrics),
                            ("preprocess_logits_for_metrics", preprocess_logits_for_metrics)):
            if value is not None:
                raise ValueError(f"{type(self).__name__} does not take {name}: prompts are collated and completions "
                                 "scored by the online engine (evaluate() reports the rewards)")
        if judge is not None:
            if reward_funcs is not None:
                raise ValueError("pass reward_funcs or judge, not both: each ranks the pairs")
            reward_funcs = judge_reward(judge)
        self.judge = judge
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, reward_processing_classes=reward_processing_classes,
                         callbacks=callbacks, optimizers=optimizers, peft_config=peft_config, ref_model=ref_model,
                         **kwargs)

    @property
    def beta(self) -> float:
        """This epoch's β (TRL's `trainer.beta`)."""
        return per_epoch(self.args.beta_schedule, self.state.epoch)

    def make_experience(self, inputs: dict) -> list[dict]:
        self.args.beta = self.beta  # read by the engine's KL metrics and by the loss
        return super().make_experience(inputs)

    # ------------------------------------------------------------------ the second completion of a pair
    def sample_pair(self, prompt_ids: list[list[int]], second, context=None) -> Rollout:
        """One completion per prompt from the policy and one from `second` (a model or a SamplerBackend, decoded
        in `context`, by default the reference context), as the rows [policy_0, second_0, policy_1, ...]."""
        tok, one = self.processing_class, dataclasses.replace(self.sampling, num_generations=1)
        kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tokenizer=tok, generator=self.generator)
        first = generate(self.policy, prompt_ids, one, **kw)
        with context if context is not None else self.reference_context(self.ref_model):
            other = generate(second, prompt_ids, one, **kw)
        return interleave(first, other, tok.pad_token_id)

    # ------------------------------------------------------------------ loss
    def pair_losses(self, pairs: Pairs, logp: Tensor, inputs: dict) -> tuple[Tensor, dict]:
        """(loss per pair (P,), metrics): the configured DPO-family loss of each pair; for a pair without a preference
        (tied scores under `preference_or_tie`), the loss expected under a fair coin's label."""
        losses = dpo_loss(pairs.preference, self.args.loss_type, self.args.beta)
        if bool(pairs.tied.any()):
            tied = tied_pair_loss(pairs.preference, self.args.loss_type, self.args.beta)
            losses = torch.where(pairs.tied, tied, losses)
        return losses, {}

    def policy_logprobs(self, model, inputs: dict) -> Tensor:
        """(B, C) log π of the micro-batch's completion tokens, with gradient: the training forward over every row
        (taking the sampler's linear outputs where it kept them). Nash-MD scores only the rows its loss reads."""
        logp, _, _ = self.forward(model, inputs, replay=True)
        return logp

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logp = self.policy_logprobs(model, inputs)
        mask = inputs["loss_mask"]
        signs = torch.sign(masked_sum(inputs["advantages"], mask, dim=1))
        pairs = Pairs.of(logp, inputs["ref_logp"], mask, signs)
        losses, metrics = self.pair_losses(pairs, logp, inputs)
        # the denominator counts the optimizer step's sequences over every process: two per pair
        loss = torch.where(pairs.valid, losses, 0.0).sum() / (inputs["denominator"] / 2)
        self.record_pairs(pairs, metrics)
        return (loss, None) if return_outputs else loss

    def record_pairs(self, pairs: Pairs, metrics: dict):
        """TRL's pair metrics: the chosen and rejected log-probs and implicit rewards β (log π - log π_ref)."""
        p, beta = pairs.preference, self.args.beta
        if not bool(pairs.valid.any()):  # every pair left out of the loss (mask_truncated_completions): no means
            return
        chosen = (beta * (p.chosen_logps - p.ref_chosen_logps)).detach()
        rejected = (beta * (p.rejected_logps - p.ref_rejected_logps)).detach()
        keep = pairs.valid
        metrics.update({"logps/chosen": p.chosen_logps.detach()[keep].mean(),
                        "logps/rejected": p.rejected_logps.detach()[keep].mean(),
                        "rewards/chosen": chosen[keep].mean(), "rewards/rejected": rejected[keep].mean(),
                        "rewards/margins": (chosen - rejected)[keep].mean(),
                        "rewards/accuracies": (chosen > rejected)[keep].float().mean(), "beta": beta})
        self.record({k: float(v) for k, v in metrics.items()}, "train")

    def _record_rollout(self, g: dict, scores: Tensor, truncated: Tensor):
        super()._record_rollout(g, scores, truncated)
        pairs = scores.view(-1, 2)
        margin = (pairs[:, 0] - pairs[:, 1]).abs()  # chosen minus rejected
        self.record({"objective/scores_margin": float(margin.mean()),
                     "val/contain_eos_token": float((~truncated).float().mean())}, "train")

    def record_sources(self, truncated: Tensor):
        """XPO, Nash-MD: how often the policy's completions (rows 0, 2, ...) and the second source's (rows 1, 3, ...:
        the reference's, the mixture's) end with EOS."""
        self.record({"val/model_contain_eos_token": float((~truncated[0::2]).float().mean()),
                     "val/ref_contain_eos_token": float((~truncated[1::2]).float().mean())}, "train")

    def _eval_loss(self, rollout: Rollout, scores: Tensor, k: int) -> None:
        return None  # eval rollouts are single completions: evaluate() reports their rewards


def interleave(first: Rollout, second: Rollout, pad_token_id: int) -> Rollout:
    """Rows [first_0, second_0, first_1, ...] of two rollouts of the same prompts, one completion each; the
    completions padded to the longer width. No linear-output record (the second rows are not the policy's)."""
    width = max(first.completion_ids.shape[1], second.completion_ids.shape[1])

    def both(a: Tensor, b: Tensor, fill) -> Tensor:
        if a.dim() == 2:
            a = torch.nn.functional.pad(a, (0, width - a.shape[1]), value=fill)
            b = torch.nn.functional.pad(b, (0, width - b.shape[1]), value=fill)
        return torch.stack([a, b], dim=1).flatten(0, 1)

    return Rollout(prompt_ids=torch.stack([first.prompt_ids, second.prompt_ids], 1).flatten(0, 1),
                   prompt_mask=torch.stack([first.prompt_mask, second.prompt_mask], 1).flatten(0, 1),
                   completion_ids=both(first.completion_ids, second.completion_ids, pad_token_id),
                   completion_mask=both(first.completion_mask, second.completion_mask, 0),
                   logprobs=both(first.logprobs, second.logprobs, 0.0),
                   is_truncated=both(first.is_truncated, second.is_truncated, False))
