"""Supervised fine-tuning (SFT): maximise the likelihood of demonstration tokens.

The loss is token-level cross-entropy, -log pi(y_t | y_<t), averaged over every loss token of
the global batch (all gradient-accumulation micro-batches and processes), so how a batch is
split does not change the update. Which tokens count:

* language modeling data (``text`` or ``messages``): every token, or with
  ``assistant_only_loss`` only what assistant turns say (read from the chat template's
  ``{% generation %}`` markers);
* prompt-completion data: the completion only (``completion_only_loss``, on by default), or the
  whole sequence.

Any dataset ``posttrain.data.formats.to_canonical`` can turn into one of those is accepted
(instruction rows, preference rows (their chosen completion), ...), as are datasets that are
already tokenised (an ``input_ids`` column, optionally ``completion_mask`` / ``assistant_masks``).

Departures from the usual recipe, all for speed and none changing the objective:
* logits are computed only at positions whose next token is a target (``logits_to_keep`` as a
  boolean mask), so prompts and padding never reach the vocabulary projection;
* packing (best-fit decreasing or wrapped) with position ids restarting per sequence: packed
  sequences never attend to each other, so packed and unpacked training give the same loss.
  Without flash attention a packed batch stays one bin per row (attention costs B * L^2, not
  the (B * L)^2 of one flattened row); `padding_free=True` flattens it anyway;
* the vocabulary projection is fused with the loss (`linear_selective_log_softmax`): the model
  returns its final hidden states, and log-probs, entropy and accuracy come from one pass over
  the logits computed a vocabulary block at a time, whose backward feeds each block's gradient
  straight to the matmuls (no (N, V) softmax, gradient or temporaries). Used when the model's
  logits are exactly `lm_head(last hidden state)` (checked once on a few tokens); otherwise the
  model computes the kept logits and `selective_log_softmax_stats` takes them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from posttrain.core.logprobs import linear_selective_log_softmax, plain_lm_head, selective_log_softmax_stats
from posttrain.data import formats
from posttrain.data.collate import IGNORE_INDEX, LanguageModelingCollator
from posttrain.data.packing import STRATEGIES, pack_dataset
from posttrain.data.tokenize import TokenizeError, encode_prompt_completion, encode_text
from posttrain.models import loading
from posttrain.trainers.base import BaseConfig, BaseTrainer, check_train_dataset, seed_run


@dataclass
class SFTConfig(BaseConfig):
    """Configuration of `SFTTrainer`; every `transformers.TrainingArguments` field applies too."""

    learning_rate: float = field(default=2e-5, metadata={"help": "Initial AdamW learning rate."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Sequences are cut to this many tokens (the bin size when packing). "
                                        "None: no truncation."})
    dataset_text_field: str = field(
        default="text", metadata={"help": "Column holding the text of language-modeling rows."})
    packing: bool = field(
        default=False, metadata={"help": "Pack several sequences into each row of `max_length` tokens."})
    packing_strategy: str = field(
        default="bfd", metadata={"help": "'bfd': best-fit decreasing, whole sequences (cut to max_length) per bin; "
                                         "'wrapped': concatenate everything and cut every max_length tokens."})
    padding_free: bool | None = field(
        default=None, metadata={"help": "Flatten each batch into one row with no padding, sequences told apart by "
                                        "restarting position_ids. None: True when packing with a flash-attention "
                                        "model (varlen kernels), else False; packed data without it is one bin per "
                                        "row, also with restarting position_ids, so attention costs B*L^2 instead of "
                                        "(B*L)^2 under sdpa/eager."})
    completion_only_loss: bool | None = field(
        default=None, metadata={"help": "Loss on completion tokens only, for prompt-completion data. "
                                        "None: on for prompt-completion data."})
    assistant_only_loss: bool = field(
        default=False, metadata={"help": "Loss only on assistant turns of conversational data (needs a chat "
                                         "template with {% generation %} markers)."})
    dataset_num_proc: int | None = field(
        default=None, metadata={"help": "Processes for tokenising the dataset (None: in this process)."})
    eval_packing: bool | None = field(
        default=None, metadata={"help": "Pack the eval dataset too. None: same as `packing`."})

    def __post_init__(self):
        if self.eval_packing is None:
            self.eval_packing = self.packing
        super().__post_init__()

    def _check(self):
        if self.packing_strategy not in STRATEGIES:
            raise ValueError(f"packing_strategy={self.packing_strategy!r}: choose one of {STRATEGIES}")
        if (self.packing or self.eval_packing) and self.max_length is None:
            raise ValueError("packing needs max_length (the size of a packed row); set max_length or packing=False")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length={self.max_length}: need at least 2 tokens (a context and a target)")


class SFTTrainer(BaseTrainer):
    """Supervised fine-tuning on demonstrations; see the module docstring."""

    _tag = "sft"

    def __init__(self, model, args: SFTConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, peft_config=None, callbacks=None,
                 optimizers=(None, None), formatting_func=None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = SFTConfig(output_dir=f"{name.rstrip('/').split('/')[-1]}-SFT")
        elif not isinstance(args, SFTConfig):
            raise TypeError(f"args must be an SFTConfig, got {type(args).__name__}")
        check_train_dataset(train_dataset)
        seed_run(args)
        model = loading.load_causal_lm(model, **(args.model_init_kwargs or {}))
        tokenizer = loading.load_tokenizer(processing_class, model=model)
        prepare = lambda data, pack: self.prepare_dataset(data, tokenizer, args, pack, formatting_func)  # noqa: E731
        if train_dataset is not None:
            train_dataset = prepare(train_dataset, args.packing)
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: prepare(v, args.eval_packing) for k, v in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = prepare(eval_dataset, args.eval_packing)
        if args.padding_free is None:  # one flat row only pays off with varlen (flash) attention kernels
            attention = str(getattr(model.config, "_attn_implementation", "") or "")
            args.padding_free = bool(args.packing and "flash" in attention)
        if data_collator is None:
            data_collator = LanguageModelingCollator(tokenizer.pad_token_id, padding_free=args.padding_free)
        super().__init__(model, args, processing_class=tokenizer, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, data_collator=data_collator, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers, **kwargs)
        # Our loss always divides by the global count of target tokens, which Trainer only counts
        # (as num_items_in_batch) when it believes the model takes loss kwargs.
        self.model_accepts_loss_kwargs = True
        self._num_tokens = 0
        base = self.model.get_base_model() if loading.is_peft_model(self.model) else self.model
        self._logits_to_keep_mask = "logits_to_keep" in inspect.signature(base.forward).parameters
        self._fuse_head = self._logits_to_keep_mask  # fuse the output layer into the loss where it is plain

    # ------------------------------------------------------------------ data
    @staticmethod
    def prepare_dataset(dataset, tokenizer, args: SFTConfig, packing: bool, formatting_func=None):
        """Rows in any SFT format -> tokenised rows {input_ids, loss_mask} (packed when asked)."""
        columns = dataset.column_names
        if "input_ids" in columns:  # already tokenised
            mask_column = next((c for c in ("loss_mask", "completion_mask", "assistant_masks") if c in columns), None)
            dataset = dataset.map(lambda row: {"loss_mask": row[mask_column] if mask_column else
                                               [1] * len(row["input_ids"])},
                                  remove_columns=[c for c in columns if c != "input_ids"])
        else:
            if formatting_func is not None:
                dataset = dataset.map(lambda row: {"text": formatting_func(row)}, remove_columns=columns)
            elif args.dataset_text_field != "text" and args.dataset_text_field in columns:
                dataset = dataset.rename_column(args.dataset_text_field, "text")
            dataset = SFTTrainer._tokenize(dataset, tokenizer, args, truncate=not (packing and
                                                                                   args.packing_strategy == "wrapped"))
        if packing:
            return pack_dataset(dataset, args.max_length, args.packing_strategy)
        if args.max_length is not None:
            dataset = dataset.map(lambda row: {k: row[k][: args.max_length] for k in ("input_ids", "loss_mask")})
        return dataset

    @staticmethod
    def _tokenize(dataset, tokenizer, args: SFTConfig, truncate: bool):
        info = formats.validate(dataset)
        if info.name not in ("language_modeling", "prompt_completion"):
            dataset, info = formats.to_canonical(dataset, target="prompt_completion")
        if info.conversational:
            loading.require_chat_template(tokenizer)
        max_length = args.max_length if truncate else None
        completion_only = args.completion_only_loss is not False
        assistant_only = args.assistant_only_loss
        if assistant_only and not info.conversational:
            raise formats.FormatError(
                "assistant_only_loss=True needs conversational data (message lists), but the dataset is made "
                "of plain strings; set assistant_only_loss=False or use completion_only_loss with "
                "prompt-completion rows")

        def encode(row, i):
            try:
                if info.name == "language_modeling":
                    out = encode_text(tokenizer, row["messages"] if info.conversational else row["text"],
                                      assistant_only=assistant_only, tools=row.get("tools"))
                    return {"input_ids": out["input_ids"], "loss_mask": out["loss_mask"]}
                out = encode_prompt_completion(tokenizer, row["prompt"], row["completion"], max_length, row=i,
                                               tools=row.get("tools"))
                n_prompt, n_completion = len(out["prompt_ids"]), len(out["completion_ids"])
                ids = out["prompt_ids"] + out["completion_ids"]
                mask = [0] * n_prompt + [1] * n_completion if completion_only else [1] * len(ids)
                if assistant_only:
                    full = encode_text(tokenizer, list(row["prompt"]) + list(row["completion"]), assistant_only=True,
                                       tools=row.get("tools"))
                    mask = [m & a for m, a in zip(mask, full["loss_mask"])]
                return {"input_ids": ids, "loss_mask": mask}
            except TokenizeError as err:
                message = str(err) if str(err).startswith("row ") else f"row {i}: {err}"
                raise TokenizeError(message) from None

        return dataset.map(encode, with_indices=True, remove_columns=dataset.column_names,
                           num_proc=args.dataset_num_proc, desc="tokenizing")

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]  # (B, T), IGNORE_INDEX where no loss
        targets = torch.full_like(labels, IGNORE_INDEX)
        targets[:, :-1] = labels[:, 1:]  # targets[:, t] is predicted by the logits at t
        keep = targets != IGNORE_INDEX  # (B, T)
        model_inputs = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
        head = None
        if self._fuse_head and not return_outputs:
            head = plain_lm_head(self.accelerator.unwrap_model(model), inputs["input_ids"])
        if head is not None:  # the model stops at its hidden states; the output layer is fused into the loss
            outputs = model(**model_inputs, logits_to_keep=torch.zeros_like(keep), output_hidden_states=True,
                            use_cache=False)
        elif self._logits_to_keep_mask:  # the vocabulary projection only where there is a target: (N, V)
            outputs = model(**model_inputs, logits_to_keep=keep, use_cache=False)
            logits = outputs.logits
        else:
            outputs = model(**model_inputs, use_cache=False)
            logits = outputs.logits[keep]
        targets = targets[keep]  # (N,)
        if head is not None:  # (N,) each; one pass over the logits, a vocabulary block at a time
            logps, entropy, argmax = linear_selective_log_softmax(outputs.hidden_states[-1][keep], head.weight,
                                                                  targets, with_stats=True)
            logits = None
        else:
            logps, entropy, argmax = selective_log_softmax_stats(logits, targets)  # (N,) each; one pass over logits
        denominator = num_items_in_batch if num_items_in_batch is not None else keep.sum().clamp(min=1)
        loss = -logps.sum() / denominator
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over processes

        mode = "train" if model.training else "eval"
        if mode == "train":  # tokens fed to the model (packed rows: including the few pads after the last bin)
            mask = inputs.get("attention_mask")
            self._num_tokens += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        if targets.numel():
            self.record({"entropy": entropy.mean(), "mean_token_accuracy": (argmax == targets).float().mean()}, mode)
        outputs.logits = logits
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if not any(k.startswith("eval_") for k in logs):
            total = torch.tensor(self._num_tokens, device=self.args.device)
            logs["num_tokens"] = float(self.accelerator.gather_for_metrics(total.reshape(1)).sum())
        super().log(logs, start_time)
