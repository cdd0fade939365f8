"""The classic call forms of RLOOTrainer and PPOTrainer (TRL's older signatures), turned into the online engine's
arguments, so that rloo.py and ppo.py read as their algorithm.

* RLOO: `RLOOTrainer(config, processing_class, policy, ref_policy, reward_model, train_dataset, ...)`, positional
  or by keyword, besides the GRPO-style form; a callable `reward_model` of the classic form `f(texts)` is called
  with the decoded query + response texts (`rloo_arguments`).
* PPO: the classic docs' `PPOTrainer(config, model, ref_model, tokenizer, dataset)` positional order and the
  keyword names config=, tokenizer=, dataset=, optimizer=, lr_scheduler= (`ppo_arguments`); a dataset whose
  prompts are in an "instruction" or "query" column (`with_prompt`).

PPO's classic manual loop (`generate` / `step`) is in ppo_manual.py.
"""

from __future__ import annotations

import inspect

import torch
from transformers import TrainingArguments

from posttrain.data.tokenize import encode_prompt
from posttrain.trainers.base import as_dataset


# ---------------------------------------------------------------- RLOO
def rloo_arguments(trainer, args: tuple, kwargs: dict) -> dict:
    """The keyword arguments of `OnlineTrainer.__init__` for an RLOOTrainer called in either form: classic when the
    first positional argument is a config or a classic keyword (config, policy, ref_policy, reward_model) is given,
    else GRPO style. `trainer` is the RLOOTrainer being built (a classic callable reward decodes with its tokenizer)."""
    classic = (args and isinstance(args[0], TrainingArguments)) or any(
        k in kwargs for k in ("config", "policy", "ref_policy", "reward_model"))
    if not classic:
        kw = dict(inspect.signature(_grpo_style).bind(*args, **kwargs).arguments)
        kw.update(kw.pop("kwargs", {}))  # tokenizer=, RLOOConfig fields: OnlineTrainer takes them
        return kw
    given = inspect.signature(_classic).bind(*args, **kwargs).arguments
    if given.get("policy") is None:
        raise ValueError("the classic RLOOTrainer form needs policy= (a causal LM or its name)")
    reward = given.get("reward_model")
    if _classic_callable(reward):
        reward = _query_response_reward(reward, trainer)
    return dict(model=given["policy"], reward_funcs=reward, args=given.get("config"),
                train_dataset=given.get("train_dataset"), eval_dataset=given.get("eval_dataset"),
                processing_class=given.get("processing_class"), callbacks=given.get("callbacks"),
                optimizers=given.get("optimizers", (None, None)), peft_config=given.get("peft_config"),
                ref_model=given.get("ref_policy"), **given.get("kwargs", {}))  # tokenizer=, config fields


def _grpo_style(model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                reward_processing_classes=None, callbacks=None, optimizers=(None, None), peft_config=None,
                ref_model=None, tools=None, environment_factory=None, rollout_func=None, **kwargs):
    pass


def _classic(config=None, processing_class=None, policy=None, ref_policy=None, reward_model=None, train_dataset=None,
             data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None, peft_config=None,
             **kwargs):
    pass


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


# ---------------------------------------------------------------- PPO
def ppo_arguments(args, processing_class, model, ref_model, reward_model, train_dataset, optimizers, classic: dict):
    """PPOTrainer's arguments with the classic forms resolved: the classic docs' positional order (config, model,
    ref_model, tokenizer, dataset: a model where the tokenizer goes) and the classic keyword names. Returns
    (args, processing_class, model, ref_model, reward_model, train_dataset, optimizers, rest), `rest` the other
    keywords (PPOConfig fields given to the trainer, which OnlineTrainer applies with a FutureWarning, or unknown
    ones, which it refuses)."""
    if isinstance(processing_class, torch.nn.Module):  # classic positional: a model where the tokenizer goes
        model, ref_model, processing_class, reward_model, train_dataset = (
            processing_class, model, ref_model, None, reward_model if train_dataset is None else train_dataset)
    args, processing_class, train_dataset, optimizers, rest = _classic_names(args, processing_class, train_dataset,
                                                                             optimizers, classic)
    return args, processing_class, model, ref_model, reward_model, train_dataset, optimizers, rest


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


def with_prompt(dataset):
    """A classic dataset whose prompts are in an "instruction" or "query" text column gets them as "prompt" too
    (the other columns, that one included, still reach the manual loop's batches)."""
    dataset = as_dataset(dataset)
    columns = getattr(dataset, "column_names", None)
    if columns is None or "prompt" in columns or "input_ids" in columns:
        return dataset
    source = next((c for c in ("instruction", "query") if c in columns), None)
    return dataset if source is None else dataset.add_column("prompt", list(dataset[source]))
