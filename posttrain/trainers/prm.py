"""Process reward models (Uesato et al. 2022, "Solving math word problems with process- and outcome-based
feedback"; Lightman et al. 2023, "Let's Verify Step by Step").

A process reward model (PRM) scores each step of a solution, not only its outcome. It is a token
classifier with two labels: the solution's steps are joined, each followed by `step_separator`, and the
token that ends a step (its separator's last token) is labelled with the step's correctness (1 correct,
0 not); every other token is -100 and not trained (`core.process_rewards.step_loss`). Rows are TRL's
stepwise supervision: `prompt` (a string), `completions` (the steps, strings) and `labels` (one bool per
step). With `train_on_last_step_only` only the last step of each training row is labelled (evaluation
rows keep every label).

A causal LM given as the model gets a fresh two-way token-classification head on its body. Scoring an
online trainer's completions with the trained PRM, step by step: `posttrain.rollout.process_rewards`.

Departures: `max_prompt_length` keeps the prompt's last tokens (TRL's config has the field but its
tokenisation does not read it); rows whose truncation leaves no labelled step are dropped, with a count
in the log; the step accuracy is logged for training batches too (`accuracy`), not only at evaluation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.core.process_rewards import IGNORE, step_accuracy, step_loss
from posttrain.data.collate import pad
from posttrain.data.tokenize import encode_steps
from posttrain.data.formats import FormatError
from posttrain.models.loading import peft_for_task
from posttrain.models.modes import disable_dropout
from posttrain.trainers.base import BaseConfig, BaseTrainer, as_dataset, classic_arguments, is_streamed, map_datasets

logger = logging.getLogger(__name__)


@dataclass
class PRMConfig(BaseConfig):
    """Configuration of `PRMTrainer`, on top of `transformers.TrainingArguments`."""

    learning_rate: float = field(default=1e-5, metadata={"help": "Peak learning rate (AdamW)."})
    max_length: int | None = field(default=1024, metadata={
        "help": "Keep the first this many tokens of prompt + steps (None: no limit)."})
    max_prompt_length: int | None = field(default=512, metadata={
        "help": "Keep the last this many prompt tokens (None: no limit)."})
    max_completion_length: int | None = field(default=None, metadata={
        "help": "Keep the first this many tokens of the joined steps (None: no limit)."})
    disable_dropout: bool = field(default=True, metadata={"help": "Set every dropout probability of the model to 0."})
    step_separator: str = field(default="\n", metadata={
        "help": "Text after each step; its last token carries the step's label."})
    train_on_last_step_only: bool = field(default=False, metadata={
        "help": "Label only the last step of each training row (evaluation rows keep every step's label)."})

    def _check(self):
        for name in ("max_length", "max_prompt_length", "max_completion_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive number of tokens or None (no limit), got {value}")
        if not self.step_separator:
            raise ValueError("step_separator must be a non-empty string: its last token carries each step's label")


def _check_row(row: dict, i, name: str) -> None:
    prompt, steps, labels = row.get("prompt"), row.get("completions"), row.get("labels")
    where = f"{name} data, row {i}"
    if not isinstance(prompt, str):
        raise FormatError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
    if not isinstance(steps, (list, tuple)) or not steps or not all(isinstance(s, str) for s in steps):
        raise FormatError(f"{where}: 'completions' must be a non-empty list of step strings")
    if not isinstance(labels, (list, tuple)) or not all(isinstance(x, bool) for x in labels):
        raise FormatError(f"{where}: 'labels' must be a list of bools, one per step")
    if len(labels) != len(steps):
        raise FormatError(f"{where}: {len(steps)} steps in 'completions' but {len(labels)} 'labels'")


def prepare_stepwise_dataset(dataset, tokenizer, args: PRMConfig, *, is_eval: bool = False, name: str = "train"):
    """Validate and tokenise stepwise rows (`data.tokenize.encode_steps`); already tokenised data (`input_ids`
    and `labels`) passes as it is. A streamed dataset is tokenised lazily as rows are read."""
    dataset = as_dataset(dataset, name)
    columns = dataset.column_names or list(next(iter(dataset)))
    if {"input_ids", "labels"} <= set(columns):
        return dataset
    missing = [c for c in ("prompt", "completions", "labels") if c not in columns]
    if missing:
        raise FormatError(f"{name} data has no {missing} column(s): a process reward model trains on stepwise "
                          "supervision, rows with 'prompt', 'completions' (a list of steps) and 'labels' (a bool "
                          "per step)")
    limits = dict(step_separator=args.step_separator, max_length=args.max_length,
                  max_prompt_length=args.max_prompt_length, max_completion_length=args.max_completion_length,
                  last_step_only=args.train_on_last_step_only and not is_eval)

    def encode(row: dict, i: int) -> dict:
        _check_row(row, i, name)
        return encode_steps(tokenizer, row["prompt"], row["completions"], row["labels"], **limits)

    from datasets import Features, Sequence, Value

    # the output types given: inferred from the input, the new `labels` would be cast to its bools
    types = Features({"input_ids": Sequence(Value("int64")), "labels": Sequence(Value("int64"))})
    encoded = dataset.map(encode, with_indices=True, remove_columns=columns, features=types)
    if is_streamed(encoded):
        return encoded
    before = len(encoded)
    encoded = encoded.filter(lambda labels: any(y != IGNORE for y in labels), input_columns="labels")
    if len(encoded) < before:
        logger.warning(f"{name} data: dropped {before - len(encoded)} of {before} rows whose truncation to "
                       f"max_length={args.max_length}, max_prompt_length={args.max_prompt_length}, "
                       f"max_completion_length={args.max_completion_length} left no labelled step")
    if len(encoded) == 0:
        raise ValueError(f"no {name} rows are left: truncation removed every labelled step (raise max_length)")
    return encoded


class StepCollator:
    """Rows of input_ids and labels -> right-padded input_ids, attention_mask and labels (B, T), labels -100
    on padding."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, Tensor]:
        ids = [list(r["input_ids"]) for r in rows]
        return {"input_ids": pad(ids, self.pad_token_id), "attention_mask": pad([[1] * len(x) for x in ids], 0),
                "labels": pad([list(r["labels"]) for r in rows], IGNORE)}


class PRMTrainer(BaseTrainer):
    """Stepwise supervision -> a process reward model (a two-label token classifier)."""

    _tag = "prm"
    _name = "PRM"
    _citation = """@article{uesato2022solving,
    title   = {{Solving Math Word Problems With Process- and Outcome-Based Feedback}},
    author  = {Jonathan Uesato and Nate Kushman and Ramana Kumar and Francis Song and Noah Siegel and Lisa Wang
               and Antonia Creswell and Geoffrey Irving and Irina Higgins},
    journal = {arXiv preprint arXiv:2211.14275},
    year    = 2022
}"""

    def __init__(self, model=None, args: PRMConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, model_init=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), preprocess_logits_for_metrics=None, peft_config=None, **kwargs):
        args, processing_class = classic_arguments("PRMTrainer", PRMConfig, args, processing_class, kwargs)
        if model_init is not None:
            raise ValueError("PRMTrainer: model_init is not supported; pass the model (an object or a name) as model=")
        if train_dataset is None:
            raise ValueError("PRMTrainer needs a train_dataset of stepwise supervision rows")
        from posttrain.models import loading

        trust = (args.model_init_kwargs or {}).get("trust_remote_code", False)
        tokenizer = loading.load_tokenizer(processing_class, model=model, trust_remote_code=trust)
        train_dataset = prepare_stepwise_dataset(train_dataset, tokenizer, args)
        self._tokenizer_for_eval, self._config_for_eval = tokenizer, args
        eval_dataset = map_datasets(self.prepare_eval_dataset, as_dataset(eval_dataset, "eval_dataset"), name="eval")
        super().__init__(model, args, processing_class=tokenizer, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, data_collator=data_collator or StepCollator(tokenizer.pad_token_id),
                         peft_config=peft_for_task(peft_config, "TOKEN_CLS", "a process reward model is a token "
                                                   "classifier"),
                         callbacks=callbacks, optimizers=optimizers, model_kind="token-cls",
                         compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        if args.disable_dropout:
            disable_dropout(self.model)

    def prepare_eval_dataset(self, dataset, name: str = "eval"):
        return prepare_stepwise_dataset(dataset, self._tokenizer_for_eval, self._config_for_eval, is_eval=True,
                                        name=name)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        labels = inputs["labels"]
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False).logits
        loss = step_loss(logits, labels)
        right, total = step_accuracy(logits, labels)
        counts = self.accelerator.gather(torch.tensor([right, total], device=logits.device).reshape(1, 2)).sum(0)
        if counts[1] > 0:
            self.record({"accuracy": float(counts[0] / counts[1])}, mode)
        return (loss, {"logits": logits}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """(loss, logits (B, T, 2), labels (B, T)) for a `compute_metrics`; the loss alone otherwise."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        if prediction_loss_only or self.compute_metrics is None:
            return loss.detach(), None, None
        return loss.detach(), outputs["logits"].detach(), inputs["labels"]
