"""PPO for language models (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; the
RLHF recipe of Ziegler et al. 2019 and Ouyang et al. 2022).

Each token is an action. The reward is -kl_coef * KL(pi || ref) at every token plus the
reward model's score at the last token; a critic V(s_t) gives GAE advantages (gamma, lam),
whitened; the policy minimises the clipped surrogate and the critic the clipped value loss
(vf_coef, cliprange_value), for num_ppo_epochs passes of num_mini_batches optimizer steps.

A preset of the online engine: advantage_estimator="gae", KL in the reward per token, one
completion per prompt. The critic is a value head on the policy (`CausalLMWithValueHead`) or,
when `value_model` is given, a separate sequence-classification model (`PolicyWithCritic`);
either way policy and critic are one module that the Trainer optimises and saves (the policy as
an ordinary checkpoint, the critic next to it).

Besides `train()`, the classic manual loop works:

    for batch in trainer.dataloader:
        responses = trainer.generate(batch["input_ids"], max_new_tokens=16)
        rewards = [torch.tensor(my_score(r)) for r in responses]
        stats = trainer.step(batch["input_ids"], responses, rewards)
        trainer.log(stats)

Departures: `per_device_train_batch_size` counts completions; old log-probs come from the
sampler (in `train()`) or one no-grad forward (in `step()`); completions always stop at EOS.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from posttrain.data.collate import pad
from posttrain.rollout.generate import Rollout
from posttrain.rollout.rewards import RewardError, check_scores
from posttrain.trainers.online import OnlineTrainer
from posttrain.trainers.rloo import ClassicOnlineConfig

PPO_ALIASES = [("kl_coef", "beta"), ("response_length", "max_completion_length"),
               ("num_ppo_epochs", "num_iterations"), ("cliprange", "epsilon")]


@dataclass
class PPOConfig(ClassicOnlineConfig):
    """PPO's configuration: classic PPO fields and defaults, GRPO-style aliases."""

    _aliases = PPO_ALIASES
    num_generations: int = field(default=1, metadata={"help": "Completions per prompt."})
    token_level_kl: bool = field(default=True, metadata={"help": "A KL penalty at every token."})
    advantage_estimator: str = field(default="gae", metadata={"help": "Advantage estimator (gae needs the critic)."})
    loss_type: str = field(default="token_mean", metadata={"help": "Loss aggregation (see OnlineConfig)."})


class PPOTrainer(OnlineTrainer):
    """PPO on the online engine. Signature as TRL's: `PPOTrainer(args, processing_class, model, ref_model,
    reward_model, train_dataset, value_model=None, data_collator=None, eval_dataset=None, optimizers=(None, None),
    callbacks=None, peft_config=None)`; `reward_funcs` may replace or join `reward_model`. Without a reward, only
    the manual loop (`generate` / `step`) is available."""

    config_class = PPOConfig
    _tag = "PPO"

    def __init__(self, args: PPOConfig | None = None, processing_class=None, model=None, ref_model=None,
                 reward_model=None, train_dataset=None, value_model=None, data_collator=None, eval_dataset=None,
                 optimizers=(None, None), callbacks=None, peft_config=None, reward_funcs=None):
        if model is None:
            raise ValueError("PPOTrainer needs model= (the policy: a causal LM or its name)")
        funcs = [f for f in ([reward_model] + (reward_funcs if isinstance(reward_funcs, (list, tuple)) else
                                               [reward_funcs])) if f is not None]
        self._manual_only = not funcs and not (args and args.reward_model_path)
        super().__init__(model, funcs or [_no_reward], args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers, peft_config=peft_config, ref_model=ref_model, value_model=value_model)

    def train(self, *args, **kwargs):
        if self._manual_only:
            raise ValueError("PPOTrainer.train() needs a reward: pass reward_model= or reward_funcs=, or drive the "
                             "manual loop with generate() and step(queries, responses, rewards)")
        return super().train(*args, **kwargs)

    # ------------------------------------------------------------------ the classic manual loop
    @property
    def dataloader(self):
        """Batches of prompts for the manual loop: "query" (text), "input_ids" (token-id tensors), other columns."""
        if getattr(self, "_manual_loader", None) is None:
            def collate(rows):
                batch = self._collate(rows)
                return {"query": batch["prompt"], "input_ids": [torch.tensor(ids) for ids in batch["prompt_ids"]],
                        **batch["columns"]}

            size = self.args.per_process_generation // self.args.num_generations
            self._manual_loader = torch.utils.data.DataLoader(self.train_dataset, batch_size=size, collate_fn=collate,
                                                              shuffle=self.args.shuffle_dataset, drop_last=True)
        return self._manual_loader

    def _ids(self, queries) -> list[list[int]]:
        tok = self.processing_class
        return [tok(q)["input_ids"] if isinstance(q, str) else torch.as_tensor(q).flatten().tolist() for q in queries]

    def generate(self, queries, return_prompt: bool = False, **generation_kwargs) -> list[torch.Tensor]:
        """One completion per query (text, token-id list or tensor); sampling settings from the config unless
        given (max_new_tokens, temperature, top_k, top_p, min_p, do_sample). Returns token-id tensors."""
        names = {f.name for f in dataclasses.fields(self.sampling)}
        unknown = set(generation_kwargs) - names
        if unknown:
            raise ValueError(f"unknown generation arguments {sorted(unknown)}; use {sorted(names)}")
        sampling = dataclasses.replace(self.sampling, num_generations=1, **generation_kwargs)
        prompt_ids = self._ids(queries)
        rollout = self.sample_completions(prompt_ids, sampling)
        out = []
        for prompt, ids, n in zip(prompt_ids, rollout.completion_ids, rollout.completion_mask.sum(1).tolist()):
            response = ids[:n].cpu()
            out.append(torch.cat([torch.tensor(prompt), response]) if return_prompt else response)
        return out

    def step(self, queries, responses, scores) -> dict[str, float]:
        """One PPO update (num_ppo_epochs x num_mini_batches optimizer steps) on given prompts, responses and
        scalar rewards; returns the averaged stats. Scores are checked as the trainer's own rewards are
        (finite, not beyond `rewards.REWARD_LIMIT`): ValueError naming the first bad one, before any update."""
        if not (len(queries) == len(responses) == len(scores)):
            raise ValueError(f"step() got {len(queries)} queries, {len(responses)} responses and {len(scores)} scores; "
                             "give one of each per sample")
        if self.args.num_generations != 1:
            raise ValueError("step() takes one response per query: use num_generations=1")
        try:  # the checks of the trainer's own rewards: one bad score would poison every weight
            scores = check_scores(scores, "step() scores")
        except RewardError as err:
            raise ValueError(f"PPOTrainer.{err}; give one finite float (or one-element tensor) per response") from err
        rollout = self._rollout_from(self._ids(queries), self._ids(responses))
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


def _no_reward(completions, **kwargs):
    raise ValueError("PPOTrainer was built without a reward: pass reward_model= or reward_funcs= to train()")
