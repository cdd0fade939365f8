"""The online engine's metrics and samples: what a generation batch logs (rewards per function, the rollout's
objective/* and completions/* metrics), the completions table, and the `lr` / `episode` / `eps` log fields.
A mixin of `OnlineTrainer` (online.py); the names are TRL's (docs/metrics.md)."""

from __future__ import annotations

import time

import torch
from torch import Tensor

from posttrain.core.kl import kl_penalty
from posttrain.core.masked import masked_sum
from posttrain.rollout.images import text_tokenizer


class OnlineMetrics:
    """Metric recording of `OnlineTrainer`; reads the trainer's args, scorer, accelerator and state."""

    def _record_rollout(self, g: dict, scores: Tensor, truncated: Tensor):
        mask = g["loss_mask"]
        k, eos = self.args.num_generations, text_tokenizer(self.processing_class).eos_token_id
        groups = scores.view(-1, k)
        group_std = groups.std(1) if k > 1 else torch.zeros_like(groups[:, 0])
        metrics = {"reward": scores.mean(), "reward_std": group_std.mean() if k > 1 else scores.std(),
                   "frac_reward_zero_std": (group_std < 1e-8).float().mean(), "objective/scores": scores.mean(),
                   "completions/mean_length": mask.sum(1).float().mean(),
                   "completions/clipped_ratio": truncated.float().mean(),
                   "objective/entropy": -masked_sum(g["old_logp"], mask, dim=1).mean(),
                   "val/num_eos_tokens": ((g["completion_ids"] == eos) & mask.bool()).sum().float()}
        if "ref_logp" in g:
            kl = masked_sum(g["old_logp"] - g["ref_logp"], mask, dim=1)  # k1, summed per sequence
            non_score = -self.args.beta * masked_sum(kl_penalty(g["old_logp"], g["ref_logp"], self.args.kl_estimator),
                                                     mask, dim=1)
            metrics.update({"objective/kl": kl.mean(), "objective/non_score_reward": non_score.mean(),
                            "objective/rlhf_reward": (scores + non_score).mean()})
        self.record({name: float(v) for name, v in metrics.items()}, "train")

    def _record_rewards(self, per_function: Tensor):
        table = self._gather_rows(per_function.to(self.accelerator.device))
        for j, name in enumerate(self.reward_scorer.names):
            col = table[:, j][~torch.isnan(table[:, j])]
            if col.numel():
                self.record({f"rewards/{name}/mean": col.mean().item(),
                             f"rewards/{name}/std": col.std().item() if col.numel() > 1 else 0.0}, "train")

    def _keep_samples(self, prompts, texts, per_function, extra_columns: dict | None = None):
        """Gather this batch's samples from every process when a table is due (a `num_sample_generations`
        point now, or the next logging step with `log_completions`); write the table now if it is a point."""
        args, step = self.args, self.state.global_step
        every = max(1, self.state.max_steps // args.num_sample_generations) if args.num_sample_generations else 0
        sample_now = bool(every) and step % every == 0 and step != self._last_sample_step
        if not (args.log_completions or sample_now):
            self._samples = None
            return
        from accelerate.utils import gather_object

        scores = {name: per_function[:, j].tolist() for j, name in enumerate(self.reward_scorer.names)}
        extra = dict(extra_columns or {})  # `log_extra`'s columns of this batch
        for column, values in extra.items():
            if len(values) != len(texts):
                raise ValueError(f"log_extra({column!r}, values): {len(values)} values for {len(texts)} completions; "
                                 "give one value per completion (the reward function's `completions`)")
        if self.accelerator.num_processes > 1:
            prompts, texts = gather_object(list(prompts)), gather_object(list(texts))
            scores = {name: gather_object(v) for name, v in scores.items()}
            extra = {column: gather_object(list(v)) for column, v in extra.items()}
        self._samples = (prompts, texts, scores, extra)
        if sample_now:
            self._last_sample_step = step
            if self.is_world_process_zero():
                self.completions_table.write(step, *self._samples)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "learning_rate" in logs:  # a training log
            logs["lr"] = logs["learning_rate"]
            logs["episode"] = self._episodes
            logs["eps"] = self._episodes / max(time.time() - (self._start_time or time.time()), 1e-9)
            if self.args.log_completions and self._samples is not None and self.is_world_process_zero():
                self.completions_table.write(self.state.global_step, *self._samples)
        super().log(logs, start_time)
