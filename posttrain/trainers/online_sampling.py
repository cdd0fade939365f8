"""The online engine's sampling and scoring: the first phase of the loop (make experience), moved out of online.py.

* `sample_completions`: `num_generations` completions per prompt from the policy (posttrain's sampler,
  `rollout/generate.py`, or vLLM), keeping the linear outputs for replay where the trainer replays;
* `roll_out`: a batch of prompts -> a rollout: the user's `rollout_func`, the sampler, or a multi-turn rollout
  with tools / environments (`rollout/multiturn.py`);
* `sample_and_score`: rollout, decoded, scored by the reward functions (`rollout/rewards.py`), the phase that
  runs in the background with asynchronous rollouts (`online_async.py`);
* `dynamic_sampling`: DAPO's groups of differing rewards, topped up from more generation batches.

A mixin of `OnlineTrainer`; reads the trainer's args, sampler settings, scorer, tooling and accelerator.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

from posttrain.core.dynamic_sampling import informative_groups, kept_rows
from posttrain.core.shaping import normalize_then_sum
from posttrain.rollout.combine import take_rows
from posttrain.rollout.generate import Rollout, SamplingConfig, generate
from posttrain.rollout.images import text_tokenizer
from posttrain.rollout.multiturn import engine_turns, rollout_from_func
from posttrain.trainers.online_async import Sampled, gather_rows


class OnlineSampling:
    """Sampling, decoding and scoring of `OnlineTrainer`."""

    def sample_completions(self, prompt_ids: list[list[int]], sampling: SamplingConfig | None = None,
                           continue_turn=None, vision: list[dict] | None = None) -> Rollout:
        """Generate `num_generations` completions per prompt with the current policy. With the training
        sampling settings (`sampling` None) and `self.replays`, the rollout keeps the linear outputs.
        continue_turn: a multi-turn rollout's `Episodes`; vision: image prompts' processor outputs (see `generate`)."""
        tok = text_tokenizer(self.processing_class)
        if self.vllm is not None and vision is not None:
            raise ValueError("use_vllm=True does not take image prompts here: posttrain's sampler does (use_vllm=False)")
        background = getattr(self._sampling_thread, "model", None)  # the asynchronous sampler's copy, in its thread
        if self.vllm is not None:  # in the asynchronous sampler's thread, its job has synced the engine already
            if background is None and self.state.global_step != self._vllm_synced_step:  # moved since the last sync
                self.vllm.sync(self.policy)  # its weights, or its LoRA adapter alone (vllm_sync_strategy)
                self.accelerator.wait_for_everyone()  # server mode: the main process sends for all
                self._vllm_synced_step = self.state.global_step
            if continue_turn is not None:  # tools, environments: one vLLM call per turn (multiturn.engine_turns)
                return engine_turns(self.vllm.generate, prompt_ids, sampling or self.sampling, continue_turn,
                                    tok.pad_token_id, tok.eos_token_id)
            return self.vllm.generate(prompt_ids, sampling or self.sampling)
        return generate(background or self.policy, prompt_ids, sampling or self.sampling, pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id, tokenizer=tok, generator=self.generator,
                        record_linears=self.replays and sampling is None, continue_turn=continue_turn, vision=vision)

    def roll_out(self, inputs: dict, prompts: list, columns: dict, sampling: SamplingConfig | None = None,
                 mode: str = "train"):
        """(rollout, episodes or None) for a batch of prompts, `prompts` / `columns` repeated per completion.

        The user's `rollout_func(prompts, trainer)` when given (its extra fields join `columns`); else the
        sampler, multi-turn with tools or environments (each row's environment joins `columns` as
        `environments`, for `get_reward`)."""
        tok = text_tokenizer(self.processing_class)
        if self.rollout_func is not None:
            rollout, extra = rollout_from_func(self.rollout_func(prompts, self), len(prompts), tok.pad_token_id,
                                               tok.eos_token_id)
            columns.update(extra)
            return rollout, None
        if self.tooling is None:
            vision = inputs.get("vision")  # passed only with images: subclasses may override the text-only signature
            extra = {} if vision is None else {"vision": vision}
            return self.sample_completions(inputs["prompt_ids"], sampling, **extra), None
        G = (sampling or self.sampling).num_generations
        episodes, environments, prompt_ids = self.tooling.episodes(
            tok, prompts, columns, G, self.args.max_prompt_length,  # a VLM's processor: its tools may return images
            processor=self.processing_class if self.vision else None)
        if environments is not None:
            columns["environments"] = environments
            prompts[:] = episodes.prompts  # with reset()'s text: the reward functions get the prompts the model saw
        vision = inputs.get("vision")
        rollout = self.sample_completions(prompt_ids or inputs["prompt_ids"], sampling, continue_turn=episodes,
                                          **({} if vision is None else {"vision": vision}))
        self.record(episodes.metrics(lambda x: self._gather_rows(x.to(self.accelerator.device))), mode)
        return rollout, episodes

    def _record_sampled(self, sampled: Sampled):
        """Log what sampling a generation batch gave: its metrics, rewards and samples."""
        for metrics, mode in sampled.records:  # recorded while it was sampled in the background
            self.record(metrics, mode)
        self._record_rewards(sampled.per_function)
        self._keep_samples(sampled.prompts, sampled.texts, sampled.per_function, sampled.extra_columns)

    def dynamic_sampling(self, sampled: Sampled) -> tuple[Rollout, Tensor]:
        """DAPO's dynamic sampling (`core/dynamic_sampling.py`): (rollout, scores) of the groups of this generation
        batch whose rewards differ, topped up from more generation batches (`top_up_prompts`) until every process
        has a batch of them. Every process draws as many batches (the count is agreed), so collectives stay paired."""
        args, k, device = self.args, self.args.num_generations, self.accelerator.device
        needed = args.per_process_generation // k  # groups per process and generation batch
        parts, scores = [sampled.rollout], [sampled.scores]
        informative = informative_groups(sampled.scores.float().cpu(), k)
        while int(self._gather_rows(informative.sum().view(1).to(device)).min()) < needed:
            if 0 < args.max_num_gen_batches <= len(parts):
                raise ValueError(
                    f"dynamic sampling (filter_groups_enable) drew max_num_gen_batches={args.max_num_gen_batches} "
                    f"generation batches and kept {int(informative.sum())} of the {needed} prompt groups one needs "
                    f"(this process): the others' completions all got the same reward, so the task is too easy or "
                    "too hard for the policy, or the reward does not vary; raise max_num_gen_batches (<= 0: no "
                    "limit) or check the reward functions")
            more = self.sample_and_score(self._top_up_prompts())
            self._record_sampled(more)
            parts.append(more.rollout)
            scores.append(more.scores)
            informative = torch.cat([informative, informative_groups(more.scores.float().cpu(), k)])
        counts = torch.tensor([[informative.numel(), int(informative.sum())]], device=device)
        drawn, kept = self._gather_rows(counts).sum(0).tolist()  # groups over all processes
        self.record({"dynamic_sampling/gen_batches": len(parts), "dynamic_sampling/groups_drawn": drawn,
                     "dynamic_sampling/groups_dropped": drawn - kept}, "train")
        rows = kept_rows(informative, k, needed)
        scores = torch.cat(scores)
        return take_rows(parts, rows, self.processing_class.pad_token_id), scores[rows.to(scores.device)]

    @torch.no_grad()
    def sample_and_score(self, inputs: dict) -> Sampled:
        """Sample `num_generations` completions of each prompt of `inputs`, decode them and score them with the
        reward functions: the phase that runs in the background with asynchronous rollouts."""
        k = self.args.num_generations
        prompts = [p for p in inputs["prompt"] for _ in range(k)]
        columns = {key: [v for v in values for _ in range(k)] for key, values in inputs["columns"].items()}
        rollout, episodes = self.roll_out(inputs, prompts, columns)
        texts, completions, ids = self.decode(rollout, prompts, episodes)
        extra_columns = defaultdict(list)
        per_function, scores = self.reward_scorer(prompts, completions, ids, columns,
                                                  extra=self._reward_extras("train", extra_columns))
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            scores = normalize_then_sum(per_function, self.reward_scorer.weights, self.args.num_generations)
        return Sampled(rollout, scores, per_function, prompts, texts, extra_columns, records=[],
                       version=self.state.global_step)

    def _reward_extras(self, mode: str, extra_columns: dict | None = None) -> dict:
        """The keyword arguments TRL passes every reward function besides the data: the trainer state and
        two logging hooks: `log_metric(name, value)` averages a number into the logs; `log_extra(column, values)`
        (one value per completion) adds a column to this batch's completions table (log_completions), kept in
        `extra_columns`."""
        columns = defaultdict(list) if extra_columns is None else extra_columns
        return {"trainer_state": self.state, "log_metric": lambda name, value: self.record({name: float(value)}, mode),
                "log_extra": lambda column, values: columns[column].extend(values)}

    def record(self, metrics: dict, mode: str | None = None):
        """BaseTrainer.record; in the asynchronous sampler's thread, kept with the batch being sampled (as floats)
        and recorded when the batch trains."""
        kept = getattr(self._sampling_thread, "records", None)
        if kept is None:
            return super().record(metrics, mode)
        kept.append(({name: float(v.detach().float().mean()) if isinstance(v, Tensor) else float(v)
                      for name, v in metrics.items()}, mode or "train"))

    def decode(self, rollout: Rollout, prompts: list, episodes=None):
        """(texts, completions as reward functions get them (messages for chat prompts; a multi-turn
        episode's assistant turns, tool calls and tool results), token-id lists)."""
        lengths = rollout.completion_mask.sum(1).tolist()
        ids = [row[:n] for row, n in zip(rollout.completion_ids.tolist(), lengths)]
        texts = text_tokenizer(self.processing_class).batch_decode(ids, skip_special_tokens=True)
        if episodes is not None:
            return texts, episodes.completions(rollout), ids
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                       for p, t in zip(prompts, texts)]
        return texts, completions, ids

    def _gather_rows(self, x: Tensor) -> Tensor:
        """(N, ...) per process -> (processes * N, ...), per-token tensors padded to a common width."""
        if self.accelerator.num_processes == 1:
            return x
        if getattr(self._sampling_thread, "group", None) is not None:  # the asynchronous sampler's own group
            return gather_rows(x, self._sampling_thread.group)
        if x.dim() > 1:
            x = self.accelerator.pad_across_processes(x, dim=1)
        return self.accelerator.gather(x)
