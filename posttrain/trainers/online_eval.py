"""The online engine's evaluation: rollouts of the eval prompts scored by the reward functions, and the
training loss on them at ratio 1 (`eval_loss`). A mixin of `OnlineTrainer` (online.py)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
from torch import Tensor

from posttrain.core.advantages import ADVANTAGES, AdvantageInput, compute_advantages
from posttrain.core.kl import kl_penalty
from posttrain.core.masked import aggregate_loss
from posttrain.core.policy_losses import POLICY_LOSSES
from posttrain.rollout.generate import Rollout
from posttrain.trainers.base import is_streamed


class OnlineEvaluation:
    """`evaluate` of `OnlineTrainer`: reads the trainer's sampler, scorer and loss settings."""

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`num_generations_eval` completions per eval prompt (1 by default) with the training sampling settings;
        the mean rewards as metrics, and `eval_loss`: the policy loss (plus the in-loss KL) on these completions
        with advantages from their rewards, as TRL computes its eval loss on eval rollouts (no critic
        estimators: their loss needs value targets, so PPO reports rewards only). A dict of datasets is
        evaluated one by one, each with its name in the metric prefix (`eval_<name>_reward`), as Trainer does."""
        from accelerate.utils import gather_object

        if getattr(self, "rollouts", None) is not None:  # the sampler's generator is shared: its jobs first
            self.rollouts.wait()
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):  # Trainer's periodic evaluation names one of a dict's datasets
            dataset = self.eval_dataset[dataset]
        if isinstance(dataset, dict):
            metrics = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset: give one here or to the trainer")
        self._check_dataset(dataset, "eval_dataset")
        acc, bs = self.accelerator, self.args.per_device_eval_batch_size
        if is_streamed(dataset):  # every process reads the stream and keeps the rows at its positions
            mine = list(itertools.islice(dataset, acc.process_index, None, acc.num_processes))
        else:
            mine = [dataset[i] for i in range(acc.process_index, len(dataset), acc.num_processes)]
        k = self.args.num_generations_eval or 1
        sampling = dataclasses.replace(self.sampling, num_generations=k)
        rows, losses = [], []  # (total reward, per-function rewards, length) per completion; loss per batch
        for s in range(0, len(mine), bs):
            batch = self._collate(mine[s:s + bs])
            prompts = [p for p in batch["prompt"] for _ in range(k)]
            columns = {key: [v for v in values for _ in range(k)] for key, values in batch["columns"].items()}
            rollout, episodes = self.roll_out(batch, prompts, columns, sampling, mode="eval")
            texts, completions, ids = self.decode(rollout, prompts, episodes)
            per_function, total = self.reward_scorer(prompts, completions, ids, columns,
                                                     extra=self._reward_extras("eval"))
            rows += zip(total.tolist(), per_function.tolist(), map(len, ids))
            loss = None if ADVANTAGES[self.args.advantage_estimator].critic else self._eval_loss(rollout, total, k)
            if loss is not None:  # None: the trainer has no eval loss on these rollouts
                losses.append(loss)
        rows = gather_object(rows) if acc.num_processes > 1 else rows
        p = metric_key_prefix
        metrics = {f"{p}_reward": sum(r[0] for r in rows) / max(len(rows), 1),
                   f"{p}_completions/mean_length": sum(r[2] for r in rows) / max(len(rows), 1)}
        if losses:
            losses = gather_object(losses) if acc.num_processes > 1 else losses
            metrics[f"{p}_loss"] = sum(losses) / len(losses)
        for j, name in enumerate(self.reward_scorer.names):
            values = [r[1][j] for r in rows if not math.isnan(r[1][j])]
            if values:
                metrics[f"{p}_rewards/{name}/mean"] = sum(values) / len(values)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _eval_loss(self, rollout: Rollout, scores: Tensor, k: int) -> float | None:
        """The training loss of one eval batch at ratio 1 (old = current): the policy loss with this batch's
        advantages, plus beta * KL where the KL is in the loss."""
        args, device = self.args, self.accelerator.device
        batch = {key: getattr(rollout, key).to(device)
                 for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        batch.update({key: v.to(device) for key, v in (rollout.vision or {}).items()})  # image prompts' images
        mask = batch["completion_mask"] * (1 - rollout.tool_mask.to(device) if rollout.tool_mask is not None else 1)
        logp = self._no_grad_forward(self.policy, batch)
        scores = scores.to(device).float()
        if k < ADVANTAGES[args.advantage_estimator].min_group:  # nothing to compare with: no signal
            advantages = torch.zeros_like(logp)
        else:
            inp = AdvantageInput(scores=scores, mask=mask, group_size=k, layout="prompt_major")
            advantages, _ = compute_advantages(args.advantage_estimator, inp,
                                               **self._options("advantage_estimator"))
        per_token, _ = POLICY_LOSSES[args.policy_loss].fn(logp, logp, advantages[:, :logp.shape[1]].float(), mask,
                                                          **self._options("policy_loss"))
        if args.beta > 0 and not args.kl_in_reward:
            with self.reference_context(self.ref_model):
                ref_logp = self._no_grad_forward(self.ref_model if self.ref_model is not None else self.policy, batch)
            per_token = per_token + args.beta * kl_penalty(logp, ref_logp, args.kl_estimator)
        return float(aggregate_loss(per_token, mask, self.loss_mode, max_length=args.max_completion_length))
