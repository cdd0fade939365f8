"""A*-PO (Brantley et al. 2025, "Accelerating RL for LLM Reasoning with Optimal Advantage Regression"),
TRL's A2POTrainer.

Two stages. Stage 1, once before training: `num_value_samples` completions per prompt from the reference
policy, scored by the rewards, give each prompt's optimal value V*(x) = β1 log mean_i exp(r_i / β1)
(`core.advantages.optimal_value`); with `filter_all_incorrect`, training prompts whose samples all score 0
are dropped (they carry no signal). Stage 2, on-policy: one completion per prompt from the policy, and the
loss (β2 log π(y|x)/π_ref(y|x) - (r - V*(x)))^2 (`core.policy_losses.a2po_regression_loss`), the implicit
reward regressed onto the optimal advantage: no group of samples is needed.

A preset of the online engine: num_generations=1, the `optimal_advantage` estimator (the score, r - V*,
is the advantage), the reference log-probs of the engine (`beta` is set to β2, so objective/kl and
non_score_reward read with β2), one loss per sequence.

Departures: V* is keyed by the prompt as given (its text, or its messages as JSON), as TRL keys it by the
templated text. Stage 1 runs again when a run resumes (the same seed draws the same samples, so the same
V* and the same filtered prompts); a streamed train_dataset is refused (Stage 1 reads every prompt first).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from posttrain.core.advantages import optimal_value
from posttrain.core.masked import masked_mean, masked_sum
from posttrain.core.policy_losses import a2po_regression_loss
from posttrain.rollout.generate import SamplingConfig, generate
from posttrain.trainers.base import is_streamed
from posttrain.trainers.online import OnlineConfig, OnlineTrainer
from posttrain.trainers.online_config import estimator_help


def prompt_key(prompt) -> str:
    """The key of a prompt in the V* table: its text, or its messages as JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


@dataclass
class A2POConfig(OnlineConfig):
    """A*-PO's configuration: TRL's A2POConfig fields on the online engine's."""

    num_generations: int = field(default=1, metadata={"help": "On-policy completions per prompt in Stage 2 (1)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature, in both stages."})
    top_k: int | None = field(default=None, metadata={"help": "Sample among the k most likely tokens (None: off)."})
    num_value_samples: int = field(default=8, metadata={"help": "Stage 1: samples from the reference policy per "
                                   "prompt to estimate V*."})
    beta1: float = field(default=0.5, metadata={"help": "Stage 1: the KL temperature of V* = beta1 log mean "
                         "exp(r / beta1)."})
    filter_all_incorrect: bool = field(default=True, metadata={"help": "Stage 1: drop the training prompts whose "
                                       "reference samples all score 0."})
    beta2: float = field(default=1e-3, metadata={"help": "Stage 2: the KL temperature of the regression target "
                         "beta2 log pi/pi_ref."})
    advantage_estimator: str = field(default="optimal_advantage", metadata={"help": estimator_help(
                                     "A*-PO: 'optimal_advantage' (r - V*).")})
    loss_type: str = field(default="seq_mean_token_mean", metadata={"help": "Loss aggregation: one loss per "
                           "sequence (see OnlineConfig)."})
    kl_estimator: str = field(default="k1", metadata={"help": "KL estimator of the logged objective/kl."})

    def _check(self):
        if self.num_value_samples < 1:
            raise ValueError(f"num_value_samples must be >= 1 (reference samples per prompt), got {self.num_value_samples}")
        for name in ("beta1", "beta2"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self.beta = self.beta2  # the engine computes the reference log-probs (and KL metrics) when beta > 0
        super()._check()


class A2POTrainer(OnlineTrainer):
    """A*-PO on the online engine; TRL's signature (model, reward_funcs, args, datasets, processing_class, ...)."""

    config_class = A2POConfig
    _tag = "a2po"
    _name = "A2PO"
    _citation = """@article{brantley2025accelerating,
    title   = {{Accelerating RL for LLM Reasoning with Optimal Advantage Regression}},
    author  = {Kiant{\\'e} Brantley and Mingyu Chen and Zhaolin Gao and Jason D. Lee and Wen Sun and Wenhao Zhan and
               Xuezhou Zhang},
    journal = {arXiv preprint},
    year    = 2025,
    eprint  = {arXiv:2505.20686}
}"""

    def __init__(self, model, reward_funcs=None, args: A2POConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), peft_config=None, ref_model=None, **kwargs):
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, reward_processing_classes=reward_processing_classes,
                         callbacks=callbacks, optimizers=optimizers, peft_config=peft_config, ref_model=ref_model,
                         **kwargs)
        self.optimal_values: dict[str, float] | None = None  # V* per prompt key, from Stage 1

    # ------------------------------------------------------------------ Stage 1
    def train(self, *args, **kwargs):
        if self.optimal_values is None:
            self.estimate_optimal_values()
        return super().train(*args, **kwargs)

    @torch.no_grad()
    def estimate_optimal_values(self):
        """Stage 1: V* of every train and eval prompt from `num_value_samples` reference samples each; with
        filter_all_incorrect, the training prompts whose samples all scored 0 leave the train_dataset."""
        from accelerate.utils import gather_object

        args, acc, tok = self.args, self.accelerator, self.processing_class
        datasets = [d for d in (self.train_dataset, self.eval_dataset) if d is not None and not isinstance(d, dict)]
        if any(is_streamed(d) for d in datasets):
            raise ValueError("A2POTrainer estimates V* from every prompt before training (Stage 1): give a map-style "
                             "dataset, not a streamed one")
        n, found, hopeless = args.num_value_samples, {}, set()
        sampling = SamplingConfig(max_new_tokens=args.max_completion_length, temperature=args.temperature,
                                  top_p=args.top_p, top_k=args.top_k or 0, num_generations=n)
        generator = torch.Generator().manual_seed(args.seed + 15485863 + acc.process_index)
        rows = [d[i] for d in datasets for i in range(acc.process_index, len(d), acc.num_processes)]
        for s in range(0, len(rows), args.per_device_train_batch_size):
            batch = self._collate(rows[s:s + args.per_device_train_batch_size])
            with self.reference_context(self.ref_model):
                rollout = generate(self.ref_model if self.ref_model is not None else self.policy, batch["prompt_ids"],
                                   sampling, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                   tokenizer=tok, generator=generator)
            prompts = [p for p in batch["prompt"] for _ in range(n)]
            columns = {k: [v for v in values for _ in range(n)] for k, values in batch["columns"].items()}
            _, completions, ids = self.decode(rollout, prompts)
            _, rewards = self.reward_scorer(prompts, completions, ids, columns, extra=self._reward_extras("train"))
            rewards = rewards.float().view(-1, n)
            for prompt, value, r in zip(batch["prompt"], optimal_value(rewards, args.beta1).tolist(), rewards):
                found[prompt_key(prompt)] = value
                if not bool((r != 0).any()):
                    hopeless.add(prompt_key(prompt))
        if acc.num_processes > 1:
            found, hopeless = dict(gather_object(list(found.items()))), set(gather_object(list(hopeless)))
        self.optimal_values = found
        if args.filter_all_incorrect and hopeless and self.train_dataset is not None:
            self.train_dataset = self.train_dataset.filter(lambda row: prompt_key(row["prompt"]) not in hopeless)
            if len(self.train_dataset) == 0:
                raise ValueError("filter_all_incorrect dropped every training prompt: the reference's samples scored "
                                 "0 on all of them; set filter_all_incorrect=False or start from a stronger model")

    # ------------------------------------------------------------------ Stage 2
    def make_experience(self, inputs: dict) -> list[dict]:
        if self.optimal_values is None:  # evaluate() or a manual step before train()
            self.estimate_optimal_values()
        self._v_star = torch.tensor([self.optimal_values[prompt_key(p)] for p in inputs["prompt"]
                                     for _ in range(self.args.num_generations)])
        return super().make_experience(inputs)

    def build_experience(self, rollout, scores):
        self.record({"v_star": float(self._v_star.mean())}, "train")
        return super().build_experience(rollout, scores.float() - self._v_star.to(scores.device))  # r - V*

    def _record_rollout(self, g: dict, scores, truncated):
        # `reward` and the objective/* metrics read the rewards themselves, r, not the advantages r - V*
        super()._record_rollout(g, scores + self._gather_rows(self._v_star.to(scores.device).float()), truncated)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logp, _, _ = self.forward(model, inputs, replay=True)
        mask = inputs["loss_mask"]
        advantage = masked_mean(inputs["advantages"], mask, dim=1)  # r - V*, one per sequence
        log_ratio = masked_sum(logp, mask, dim=1) - masked_sum(inputs["ref_logp"], mask, dim=1)
        losses = a2po_regression_loss(log_ratio, 0.0, advantage, self.args.beta2)
        keep = mask.sum(1) > 0
        loss = torch.where(keep, losses, 0.0).sum() / inputs["denominator"]
        self.record({"implicit_reward": float((self.args.beta2 * log_ratio.detach())[keep].mean()),
                     "advantage": float(advantage[keep].mean())}, "train")
        return (loss, None) if return_outputs else loss

    def _eval_loss(self, rollout, scores, k):
        return None  # the eval rollouts' rewards are reported; V* is a training-time table
