"""PPO's classic manual loop (TRL's older PPOTrainer API), besides `train()`: the caller brings the prompts, samples
with `generate`, scores the responses itself and calls `step`, with token ids or with texts:

    for batch in trainer.dataloader:
        responses = trainer.generate(batch["input_ids"], max_new_tokens=16)
        rewards = [torch.tensor(my_score(r)) for r in responses]
        stats = trainer.step(batch["input_ids"], responses, rewards)
        trainer.log(stats)

and as the classic docs wrote it (text queries from an "instruction" or "query" column, `generate(texts,
max_length=...)` returning texts, `step(responses, rewards, queries)`: `step` tells its arguments' order by their
types, the scores being the numbers). `step` runs the engine's `build_experience` and `compute_loss` on the given
rows, with old log-probs from one no-grad forward, and steps the optimizer itself.

A mixin of `PPOTrainer` (ppo.py).
"""

from __future__ import annotations

import dataclasses
import numbers

import torch

from posttrain.data.collate import pad
from posttrain.data.tokenize import encode_prompt
from posttrain.rollout.generate import Rollout
from posttrain.rollout.rewards import RewardError, check_scores


class PPOManualLoop:
    """`dataloader`, `generate` and `step` of `PPOTrainer`: the classic manual loop over the online engine."""

    @property
    def dataloader(self):
        """Batches of prompts for the manual loop: "query" and "prompt" (as given), "input_ids" (token-id tensors),
        the other columns ("instruction", ...)."""
        if getattr(self, "_manual_loader", None) is None:
            def collate(rows):
                batch = self._collate(rows)
                return {"query": batch["prompt"], "prompt": batch["prompt"],
                        "input_ids": [torch.tensor(ids) for ids in batch["prompt_ids"]], **batch["columns"]}

            size = self.args.per_process_generation // self.args.num_generations
            streamed = isinstance(self.train_dataset, torch.utils.data.IterableDataset)  # read in stream order
            self._manual_loader = torch.utils.data.DataLoader(self.train_dataset, batch_size=size, collate_fn=collate,
                                                              shuffle=self.args.shuffle_dataset and not streamed,
                                                              drop_last=True)
        return self._manual_loader

    def _ids(self, items, prompts: bool = True) -> list[list[int]]:
        """Token ids of queries (texts encoded as the trainer's prompts) or responses (texts without special tokens),
        token-id lists or tensors."""
        tok = self.processing_class
        if not isinstance(items[0], str):
            return [torch.as_tensor(x).flatten().tolist() for x in items]
        return [encode_prompt(tok, x) if prompts else tok(x, add_special_tokens=False)["input_ids"] for x in items]

    def generate(self, queries, return_prompt: bool = False, max_length: int | None = None, **generation_kwargs):
        """One completion per query (a text, token-id list or tensor, or a list of them); sampling settings from the
        config unless given (max_new_tokens, temperature, top_k, top_p, min_p, do_sample). `max_length` counts
        prompt + response tokens, as in transformers' generate. Returns texts for text queries, else token-id
        tensors (a single one for a single query); the prompt is prepended with `return_prompt`."""
        single = isinstance(queries, str) or (isinstance(queries, torch.Tensor) and queries.dim() == 1)
        queries = [queries] if single else list(queries)
        for name in ("pad_token_id", "eos_token_id", "min_length"):  # classic generation_kwargs the sampler sets
            generation_kwargs.pop(name, None)
        names = {f.name for f in dataclasses.fields(self.sampling)}
        unknown = set(generation_kwargs) - names
        if unknown:
            raise ValueError(f"unknown generation arguments {sorted(unknown)}; use max_length or {sorted(names)}")
        prompt_ids = self._ids(queries)
        if max_length is not None:
            if "max_new_tokens" in generation_kwargs:
                raise ValueError("give max_length (prompt + response tokens) or max_new_tokens, not both")
            generation_kwargs["max_new_tokens"] = max(1, max_length - min(map(len, prompt_ids)))
        sampling = dataclasses.replace(self.sampling, num_generations=1, **generation_kwargs)
        rollout = self.sample_completions(prompt_ids, sampling)
        out = []
        for prompt, ids, n in zip(prompt_ids, rollout.completion_ids, rollout.completion_mask.sum(1).tolist()):
            if max_length is not None:  # each query's own budget
                n = min(n, max(1, max_length - len(prompt)))
            response = ids[:n].cpu()
            out.append(torch.cat([torch.tensor(prompt), response]) if return_prompt else response)
        if isinstance(queries[0], str):
            texts = self.processing_class.batch_decode(out, skip_special_tokens=True)
            # step() given these texts uses the sampled tokens (EOS included), not a re-tokenisation of the text
            self._sampled = {t: ids for t, ids in zip(texts, out)} if not return_prompt else {}
            out = texts
        return out[0] if single else out

    def step(self, queries, responses, scores) -> dict[str, float]:
        """One PPO update (num_ppo_epochs x num_mini_batches optimizer steps) on given prompts, responses and
        scalar rewards; returns the averaged stats. Queries and responses are texts, token-id lists or tensors.
        The order (queries, responses, scores) of the later classic API and (responses, scores, queries) of the
        classic docs are both accepted: the scores are the argument of numbers (or 0-d / float tensors).
        Scores are checked as the trainer's own rewards are (finite, not beyond `rewards.REWARD_LIMIT`):
        ValueError naming the first bad one, before any update."""
        if not _are_scores(scores) and _are_scores(responses):  # the classic docs' step(responses, rewards, queries)
            queries, responses, scores = scores, queries, responses
        elif not _are_scores(scores):
            raise ValueError("step() takes (queries, responses, scores) or (responses, scores, queries); none of its "
                             "arguments is a list of numbers (one float or 0-d tensor per response)")
        if not (len(queries) == len(responses) == len(scores)):
            raise ValueError(f"step() got {len(queries)} queries, {len(responses)} responses and {len(scores)} scores; "
                             "give one of each per sample")
        if self.args.num_generations != 1:
            raise ValueError("step() takes one response per query: use num_generations=1")
        try:  # the checks of the trainer's own rewards: one bad score would poison every weight
            scores = check_scores(scores, "step() scores")
        except RewardError as err:
            raise ValueError(f"PPOTrainer.{err}; give one finite float (or one-element tensor) per response") from err
        sampled = getattr(self, "_sampled", {})
        if responses and isinstance(responses[0], str) and all(r in sampled for r in responses):
            responses = [sampled[r] for r in responses]
        rollout = self._rollout_from(self._ids(queries), self._ids(responses, prompts=False))
        model = self.model_wrapped if self.model_wrapped is not None else self.model
        if self.optimizer is None:
            steps = self.args.max_steps if self.args.max_steps > 0 else \
                len(self.dataloader) * int(self.args.num_train_epochs) * self.optimizer_steps_per_generation
            self.create_optimizer_and_scheduler(num_training_steps=max(steps, 1))
        self.model.train()
        micro = self.build_experience(rollout, scores)
        ga = self.args.gradient_accumulation_steps
        for i, mb in enumerate(micro):
            loss = self.compute_loss(model, mb)
            self.accelerator.backward(loss)
            self.record({"loss": loss.detach()}, "train")
            if (i + 1) % ga == 0:
                if self.args.max_grad_norm:
                    self.accelerator.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
                self.optimizer.step()
                self.lr_scheduler.step()
                self.optimizer.zero_grad()
                self.state.global_step += 1
        stats = {name: sum(v) / len(v) for name, v in self._metrics["train"].items() if v}
        self._metrics["train"].clear()
        stats.update(lr=self.lr_scheduler.get_last_lr()[0], episode=self._episodes)
        return stats

    @torch.no_grad()
    def _rollout_from(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> Rollout:
        """A Rollout for given prompts and responses: responses cut after their first stop token, old log-probs
        from one forward of the current policy."""
        tok, device = self.processing_class, self.accelerator.device
        stops = {tok.eos_token_id, *(self.args.stop_token_ids or [])}
        cut = []
        for r in response_ids:
            end = next((i + 1 for i, t in enumerate(r) if t in stops), len(r))
            cut.append(r[:end] or [tok.eos_token_id])
        lengths = torch.tensor([len(r) for r in cut])
        completion_ids = pad(cut, tok.pad_token_id)
        batch = {"prompt_ids": pad(prompt_ids, tok.pad_token_id, side="left"),
                 "prompt_mask": pad([[1] * len(p) for p in prompt_ids], 0, side="left"),
                 "completion_ids": completion_ids,
                 "completion_mask": (torch.arange(completion_ids.shape[1]) < lengths[:, None]).long()}
        batch = {k: v.to(device) for k, v in batch.items()}
        logprobs = self._no_grad_forward(self.policy, batch)
        return Rollout(**batch, logprobs=torch.where(batch["completion_mask"].bool(), logprobs, 0.0),
                       is_truncated=torch.tensor([r[-1] not in stops for r in cut]))


def _are_scores(values) -> bool:
    """Whether `values` holds one score per sample: numbers, 0-d tensors or float tensors (not texts or ids)."""
    if isinstance(values, torch.Tensor):
        return values.dim() <= 1 and values.is_floating_point()
    try:
        items = list(values)
    except TypeError:
        return False
    return bool(items) and all(isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and (
        v.dim() == 0 or v.is_floating_point())) for v in items)
