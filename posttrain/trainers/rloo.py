"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE
Style Optimization for Learning from Human Feedback in LLMs"; the baseline is Kool et al. 2019).

Sample k completions per prompt; the baseline of each is the mean reward of the other k - 1,
A_i = r_i - mean_{j != i} r_j, and the whole completion is one action of a REINFORCE update
(clipped when the batch is reused, as PPO). The KL penalty to the reference policy goes into
the reward: r = score - kl_coef * sum_t KL_t.

A preset of the online engine: advantage_estimator="leave_one_out", KL in the reward,
loss_type="seq_mean_token_sum" (each sequence contributes the sum over its tokens, i.e. the
gradient of its sequence log-prob). The classic field names work (rloo_k, kl_coef,
response_length, num_ppo_epochs, num_mini_batches, cliprange, stop_token, ...) and so do the
GRPO-style ones (num_generations, beta, max_completion_length, num_iterations, epsilon); set
one of each pair.

Departures from the classic trainer: `per_device_train_batch_size` counts completions (as in
GRPO), not prompts; rows are prompt-major and each prompt's group stays on one process; the
importance ratio is per token (the classic trainer used one ratio per sequence, which only
differs once the batch is reused, num_ppo_epochs > 1); completions always stop at EOS;
`token_level_kl` gives the same advantages as the summed KL here, since the leave-one-out
advantage is one number per sequence (it matters for per-token estimators).

As in the classic trainer, `reward_clip_range` clips the scores only when `normalize_reward`
normalises them (clipping raw scores would make every score beyond the range equal, and their
advantages 0); it is a bound c ([-c, c]) or a (min, max) pair. A callable `reward_model` in the
classic form is called as the classic trainer called it: with the decoded query + response texts.
`val/clipfrac_avg` is logged as 0 (there is no critic), and the completions table has the classic
headings: query | model response | score (one "score (<reward>)" column per reward when several).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace

import torch

from transformers import TrainingArguments

from posttrain.core.shaping import RewardShaping
from posttrain.data.tokenize import encode_prompt
from posttrain.trainers.online import OnlineTrainer
from posttrain.trainers.online_config import ClassicOnlineConfig, estimator_help

# (classic name, GRPO-style name)
RLOO_ALIASES = [("rloo_k", "num_generations"), ("kl_coef", "beta"), ("response_length", "max_completion_length"),
                ("num_ppo_epochs", "num_iterations"), ("cliprange", "epsilon")]


@dataclass
class RLOOConfig(ClassicOnlineConfig):
    """RLOO's configuration: classic RLOO fields and defaults, GRPO-style aliases."""

    _aliases = RLOO_ALIASES
    rloo_k: int = field(default=2, metadata={"help": "Completions per prompt (alias: num_generations)."})
    num_generations: int = field(default=2, metadata={"help": "Alias of rloo_k."})
    reward_clip_range: float | None = field(default=10.0, metadata={"help": "With normalize_reward, clip the "
                                            "normalised scores to [-c, c] (in Python also a (min, max) pair); "
                                            "without it, scores are not clipped (as in the classic trainer)."})
    advantage_estimator: str = field(default="leave_one_out", metadata={"help": estimator_help()})
    loss_type: str = field(default="seq_mean_token_sum", metadata={"help": "Loss aggregation (see OnlineConfig)."})

    def _check(self):
        clip = self.reward_clip_range
        if isinstance(clip, (list, tuple)):
            if len(clip) != 2 or not all(isinstance(v, (int, float)) for v in clip) or clip[0] > clip[1]:
                raise ValueError(f"reward_clip_range={clip!r}: give one bound c >= 0 (clips to [-c, c]) or a "
                                 "(min, max) pair of numbers with min <= max")
            self.reward_clip_range = (float(clip[0]), float(clip[1]))
        elif clip is not None and clip < 0:
            raise ValueError(f"reward_clip_range={clip} must be >= 0 (scores are clipped to [-c, c])")
        super()._check()


def _grpo_style(model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                reward_processing_classes=None, callbacks=None, optimizers=(None, None), peft_config=None,
                ref_model=None, tools=None, environment_factory=None, rollout_func=None, **kwargs):
    pass


def _classic(config=None, processing_class=None, policy=None, ref_policy=None, reward_model=None, train_dataset=None,
             data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None, peft_config=None,
             **kwargs):
    pass


class RLOOTrainer(OnlineTrainer):
    """RLOO on the online engine. Two call forms:

    * GRPO style: `RLOOTrainer(model, reward_funcs, args=None, train_dataset=None, eval_dataset=None,
      processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
      peft_config=None)`;
    * classic: `RLOOTrainer(config, processing_class, policy, ref_policy, reward_model, train_dataset,
      data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None)`, positional or by
      keyword; the reward model may be a sequence-classification model or a callable.

    Both forms take TRL's older conventions: `tokenizer=` for processing_class, and RLOOConfig fields given to
    the trainer (set on a copy of the config with a FutureWarning naming them; see `classic_arguments`).
    """

    config_class = RLOOConfig
    _tag = "RLOO"
    _name = "RLOO"
    _citation = """@inproceedings{ahmadian2024back,
    title     = {{Back to Basics: Revisiting REINFORCE-Style Optimization for Learning from Human Feedback in LLMs}},
    author    = {Arash Ahmadian and Chris Cremer and Matthias Gall{\\'e} and Marzieh Fadaee and Julia Kreutzer
                 and Olivier Pietquin and Ahmet {\\"U}st{\\"u}n and Sara Hooker},
    booktitle = {Proceedings of the 62nd Annual Meeting of the Association for Computational Linguistics (ACL 2024)},
    year      = 2024,
    eprint    = {arXiv:2402.14740}
}"""

    def __init__(self, *args, **kwargs):
        classic = (args and isinstance(args[0], TrainingArguments)) or any(
            k in kwargs for k in ("config", "policy", "ref_policy", "reward_model"))
        if classic:
            given = inspect.signature(_classic).bind(*args, **kwargs).arguments
            if given.get("policy") is None:
                raise ValueError("the classic RLOOTrainer form needs policy= (a causal LM or its name)")
            reward = given.get("reward_model")
            if _classic_callable(reward):
                reward = _query_response_reward(reward, self)
            kw = dict(model=given["policy"], reward_funcs=reward, args=given.get("config"),
                      train_dataset=given.get("train_dataset"), eval_dataset=given.get("eval_dataset"),
                      processing_class=given.get("processing_class"), callbacks=given.get("callbacks"),
                      optimizers=given.get("optimizers", (None, None)), peft_config=given.get("peft_config"),
                      ref_model=given.get("ref_policy"), **given.get("kwargs", {}))  # tokenizer=, config fields
        else:
            kw = dict(inspect.signature(_grpo_style).bind(*args, **kwargs).arguments)
            kw.update(kw.pop("kwargs", {}))  # tokenizer=, RLOOConfig fields: OnlineTrainer takes them
        super().__init__(**kw)
        self.completions_table.headings, self.completions_table.score_heading = ("query", "model response"), "score"

    def reward_shaping(self) -> RewardShaping:
        # the classic trainer clipped the normalised scores only: raw scores beyond the range would all become equal
        shaping = super().reward_shaping()
        return shaping if self.args.normalize_reward else replace(shaping, clip_range=None)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.record({"val/clipfrac_avg": 0.0}, "train")  # the classic RLOO logged it; no critic, nothing clipped
        return result


def _classic_callable(func) -> bool:
    """A callable in the classic reward form, `f(texts)`: not a model, and naming none of the reward-function
    arguments (prompts, completions, completion_ids, **kwargs), which mark a GRPO-style reward function."""
    if not callable(func) or isinstance(func, (torch.nn.Module, str)):
        return False
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return True
    return not any(p.kind is p.VAR_KEYWORD or p.name in ("prompts", "completions", "completion_ids") for p in params)


def _query_response_reward(func, trainer):
    """A classic RLOO callable reward model as a reward function: called with the decoded query + response texts
    (one string per completion) and returning one score per text, as the classic trainer called it. The texts
    are decoded with the trainer's tokenizer, which exists once the trainer is built (hence `trainer`)."""
    def reward(prompts, completion_ids, **kwargs):
        tok = trainer.processing_class
        queries = [p if isinstance(p, str) else tok.decode(encode_prompt(tok, p), skip_special_tokens=True)
                   for p in prompts]
        responses = tok.batch_decode(completion_ids, skip_special_tokens=True)
        return func([q + r for q, r in zip(queries, responses)])

    reward.__name__ = getattr(func, "__name__", type(func).__name__)
    return reward
