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
(instruction rows, ShareGPT ``conversations``, preference rows (their chosen completion), ...),
as are datasets that are already tokenised (an ``input_ids`` column, optionally
``completion_mask`` / ``assistant_masks``), and streamed ones (``IterableDataset``, tokenised as
rows are read; ``max_steps`` required).

``loss_type`` picks the per-token loss: ``nll`` (cross-entropy) or ``dft`` (Dynamic
Fine-Tuning, Wu et al. 2025, https://arxiv.org/abs/2508.05629: each token's NLL weighted by its
own probability, detached, -p(y_t) log p(y_t)). Mixture-of-experts models whose config sets
``output_router_logits`` add ``router_aux_loss_coef`` times their load-balancing loss.

Departures from the usual recipe, all for speed and none changing the objective:
* logits are computed only at positions whose next token is a target (``logits_to_keep`` as a
  boolean mask), so prompts and padding never reach the vocabulary projection;
* packing (best-fit decreasing or wrapped) with position ids restarting per sequence: packed
  sequences never attend to each other, so packed and unpacked training give the same loss.
  Without flash attention a packed batch stays one bin per row; `padding_free=True` flattens it
  anyway;
* under sdpa, rows that hold several sequences use document attention
  (`accel.document_attention`): each sequence attends causally to itself only, computed on its
  own, so attention costs the sum of the sequences' squared lengths instead of a dense
  block-diagonal mask over the row (the model's config names it "posttrain_sdpa"; without
  sequence boundaries it is sdpa unchanged);
* unpacked batches under sdpa or eager attention (`padding_free=None`) are flattened one by one
  into a single row of their real tokens, with restarting position ids, where that costs less
  than the padded rows (`flat_is_cheaper`: fewer tokens through the layers; under eager
  attention, against (sum of lengths)^2 pairs of a dense mask instead of B * L^2). Under sdpa
  (document attention) every batch with padding flattens. Targets, the loss
  denominator and every metric are those of the padded batch; a model that does not keep
  sequences apart by their position ids (checked once) stays padded;
* the vocabulary projection is fused with the loss (`linear_selective_log_softmax`): the model
  returns its final hidden states, and log-probs, entropy and accuracy come from one pass over
  the logits computed a vocabulary block at a time, whose backward feeds each block's gradient
  straight to the matmuls (no (N, V) softmax, gradient or temporaries). Used when the model's
  logits are exactly `lm_head(last hidden state)` (checked once on a few tokens); otherwise the
  model computes the kept logits and `selective_log_softmax_stats` takes them.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import IterableDataset
from transformers import TrainingArguments

from posttrain.accel import document_attention
from posttrain.core.log_softmax import selective_log_softmax_stats
from posttrain.core.sft_losses import SFT_LOSSES as LOSSES  # loss_type -> per-token loss
from posttrain.data import formats, multimodal
from posttrain.data.chat import load_chat_template, require_chat_template, template_variables
from posttrain.data.collate import IGNORE_INDEX, MASK_COLUMNS, LanguageModelingCollator, flatten_padded
from posttrain.data.packing import STRATEGIES, pack_dataset, pack_rows
from posttrain.data.tokenize import TokenizeError, encode_sft_row
from posttrain.data.vision_collate import VisionLanguageModelingCollator
from posttrain.forward.logprobs import attention_kind, linear_selective_log_softmax, plain_lm_head
from posttrain.models import compat, loading
from posttrain.models.modes import eval_mode
from posttrain.models.offloading import OffloadActivations
from posttrain.models.vision import vision_run
from posttrain.trainers.base import (EVAL_SET, BaseConfig, BaseTrainer, as_dataset, check_datasets,
                                     classic_arguments, errors_named, map_datasets, seed_run)

logger = logging.getLogger(__name__)

DATASET_KWARGS = ("skip_prepare_dataset",)  # the `dataset_kwargs` keys SFT reads
STREAM_PACK_ROWS = 1000  # a streamed dataset is packed this many rows at a time (bins never see further)


@dataclass
class SFTConfig(BaseConfig):
    """Configuration of `SFTTrainer`; every `transformers.TrainingArguments` field applies too."""

    learning_rate: float = field(default=2e-5, metadata={"help": "Initial AdamW learning rate."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Sequences are cut to this many tokens (the bin size when packing). "
                                        "None: no truncation."})
    max_seq_length: int | None = field(
        default=None, metadata={"help": "Deprecated: the classic TRL name of `max_length`, copied into it with a "
                                        "FutureWarning (both set to different values is an error)."})
    dataset_text_field: str = field(
        default="text", metadata={"help": "Column holding the text of language-modeling rows."})
    packing: bool = field(
        default=False, metadata={"help": "Pack several sequences into each row of `max_length` tokens."})
    packing_strategy: str = field(
        default="bfd", metadata={"help": "'bfd': best-fit decreasing, whole sequences (cut to max_length) per bin; "
                                         "'wrapped': concatenate everything and cut every max_length tokens."})
    padding_free: bool | None = field(
        default=None, metadata={"help": "Flatten each batch into one row with no padding, sequences told apart by "
                                        "restarting position_ids. None: packed data is flattened with a "
                                        "flash-attention model (varlen kernels), else one bin per row (attention "
                                        "B*L^2, not (B*L)^2); unpacked data under sdpa/eager is flattened batch by "
                                        "batch where a cost model finds it cheaper than padding (same loss; under sdpa, "
                                        "whose rows of several sequences use document attention, whenever there is "
                                        "padding), and "
                                        "kept padded under other attention implementations."})
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
    loss_type: str = field(
        default="nll", metadata={"help": "Per-token loss: 'nll' (cross-entropy) or 'dft' (Dynamic Fine-Tuning: "
                                         "each token's NLL times its detached probability, arXiv:2508.05629)."})
    chat_template_path: str | None = field(
        default=None, metadata={"help": "Chat template to use instead of the tokenizer's: a Jinja file, or a "
                                        "tokenizer folder whose template is taken (with the special tokens it "
                                        "writes, added to the tokenizer and the model's embeddings)."})
    chat_template_kwargs: dict[str, Any] | None = field(
        default=None, metadata={"help": "Extra variables for every chat-template call (e.g. "
                                        "{'enable_thinking': False}); a row's own `chat_template_kwargs` column "
                                        "adds to them and wins."})
    activation_offloading: bool = field(
        default=False, metadata={"help": "Keep the activations saved for the backward pass in CPU memory until "
                                         "backward needs them (saved-tensor hooks), saving accelerator memory for "
                                         "transfer time. A model on the CPU has nothing to move."})
    dataset_kwargs: dict[str, Any] | None = field(
        default=None, metadata={"help": "TRL's dataset options. {'skip_prepare_dataset': True}: the datasets are "
                                        "already tokenised (`input_ids`, optionally `loss_mask`, `completion_mask` "
                                        "or `assistant_masks`) and are used as they are."})

    def __post_init__(self):
        if self.eval_packing is None:
            self.eval_packing = self.packing
        if self.max_seq_length is not None:
            if self.max_length not in (self.max_seq_length, SFTConfig.max_length):
                raise ValueError(f"max_seq_length={self.max_seq_length} and max_length={self.max_length} disagree; "
                                 "max_seq_length is the old name of max_length: set max_length only")
            warnings.warn("max_seq_length is deprecated: it is the old name of max_length; set max_length instead",
                          FutureWarning, stacklevel=3)
            self.max_length = self.max_seq_length
        super().__post_init__()

    def _check(self):
        if self.loss_type not in LOSSES:
            raise ValueError(f"loss_type={self.loss_type!r}: choose one of {sorted(LOSSES)}")
        if unknown := sorted(set(self.dataset_kwargs or {}) - set(DATASET_KWARGS)):
            raise ValueError(f"dataset_kwargs has unknown key(s) {unknown}; SFT reads {list(DATASET_KWARGS)} "
                             "(e.g. {'skip_prepare_dataset': True} for datasets already tokenised)")
        if self.packing_strategy not in STRATEGIES:
            raise ValueError(f"packing_strategy={self.packing_strategy!r}: choose one of {STRATEGIES}")
        if (self.packing or self.eval_packing) and self.max_length is None:
            raise ValueError("packing needs max_length (the size of a packed row); set max_length or packing=False")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length={self.max_length}: need at least 2 tokens (a context and a target)")


def flat_is_cheaper(lengths: list[int], width: int, hidden: int, documents: bool = False) -> bool:
    """Whether rows of these lengths cost less as one flat row than padded to `width`. Cost in token-forwards:
    a token through the layers is 1, a (query, key) pair 1 / (4 hidden); padded rows pay B*T of the first and
    B*T^2 of the second. The flat row pays N of the first, and under attention with a dense mask N^2 of the
    second (its block-diagonal mask is dense to the kernel), under document attention (`documents`,
    `accel.document_attention`) only sum(length^2): then it is cheaper whenever it drops padding. The FLOPs
    alone give 1 / (6 hidden) per pair; CPU sdpa's forward + backward on SmolLM2-135M measured 1 / (4.7 hidden).
    A batch without padding takes sdpa's mask-free causal path."""
    def cost(rows: int, length: int) -> float:
        return rows * length * (1 + length / (4 * hidden))

    n = sum(lengths)
    flat = sum(cost(1, length) for length in lengths) if documents else cost(1, n)
    return n < len(lengths) * width and flat < cost(len(lengths), width)


def rows_kept_apart(model, input_ids: torch.Tensor) -> bool:
    """Whether `model` keeps two sequences that share one row apart, told by restarting position_ids and no
    attention mask (transformers' own models do under sdpa and eager; a model with its own mask code may not):
    two 4-token pieces of `input_ids` (its first 8 tokens, repeated if fewer) as one row must give the logits
    they give as two rows, far closer than the same row without the restart does. Eval mode, no grad, 3 forwards
    of 8 tokens."""
    ids = input_ids.reshape(-1)[:8]
    if not ids.numel():
        return False
    ids = ids.repeat(-(-8 // ids.numel()))[:8]
    restart = torch.arange(4, device=ids.device).repeat(2)[None]
    with eval_mode(model), torch.no_grad():
        apart = model(input_ids=ids.view(2, 4), use_cache=False).logits[1].float()
        one_row = model(input_ids=ids[None], position_ids=restart, use_cache=False).logits[0, 4:].float()
        run_on = model(input_ids=ids[None], use_cache=False).logits[0, 4:].float()
    return bool((one_row - apart).abs().max() < 0.1 * (run_on - apart).abs().max())


def _column_names(dataset) -> list[str]:
    """Column names; a streamed dataset whose features are unknown shows them in its first row."""
    names = getattr(dataset, "column_names", None)
    if names is None and isinstance(dataset, IterableDataset):
        names = list(next(iter(dataset), {}))
    return list(names or [])


def _holds_images(feature) -> bool:
    from datasets import Image

    inner = getattr(feature, "feature", None)  # a list / sequence of images
    return isinstance(feature, Image) or (inner is not None and _holds_images(inner))


def _refuse_images(dataset, columns: list[str]) -> None:
    """SFT here trains text-only models: an image column would otherwise be dropped without a word."""
    features = getattr(dataset, "features", None) or {}
    for column in columns:
        if column in ("image", "images") or _holds_images(features.get(column)):
            raise ValueError(f"column {column!r} holds images, but this SFTTrainer trains a text-only causal LM, "
                             "which would ignore them: pass a vision-language model with its images in an 'images' "
                             "(or 'image') column, or drop the column")


def check_vision_options(args: SFTConfig, formatting_func=None) -> None:
    """Refuse what the vision path cannot do, naming the option: packing and padding-free (rows of several
    sequences: a sequence's image tokens must meet its own image features, and multimodal rotary positions
    cannot restart per sequence) and a formatting_func (it returns text, which holds no images)."""
    for name in ("packing", "eval_packing", "padding_free"):
        if getattr(args, name):
            raise ValueError(f"{name}=True: vision-language rows are not packed or flattened here (each sequence's "
                             f"image tokens must stay with its own images, and the multimodal rotary positions of "
                             f"models such as Qwen2-VL do not restart per sequence); set {name}=False")
    if formatting_func is not None:
        raise ValueError("formatting_func returns text, which cannot hold images: with a vision-language model give "
                         "conversational rows (content parts with {'type': 'image'}) and an 'images' column instead")


def as_sft_config(args: TrainingArguments) -> SFTConfig:
    """A plain `transformers.TrainingArguments` as an SFTConfig keeping every field it sets (SFT's own fields
    at their defaults), as TRL converts it; `remove_unused_columns` stays False (the collator reads
    `loss_mask`, which the model's forward does not take)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainingArguments) if f.init}
    values["remove_unused_columns"] = False
    return SFTConfig(**values)


class SFTTrainer(BaseTrainer):
    """Supervised fine-tuning on demonstrations; see the module docstring."""

    _tag = "sft"
    _name = "SFT (supervised fine-tuning)"  # no one paper to cite

    def __init__(self, model, args: SFTConfig | TrainingArguments | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, peft_config=None, callbacks=None,
                 optimizers=(None, None), formatting_func=None, compute_metrics=None,
                 preprocess_logits_for_metrics=None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = SFTConfig(output_dir=f"{name.rstrip('/').split('/')[-1]}-SFT")
        elif not isinstance(args, SFTConfig):
            if not isinstance(args, TrainingArguments):
                raise TypeError(f"args must be an SFTConfig (or a transformers.TrainingArguments), got "
                                f"{type(args).__name__}")
            args = as_sft_config(args)
        # kwargs: TRL's older conventions (tokenizer=, SFTConfig fields such as packing=), see classic_arguments
        args, processing_class = classic_arguments("SFTTrainer", SFTConfig, args, processing_class, kwargs)
        train_dataset, eval_dataset = as_dataset(train_dataset), as_dataset(eval_dataset, "eval_dataset")
        check_datasets(args, train_dataset, eval_dataset)
        seed_run(args)
        init_kwargs = args.model_init_kwargs or {}
        trust = init_kwargs.get("trust_remote_code", False)
        # a vision-language model (or a dataset with images, refused for a text-only model) takes the vision path
        self.vision = vision_run(model, train_dataset, "SFTTrainer")
        if self.vision:
            check_vision_options(args, formatting_func)
            model = loading.load_vision_lm(model, **init_kwargs)
            tokenizer = loading.load_processor(processing_class, model=model, trust_remote_code=trust)
        else:
            model = loading.load_causal_lm(model, **init_kwargs)
            tokenizer = loading.load_tokenizer(processing_class, model=model, trust_remote_code=trust)
        if args.chat_template_path is not None:
            load_chat_template(getattr(tokenizer, "tokenizer", tokenizer), args.chat_template_path, model)
        self.formatting_func = formatting_func
        prepare = lambda data, pack: self.prepare_dataset(data, tokenizer, args, pack, formatting_func)  # noqa: E731
        if self.vision:  # checked here, tokenised and processed batch by batch in the collator
            prepare = lambda data, pack: multimodal.prepare_vision_dataset(data, "sft")  # noqa: E731
        train_dataset = prepare(train_dataset, args.packing)
        with errors_named(EVAL_SET):
            eval_dataset = map_datasets(lambda data: prepare(data, args.eval_packing), eval_dataset)
        attention = str(attention_kind(model) or "")  # document attention (a model trained before) counts as sdpa
        if self.vision:
            args.padding_free = False  # check_vision_options refused True
        if args.padding_free is None and (args.packing or attention not in ("sdpa", "eager")):
            # flash (varlen kernels): flat packed rows; otherwise full bins, cheaper than one flat row
            args.padding_free = bool(args.packing and "flash" in attention)
        # rows holding several sequences attend within each one only, at its own cost (sdpa; flash does already)
        several = args.packing or args.eval_packing or args.padding_free is not False  # rows of several sequences
        self._documents = attention == "sdpa" and several and document_attention.enable(model)
        # still None: unpacked data, dense-mask attention; compute_loss flattens the batches where that is cheaper
        hidden = getattr(model.config, "hidden_size", None)
        self._flatten_width = hidden if args.padding_free is None and isinstance(hidden, int) else None
        self._flat_rows_apart: bool | None = None  # whether the model reads restarting position_ids; checked once
        if data_collator is None and self.vision:
            data_collator = VisionLanguageModelingCollator(
                tokenizer, completion_only=args.completion_only_loss is not False,
                assistant_only=args.assistant_only_loss, max_length=args.max_length,
                template_kwargs=args.chat_template_kwargs)
        elif data_collator is None:
            data_collator = LanguageModelingCollator(tokenizer.pad_token_id, padding_free=bool(args.padding_free))
        elif args.padding_free:  # the flattening is the collator's work: a custom one would silently skip it
            raise ValueError("padding_free=True flattens batches in SFT's own collator, so it cannot be combined "
                             "with a custom data_collator; drop one of them")
        # mixture-of-experts: the model returns its router load-balancing loss, added to ours (as TRL does)
        self.aux_loss_enabled = bool(getattr(model.config, "output_router_logits", False))
        self.aux_loss_coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
        super().__init__(model, args, processing_class=tokenizer, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, data_collator=data_collator, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers, compute_metrics=compute_metrics,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        # Our loss always divides by the global count of target tokens, which Trainer only counts
        # (as num_items_in_batch) when it believes the model takes loss kwargs.
        self.model_accepts_loss_kwargs = True
        self._num_tokens = 0
        base = self.model.get_base_model() if loading.is_peft_model(self.model) else self.model
        # PEFT prompt tuning / p-tuning put virtual tokens before the input: the logits are longer than the
        # input, so the positions to keep are known only after the forward (prefix tuning adds none)
        peft = self.model.active_peft_config if loading.is_peft_model(self.model) else None
        self._prompt_learning = bool(peft is not None and peft.is_prompt_learning)
        if self._prompt_learning and (args.packing or args.padding_free):
            raise ValueError(f"PEFT {peft.peft_type.value} adds virtual tokens before each sequence, so it cannot "
                             "train on packed or padding-free rows; set packing=False and padding_free=False")
        if self._prompt_learning:
            self._flatten_width = None
        takes_keep = "logits_to_keep" in inspect.signature(base.forward).parameters and not self._prompt_learning
        self._logits_to_keep_mask = takes_keep and compat.logits_to_keep_takes_mask()
        self._fuse_head = takes_keep  # fuse the output layer into the loss where it is plain

    # ------------------------------------------------------------------ data
    def prepare_eval_dataset(self, dataset, name: str = "eval"):
        """Data given to `evaluate` after construction, prepared as the eval data given at construction."""
        columns = set(_column_names(dataset) or ())
        if "input_ids" in columns and columns <= {"input_ids", "loss_mask", "seq_lengths"}:
            return dataset  # already prepared
        if self.vision:
            return dataset if "row_index" in columns else multimodal.prepare_vision_dataset(dataset, "sft", name)
        return self.prepare_dataset(dataset, self.processing_class, self.args, self.args.eval_packing,
                                    self.formatting_func)

    @staticmethod
    def prepare_dataset(dataset, tokenizer, args: SFTConfig, packing: bool, formatting_func=None):
        """Rows in any SFT format -> tokenised rows {input_ids, loss_mask} (packed when asked).

        A `datasets.IterableDataset` is prepared lazily, as its rows are read; with packing, bins
        are filled from `STREAM_PACK_ROWS` rows at a time.
        """
        if (args.dataset_kwargs or {}).get("skip_prepare_dataset"):
            if "input_ids" not in (_column_names(dataset) or ()):
                raise ValueError("dataset_kwargs={'skip_prepare_dataset': True} uses the dataset as it is, so it "
                                 "must be tokenised already: it needs an 'input_ids' column (optionally "
                                 f"'loss_mask'); its columns are {_column_names(dataset)}")
            wanted = [name for name in ("assistant_only_loss", "completion_only_loss") if getattr(args, name) is True]
            if wanted and not any(c in _column_names(dataset) for c in MASK_COLUMNS):
                raise ValueError(f"{wanted[0]}=True with dataset_kwargs={{'skip_prepare_dataset': True}} needs the "
                                 f"rows' mask: a column among {list(MASK_COLUMNS)} (1 on the tokens to train on); "
                                 f"without one every token would be trained on. Its columns are "
                                 f"{_column_names(dataset)}")
            return dataset
        streamed = isinstance(dataset, IterableDataset)
        columns = _column_names(dataset)
        _refuse_images(dataset, columns)
        if "input_ids" in columns:  # already tokenised
            mask_column = next((c for c in MASK_COLUMNS if c in columns), None)
            dataset = dataset.map(lambda row: {"loss_mask": row[mask_column] if mask_column else
                                               [1] * len(row["input_ids"])},
                                  remove_columns=[c for c in columns if c not in ("input_ids", "loss_mask")])
        else:
            if formatting_func is not None:
                dataset = dataset.map(lambda row: {"text": formatting_func(row)}, remove_columns=columns)
            elif args.dataset_text_field != "text" and args.dataset_text_field in columns:
                dataset = dataset.rename_column(args.dataset_text_field, "text")
            truncate = not (packing and args.packing_strategy == "wrapped")
            # posttrain counts what max_length cuts (below); the tokenizer's "indexing errors" line is not the news
            tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
            dataset = SFTTrainer._tokenize(dataset, tokenizer, args, truncate=truncate)
            if "truncated" in _column_names(dataset):  # not streamed: every row is tokenised now
                if cut := sum(dataset["truncated"]):
                    logger.warning(f"{cut} of {len(dataset)} rows are longer than max_length={args.max_length} "
                                   "tokens and were cut to it (their ends are not trained on); raise max_length or "
                                   "filter long rows")
                dataset = dataset.remove_columns("truncated")
        if packing:
            if streamed:
                return dataset.map(lambda batch: pack_rows(batch, args.max_length, args.packing_strategy),
                                   batched=True, batch_size=STREAM_PACK_ROWS, remove_columns=["input_ids", "loss_mask"])
            return pack_dataset(dataset, args.max_length, args.packing_strategy)
        if args.max_length is not None:
            dataset = dataset.map(lambda row: {k: row[k][: args.max_length] for k in ("input_ids", "loss_mask")})
        return dataset

    @staticmethod
    def _tokenize(dataset, tokenizer, args: SFTConfig, truncate: bool):
        streamed = isinstance(dataset, IterableDataset)
        max_length = args.max_length if truncate else None
        completion_only = args.completion_only_loss is not False
        assistant_only = args.assistant_only_loss

        def canonical(data):
            """`data` (a Dataset or a list of rows) in language-modeling or prompt-completion form."""
            info = formats.validate(data)
            if info.name == "sharegpt":  # -> messages
                data, info = formats.to_canonical(data)
            elif info.name not in ("language_modeling", "prompt_completion"):
                data, info = formats.to_canonical(data, target="prompt_completion")
            if info.conversational:
                require_chat_template(tokenizer)
            if assistant_only and not info.conversational:
                raise formats.FormatError(
                    "assistant_only_loss=True needs conversational data (message lists), but the dataset is made "
                    "of plain strings; set assistant_only_loss=False or use completion_only_loss with "
                    "prompt-completion rows")
            return data, info

        def encode(row, i, info):
            variables = template_variables(args.chat_template_kwargs, row.get("chat_template_kwargs"))
            try:
                return encode_sft_row(tokenizer, row, i, language_modeling=info.name == "language_modeling",
                                      conversational=info.conversational, completion_only=completion_only,
                                      assistant_only=assistant_only, max_length=max_length, template_kwargs=variables)
            except TokenizeError as err:
                message = str(err) if str(err).startswith("row ") else f"row {i}: {err}"
                raise TokenizeError(message) from None

        if not streamed:
            dataset, info = canonical(dataset)
            return dataset.map(lambda row, i: encode(row, i, info), with_indices=True,
                               remove_columns=dataset.column_names, num_proc=args.dataset_num_proc, desc="tokenizing")

        def encode_batch(batch, indices):  # a streamed batch: checked, converted and tokenised as it is read
            rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
            try:
                rows, info = canonical(rows)
            except formats.FormatError as err:  # the batch's row numbers -> the stream's
                raise formats.FormatError(f"streamed rows {indices[0]}-{indices[-1]}: {err}") from None
            out = [encode(row, indices[0] + k, info) for k, row in enumerate(rows)]  # cuts not counted: a stream
            return {"input_ids": [o["input_ids"] for o in out], "loss_mask": [o["loss_mask"] for o in out]}

        return dataset.map(encode_batch, batched=True, with_indices=True, remove_columns=_column_names(dataset))

    # ------------------------------------------------------------------ loss
    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.args.activation_offloading:
            return super().training_step(model, inputs, num_items_in_batch)
        with OffloadActivations():  # forward and backward both: backward reads what the forward saved
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._flatten_width is not None and "attention_mask" in inputs and "position_ids" not in inputs:
            inputs = self._flattened_if_cheaper(model, inputs)
        labels = inputs["labels"]  # (B, T), IGNORE_INDEX where no loss
        targets = torch.full_like(labels, IGNORE_INDEX)
        targets[:, :-1] = labels[:, 1:]  # targets[:, t] is predicted by the logits at t
        keep = targets != IGNORE_INDEX  # (B, T)
        model_inputs = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
        model_inputs.update(inputs.get("model_inputs") or {})  # a vision-language model's pixel_values, ...
        if self._documents and "position_ids" in inputs and "attention_mask" not in inputs:
            model_inputs.update(document_attention.boundaries(inputs["position_ids"]))  # where each sequence starts
        if self.aux_loss_enabled:
            model_inputs["output_router_logits"] = True
        head = None
        if self._fuse_head and not return_outputs:
            head = plain_lm_head(self.accelerator.unwrap_model(model), inputs["input_ids"])
        if head is not None:  # the model stops at its hidden states; the output layer is fused into the loss
            no_logits = torch.zeros(0, dtype=torch.long, device=keep.device)  # an empty index: any 5.x release
            outputs = model(**model_inputs, logits_to_keep=no_logits, output_hidden_states=True,
                            use_cache=False)
        elif self._logits_to_keep_mask:  # the vocabulary projection only where there is a target: (N, V)
            outputs = model(**model_inputs, logits_to_keep=keep, use_cache=False)
            logits = outputs.logits
        else:
            outputs = model(**model_inputs, use_cache=False)
            virtual = outputs.logits.shape[1] - keep.shape[1]  # PEFT prompt tuning's virtual tokens come first
            logits = outputs.logits[:, virtual:][keep]
        targets = targets[keep]  # (N,)
        if head is not None:  # (N,) each; one pass over the logits, a vocabulary block at a time
            logps, entropy, argmax = linear_selective_log_softmax(outputs.hidden_states[-1][keep], head.weight,
                                                                  targets, with_stats=True)
            logits = None
        else:
            logps, entropy, argmax = selective_log_softmax_stats(logits, targets)  # (N,) each; one pass over logits
        denominator = num_items_in_batch if num_items_in_batch is not None else keep.sum().clamp(min=1)
        loss = LOSSES[self.args.loss_type](logps).sum() / denominator
        if num_items_in_batch is not None and self.args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over processes
        mode = "train" if model.training else "eval"
        if self.aux_loss_enabled:
            aux = outputs.aux_loss
            self.record({"aux_loss": aux}, mode)
            if num_items_in_batch is not None:  # Trainer then leaves the mean over accumulated micro-batches to us
                aux = aux / getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
            loss = loss + self.aux_loss_coef * aux

        if mode == "train":  # tokens fed to the model (packed rows: including the few pads after the last bin)
            mask = inputs.get("attention_mask")
            self._num_tokens += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        if targets.numel():
            self.record({"entropy": entropy.mean(), "mean_token_accuracy": (argmax == targets).float().mean()}, mode)
        outputs.logits = logits
        return (loss, outputs) if return_outputs else loss

    def _flattened_if_cheaper(self, model, inputs: dict) -> dict:
        """The padded batch as one flat row (`flatten_padded`) where `flat_is_cheaper`, and the model keeps
        sequences apart by their restarting position_ids (checked on the first batch, on every process)."""
        if self._flat_rows_apart is None:
            if self._fuse_head:  # decided first: ZeRO-3 can leave the head's weight gathered after the check's forwards
                plain_lm_head(self.accelerator.unwrap_model(model), inputs["input_ids"])
            self._flat_rows_apart = rows_kept_apart(model, inputs["input_ids"][inputs["attention_mask"].bool()])
            if not self._flat_rows_apart:
                warnings.warn(f"{type(self.accelerator.unwrap_model(model)).__name__} lets sequences that share a row "
                              "see each other despite restarting position_ids, so batches stay padded "
                              "(padding_free=None); padding_free=True would train on mixed sequences", stacklevel=3)
        if not self._flat_rows_apart:
            return inputs
        lengths = inputs["attention_mask"].sum(1).tolist()
        if not flat_is_cheaper(lengths, inputs["attention_mask"].shape[1], self._flatten_width, self._documents):
            return inputs
        return flatten_padded(inputs) or inputs

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if not any(k.startswith("eval_") for k in logs):
            total = torch.tensor(self._num_tokens, device=self.args.device)
            logs["num_tokens"] = float(self.accelerator.gather_for_metrics(total.reshape(1)).sum())
        super().log(logs, start_time)
