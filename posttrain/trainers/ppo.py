"""PPO for language models (Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; the
RLHF recipe of Ziegler et al. 2019 and Ouyang et al. 2022).

Each token is an action. The reward is -kl_coef * KL(pi || ref) at every token plus the
reward model's score at the last token; a critic V(s_t) gives GAE advantages (gamma, lam),
whitened; the policy minimises the clipped surrogate and the critic the clipped value loss
(vf_coef, cliprange_value), for num_ppo_epochs passes of num_mini_batches optimizer steps.

A preset of the online engine: advantage_estimator="gae", KL in the reward per token, one
completion per prompt. The critic is a value head on the policy (`CausalLMWithValueHead`) or,
when `value_model` is given, a separate sequence-classification model (`PolicyWithCritic`; a causal LM
given there becomes one with its weights and a fresh score head, with an UntrainedHeadWarning);
either way policy and critic are one module that the Trainer optimises and saves (the policy as
an ordinary checkpoint, the critic next to it).

Besides `train()`, the classic manual loop works, with token ids or with texts:

    for batch in trainer.dataloader:
        responses = trainer.generate(batch["input_ids"], max_new_tokens=16)
        rewards = [torch.tensor(my_score(r)) for r in responses]
        stats = trainer.step(batch["input_ids"], responses, rewards)
        trainer.log(stats)

and as the classic docs wrote it (`PPOTrainer(config=, model=, ref_model=, tokenizer=, dataset=)`, text
queries from an "instruction" or "query" column, `generate(texts, max_length=...)` returning texts,
`step(responses, rewards, queries)`: `step` tells its arguments' order by their types, the scores being
the numbers). The classic PPOConfig names map onto the engine: batch_size (samples per step),
mini_batch_size (samples per micro-batch), num_rollouts (total samples: total_episodes), kl_penalty
("kl" -> k1, "abs", "mse" -> k2; "full", the exact KL over the vocabulary, is refused: the engine computes
the log-probs of the sampled tokens only), init_kl_coef and adap_kl_ctrl (`core.kl.AdaptiveKLController`
with target and horizon, updated after every batch with the batch's mean summed KL; its coefficient is
saved in checkpoints). `ref_model=model` (the policy object itself) means a frozen copy of it.

Departures: `per_device_train_batch_size` counts completions; old log-probs come from the
sampler (in `train()`) or one no-grad forward (in `step()`); completions always stop at EOS.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from dataclasses import dataclass, field

import torch

from posttrain.core.kl import AdaptiveKLController, FixedKLController
from posttrain.core.masked import masked_sum
from posttrain.data.collate import pad
from posttrain.data.tokenize import encode_prompt
from posttrain.models.value_head import CausalLMWithValueHead
from posttrain.rollout.generate import Rollout
from posttrain.rollout.rewards import RewardError, check_scores
from posttrain.trainers.online import OnlineTrainer
from posttrain.trainers.online_config import ClassicOnlineConfig, estimator_help

logger = logging.getLogger(__name__)

PPO_ALIASES = [("init_kl_coef", "kl_coef"), ("kl_coef", "beta"), ("ppo_epochs", "num_ppo_epochs"), ("response_length", "max_completion_length"),
               ("num_ppo_epochs", "num_iterations"), ("cliprange", "epsilon")]
# classic kl_penalty names -> core.kl estimators ("full" has none: see the module docstring)
CLASSIC_KL_PENALTY = {"kl": "k1", "abs": "abs", "mse": "k2"}


@dataclass
class PPOConfig(ClassicOnlineConfig):
    """PPO's configuration: classic PPO fields and defaults, GRPO-style aliases."""

    _aliases = PPO_ALIASES
    num_generations: int = field(default=1, metadata={"help": "Completions per prompt."})
    token_level_kl: bool = field(default=True, metadata={"help": "A KL penalty at every token."})
    advantage_estimator: str = field(default="gae", metadata={"help": estimator_help(
        "PPO's is 'gae' (it needs the critic).")})
    loss_type: str = field(default="token_mean", metadata={"help": "Loss aggregation (see OnlineConfig)."})
    # ---- classic PPOConfig names
    batch_size: int | None = field(default=None, metadata={"help": "Classic: samples per PPO step (one rollout "
                                   "batch, the manual loop's dataloader batch). Sets per_device_train_batch_size = "
                                   "mini_batch_size and num_mini_batches = batch_size / (mini_batch_size * "
                                   "gradient_accumulation_steps)."})
    mini_batch_size: int | None = field(default=None, metadata={"help": "Classic: samples per micro-batch (None: "
                                        "batch_size, one mini-batch)."})
    num_rollouts: int | None = field(default=None, metadata={"help": "Classic: total samples to train on (sets "
                                     "total_episodes when that is None)."})
    kl_penalty: str | None = field(default=None, metadata={"help": "Classic KL estimator name: 'kl' (k1), 'abs' "
                                   "or 'mse' (k2); sets kl_estimator. 'full' is refused (no full-vocabulary KL)."})
    init_kl_coef: float = field(default=0.05, metadata={"help": "Classic name of kl_coef; with adap_kl_ctrl, the "
                                "controller's starting coefficient."})
    ppo_epochs: int = field(default=4, metadata={"help": "Classic name of num_ppo_epochs."})
    adap_kl_ctrl: bool = field(default=False, metadata={"help": "Adapt kl_coef after every batch towards `target` "
                               "(Ziegler et al. 2019); the config's kl_coef/beta then follow the controller. The "
                               "classic default was True; posttrain's is False, a fixed kl_coef as in TRL's later "
                               "PPOTrainer."})
    target: float = field(default=6.0, metadata={"help": "adap_kl_ctrl: the KL (summed over a completion) aimed at."})
    horizon: int = field(default=10000, metadata={"help": "adap_kl_ctrl: time constant of the controller, in "
                         "samples."})

    def _check(self):
        if self.kl_penalty is not None:
            if self.kl_penalty == "full":
                raise ValueError("kl_penalty='full' (the exact KL over the whole vocabulary) is not supported: "
                                 "posttrain computes the log-probs of the sampled tokens only; use 'kl', 'abs' or "
                                 "'mse' (or kl_estimator='k3', unbiased and low-variance)")
            if self.kl_penalty not in CLASSIC_KL_PENALTY:
                raise ValueError(f"kl_penalty={self.kl_penalty!r} is unknown; choose 'kl', 'abs' or 'mse'")
            self.kl_estimator = CLASSIC_KL_PENALTY[self.kl_penalty]
        if self.batch_size is not None:
            mini, ga = self.mini_batch_size or self.batch_size, self.gradient_accumulation_steps
            if self.batch_size % (mini * ga):
                raise ValueError(f"batch_size={self.batch_size} must be a multiple of mini_batch_size * "
                                 f"gradient_accumulation_steps = {mini} * {ga}")
            self.per_device_train_batch_size, self.num_mini_batches = mini, self.batch_size // (mini * ga)
        elif self.mini_batch_size is not None:
            self.per_device_train_batch_size = self.mini_batch_size
        if self.num_rollouts is not None and self.total_episodes is None:
            self.total_episodes = self.num_rollouts
        super()._check()
        if self.adap_kl_ctrl and not (self.kl_coef > 0 and self.target > 0 and self.horizon > 0):
            raise ValueError(f"adap_kl_ctrl needs init_kl_coef (kl_coef) > 0, target > 0 and horizon > 0; got "
                             f"{self.kl_coef}, {self.target}, {self.horizon}")


class PPOTrainer(OnlineTrainer):
    """PPO on the online engine. Signature as TRL's: `PPOTrainer(args, processing_class, model, ref_model,
    reward_model, train_dataset, value_model=None, data_collator=None, eval_dataset=None, optimizers=(None, None),
    callbacks=None, peft_config=None)`; `reward_funcs` may replace or join `reward_model`. Without a reward, only
    the manual loop (`generate` / `step`) is available. `tools=`, `environment_factory=` and `rollout_func=` work
    as in GRPOTrainer (multi-turn rollouts, `rollout/multiturn.py`): the fed tool turns are out of the policy
    loss, the KL and the value loss, and GAE steps over them (the critic's value is read only where the model
    acted)."""

    config_class = PPOConfig
    prompts_required = False  # the classic manual loop (generate / step) brings its own queries
    _tag = "PPO"
    _name = "PPO"
    _citation = """@article{schulman2017proximal,
    title   = {{Proximal Policy Optimization Algorithms}},
    author  = {John Schulman and Filip Wolski and Prafulla Dhariwal and Alec Radford and Oleg Klimov},
    journal = {arXiv preprint},
    year    = 2017,
    eprint  = {arXiv:1707.06347}
}"""

    def __init__(self, args: PPOConfig | None = None, processing_class=None, model=None, ref_model=None,
                 reward_model=None, train_dataset=None, value_model=None, data_collator=None, eval_dataset=None,
                 optimizers=(None, None), callbacks=None, peft_config=None, reward_funcs=None, tools=None,
                 environment_factory=None, rollout_func=None, **classic):
        if isinstance(processing_class, torch.nn.Module):  # classic positional (config, model, ref_model, tokenizer,
            # dataset): a model where the tokenizer goes
            model, ref_model, processing_class, reward_model, train_dataset = (
                processing_class, model, ref_model, None, reward_model if train_dataset is None else train_dataset)
        args, processing_class, train_dataset, optimizers, rest = _classic_names(args, processing_class,
                                                                                 train_dataset, optimizers, classic)
        if model is None:
            raise ValueError("PPOTrainer needs model= (the policy: a causal LM or its name)")
        if ref_model is not None and (ref_model is model or ref_model is getattr(model, "policy", None)):
            # freezing the shared object would freeze the policy: the reference is a frozen copy instead
            logger.info("ref_model is the policy model itself: the reference is a frozen copy of its initial weights")
            ref_model = None
        head = model.v_head if isinstance(model, CausalLMWithValueHead) else None  # classic value-head model
        model = model.policy if head is not None else model
        funcs = [f for f in ([reward_model] + (reward_funcs if isinstance(reward_funcs, (list, tuple)) else
                                               [reward_funcs])) if f is not None]
        by_path = (args.reward_model_path if args else None) or rest.get("reward_model_path")
        # an environment's get_reward() is a reward too (OnlineTrainer adds it, or says that there is none)
        self._manual_only = not funcs and not by_path and environment_factory is None
        # None lets OnlineTrainer load reward_model_path; _no_reward stands in for a reward only the manual loop gives
        super().__init__(model, funcs or (None if by_path or environment_factory is not None else [_no_reward]),
                         args=args, train_dataset=_with_prompt(train_dataset),
                         eval_dataset=_with_prompt(eval_dataset), processing_class=processing_class,
                         callbacks=callbacks, optimizers=optimizers, peft_config=peft_config, ref_model=ref_model,
                         value_model=value_model, tools=tools, environment_factory=environment_factory,
                         rollout_func=rollout_func, **rest)  # rest: PPOConfig fields, see OnlineTrainer
        if head is not None and isinstance(self.model, CausalLMWithValueHead):
            self.model.v_head = head.to(self.args.device)  # the user's head is the critic that trains
        self.kl_ctl = (AdaptiveKLController(self.args.kl_coef, self.args.target, self.args.horizon)
                       if self.args.adap_kl_ctrl else FixedKLController(self.args.kl_coef))
        self._batch_kl = None

    # the adaptive KL coefficient is state the next batches depend on
    checkpointed = OnlineTrainer.checkpointed + ("_kl_coef",)

    @property
    def _kl_coef(self) -> float:
        return self.kl_ctl.value

    @_kl_coef.setter
    def _kl_coef(self, value: float):
        self.kl_ctl.value = value

    @torch.no_grad()
    def build_experience(self, rollout: Rollout, scores: torch.Tensor) -> list[dict]:
        """The engine's experience with the controller's current KL coefficient; the controller then moves by the
        batch's measured KL (classic TRL's order: the coefficient of a batch is fixed before it is scored)."""
        self.args.kl_coef = self.args.beta = self.kl_ctl.value
        micro = super().build_experience(rollout, scores)
        if self._batch_kl is not None:
            self.kl_ctl.update(self._batch_kl, self._batch_size)
        return micro

    def _record_rollout(self, g: dict, scores: torch.Tensor, truncated: torch.Tensor):
        super()._record_rollout(g, scores, truncated)
        self._batch_kl, self._batch_size = None, scores.shape[0]
        if "ref_logp" in g:  # k1 summed over each completion, mean over the batch (what classic TRL steered)
            self._batch_kl = float(masked_sum(g["old_logp"] - g["ref_logp"], g["loss_mask"], dim=1).mean())
        self.record({"objective/kl_coef": self.kl_ctl.value}, "train")

    def train(self, *args, **kwargs):
        if self._manual_only:
            raise ValueError("PPOTrainer.train() needs a reward: pass reward_model= or reward_funcs=, or drive the "
                             "manual loop with generate() and step(queries, responses, rewards)")
        return super().train(*args, **kwargs)

    # ------------------------------------------------------------------ the classic manual loop
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


def _classic_names(args, processing_class, train_dataset, optimizers, classic: dict):
    """The classic PPOTrainer keyword names: config (args), tokenizer (processing_class), dataset (train_dataset),
    optimizer and lr_scheduler (optimizers); the other keywords come back as `rest` (PPOConfig fields given to
    the trainer, which OnlineTrainer applies with a FutureWarning, or unknown ones, which it refuses)."""
    names = {"config": "args", "tokenizer": "processing_class", "dataset": "train_dataset",
             "optimizer": "optimizers", "lr_scheduler": "optimizers"}
    rest = {k: v for k, v in classic.items() if k not in names}
    given = {"args": args, "processing_class": processing_class, "train_dataset": train_dataset}
    for old in ("config", "tokenizer", "dataset"):
        if old in classic:
            new = names[old]
            if given[new] is not None and given[new] is not classic[old]:
                raise ValueError(f"PPOTrainer: give {new}= or its classic name {old}=, not both")
            given[new] = classic[old]
    if "optimizer" in classic or "lr_scheduler" in classic:
        optimizers = (classic.get("optimizer", optimizers[0]), classic.get("lr_scheduler", optimizers[1]))
    return given["args"], given["processing_class"], given["train_dataset"], optimizers, rest


def _with_prompt(dataset):
    """A classic dataset whose prompts are in an "instruction" or "query" text column gets them as "prompt" too
    (the other columns, that one included, still reach the manual loop's batches)."""
    from posttrain.trainers.base import as_dataset

    dataset = as_dataset(dataset)
    columns = getattr(dataset, "column_names", None)
    if columns is None or "prompt" in columns or "input_ids" in columns:
        return dataset
    source = next((c for c in ("instruction", "query") if c in columns), None)
    return dataset if source is None else dataset.add_column("prompt", list(dataset[source]))


def _no_reward(completions, **kwargs):
    raise ValueError("PPOTrainer was built without a reward: pass reward_model= or reward_funcs= to train()")
