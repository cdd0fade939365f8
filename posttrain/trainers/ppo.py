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

Besides `train()`, the classic manual loop works (`generate` / `step`, with token ids or texts: ppo_manual.py),
and so does the call form of the classic docs (`PPOTrainer(config=, model=, ref_model=, tokenizer=, dataset=)`:
classic_forms.py). The classic PPOConfig names map onto the engine: batch_size (samples per step),
mini_batch_size (samples per micro-batch), num_rollouts (total samples: total_episodes), kl_penalty
("kl" -> k1, "abs", "mse" -> k2; "full", the exact KL over the vocabulary, is refused: the engine computes
the log-probs of the sampled tokens only), init_kl_coef and adap_kl_ctrl (`core.kl.AdaptiveKLController`
with target and horizon, updated after every batch with the batch's mean summed KL; its coefficient is
saved in checkpoints). `ref_model=model` (the policy object itself) means a frozen copy of it.

Departures: `per_device_train_batch_size` counts completions; old log-probs come from the
sampler (in `train()`) or one no-grad forward (in `step()`); completions always stop at EOS.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from posttrain.core.kl import AdaptiveKLController, FixedKLController
from posttrain.core.masked import masked_sum
from posttrain.models.value_head import CausalLMWithValueHead
from posttrain.rollout.generate import Rollout
from posttrain.trainers.classic_forms import ppo_arguments, with_prompt
from posttrain.trainers.online import OnlineTrainer
from posttrain.trainers.online_config import ClassicOnlineConfig, estimator_help
from posttrain.trainers.ppo_manual import PPOManualLoop

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


class PPOTrainer(PPOManualLoop, OnlineTrainer):
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
        args, processing_class, model, ref_model, reward_model, train_dataset, optimizers, rest = ppo_arguments(
            args, processing_class, model, ref_model, reward_model, train_dataset, optimizers, classic)
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
                         args=args, train_dataset=with_prompt(train_dataset),
                         eval_dataset=with_prompt(eval_dataset), processing_class=processing_class,
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


def _no_reward(completions, **kwargs):
    raise ValueError("PPOTrainer was built without a reward: pass reward_model= or reward_funcs= to train()")
