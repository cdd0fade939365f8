"""Collators for vision-language models: raw image-text rows -> the processor's tensors and the masks.

Images are decoded and processed batch by batch, as rows are read (TRL does the same for VLMs): a
dataset keeps its images as they are (PIL, paths, bytes) instead of storing pixel values, which for
real models are far larger than the images. Each collator renders every sequence with the chat
template, marks its trained tokens on the rendered text (`posttrain.data.tokenize`, the text-only
rules), and lets `multimodal.encode_vision_batch` expand the image placeholders and carry the marks
over. What the model's forward takes besides the token ids (pixel_values, image_grid_thw,
image_sizes, ...) comes in the batch's `model_inputs` dict.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from posttrain.data.chat import template_variables
from posttrain.data.collate import IGNORE_INDEX
from posttrain.data.multimodal import encode_vision_batch, prepare_multimodal_messages, row_images
from posttrain.data.tokenize import TokenizeError, encode_prompt_completion, encode_sft_row, render_chat

ROW_COLUMN = "row_index"  # the dataset row a collated row came from, for error messages
TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask")


def prepared_row(row: Mapping, images: list) -> dict:
    """A copy of a vision row whose message lists are in the parts form, each image part holding its image
    (`prepare_multimodal_messages` on the prompt followed by each of its answers)."""
    out = dict(row)
    if row.get("messages") is not None:
        out["messages"] = prepare_multimodal_messages(row["messages"], images)
        return out
    prompt = list(row.get("prompt") or [])
    answers = [c for c in ("completion", "chosen", "rejected", "kl_completion") if row.get(c) is not None]
    out["prompt"] = prepare_multimodal_messages(prompt, images) if not answers else prompt
    for column in answers:
        both = prepare_multimodal_messages(prompt + list(row[column]), images)
        out["prompt"], out[column] = both[: len(prompt)], both[len(prompt):]
    return out


def split_batch(out: dict) -> dict:
    """The processor's output as the trainers read it: token tensors at the top, the rest in `model_inputs`."""
    return {**{k: out[k] for k in TOKEN_KEYS if k in out},
            "model_inputs": {k: v for k, v in out.items() if k not in TOKEN_KEYS}}


class _Sequences:
    """Sequences gathered for one processor call: rendered text, images, unexpanded ids and their mask."""

    def __init__(self):
        self.texts, self.images, self.ids, self.masks, self.rows = [], [], [], [], []

    def add(self, text: str, images: list, ids: list[int], mask: list[int], row) -> None:
        self.texts.append(text)
        self.images.append(images)
        self.ids.append(ids)
        self.masks.append(mask)
        self.rows.append(row)

    def encode(self, processor, max_length: int | None) -> dict:
        return encode_vision_batch(processor, self.texts, self.images, self.ids, self.masks, max_length, self.rows)


def _row_number(row: Mapping, k: int):
    return row.get(ROW_COLUMN, k)


class VisionLanguageModelingCollator:
    """Vision SFT rows (`messages`, or `prompt` + `completion`; images in `images` / `image`) -> a batch:
    input_ids / attention_mask (B, T) right-padded, labels (B, T) with IGNORE_INDEX on every token that is
    not trained on (image tokens always), and `model_inputs` (pixel_values, ...).

    completion_only: prompt-completion rows train on the completion only; assistant_only: on what assistant
    turns say only (the chat template's {% generation %} markers); max_length cuts rows from the right."""

    def __init__(self, processor, *, completion_only: bool = True, assistant_only: bool = False,
                 max_length: int | None = None, template_kwargs: dict | None = None):
        self.processor, self.tokenizer = processor, processor.tokenizer
        self.completion_only, self.assistant_only = completion_only, assistant_only
        self.max_length, self.template_kwargs = max_length, template_kwargs

    def __call__(self, rows: list[dict]) -> dict:
        sequences = _Sequences()
        for k, row in enumerate(rows):
            i = _row_number(row, k)
            images = row_images(row, i)
            row = prepared_row(row, images)
            variables = template_variables(self.template_kwargs, row.get("chat_template_kwargs"))
            lm = row.get("messages") is not None
            try:
                out = encode_sft_row(self.tokenizer, row, i, language_modeling=lm, conversational=True,
                                     completion_only=self.completion_only, assistant_only=self.assistant_only,
                                     template_kwargs=variables)
            except TokenizeError as err:
                raise TokenizeError(str(err) if str(err).startswith("row ") else f"row {i}: {err}") from None
            messages = row["messages"] if lm else list(row["prompt"]) + list(row["completion"])
            text = render_chat(self.tokenizer, messages, row.get("tools"), variables)
            sequences.add(text, images, out["input_ids"], out["loss_mask"], i)
        batch = split_batch(sequences.encode(self.processor, self.max_length))
        mask = batch.pop("loss_mask")
        batch["labels"] = batch["input_ids"].masked_fill(mask == 0, IGNORE_INDEX)
        return batch


class VisionPreferenceCollator:
    """Vision preference rows -> the PreferenceCollator's layout with the images: input_ids / attention_mask /
    completion_mask (N, T) and `model_inputs` for all N rows, in one processor call.

    paired: rows `prompt`, `chosen`, `rejected` -> 2B rows, chosen first (each pair's images twice).
    unpaired: rows `prompt`, `completion`, `label` -> B rows and `label` (B,); with `kl_pairs` (KTO) B more
    rows follow: prompt i (and its images) before the row's `kl_completion` where the dataset fixes it
    (precomputed reference), else completion i after prompt (i+1) mod B with that prompt's images.
    Reference log-prob columns (`ref_chosen_logps`, ...) and `margin` come along as (B,) tensors."""

    EXTRA = ("margin", "ref_chosen_logps", "ref_rejected_logps", "ref_logps", "ref_kl_logps")

    def __init__(self, processor, paired: bool = True, kl_pairs: bool = False, max_length: int | None = None,
                 template_kwargs: dict | None = None):
        self.processor, self.tokenizer = processor, processor.tokenizer
        self.paired, self.kl_pairs, self.max_length = paired, kl_pairs, max_length
        self.template_kwargs = template_kwargs

    def _add(self, sequences: _Sequences, row: dict, prompt, completion, images, i) -> None:
        variables = template_variables(self.template_kwargs, row.get("chat_template_kwargs"))
        tools = row.get("tools")
        both = prepare_multimodal_messages(list(prompt) + list(completion), images)
        prompt, completion = both[: len(prompt)], both[len(prompt):]
        try:
            out = encode_prompt_completion(self.tokenizer, prompt, completion, None, row=i, tools=tools,
                                           template_kwargs=variables)
        except TokenizeError as err:
            raise TokenizeError(str(err) if str(err).startswith("row ") else f"row {i}: {err}") from None
        ids = out["prompt_ids"] + out["completion_ids"]
        mask = [0] * len(out["prompt_ids"]) + [1] * len(out["completion_ids"])
        sequences.add(render_chat(self.tokenizer, both, tools, variables), images, ids, mask, i)

    def __call__(self, rows: list[dict]) -> dict:
        numbers = [_row_number(row, k) for k, row in enumerate(rows)]
        images = [row_images(row, i) for row, i in zip(rows, numbers)]
        sequences = _Sequences()
        answers = ("chosen", "rejected") if self.paired else ("completion",)
        for column in answers:
            for row, pictures, i in zip(rows, images, numbers):
                self._add(sequences, row, row["prompt"], row[column], pictures, i)
        if self.kl_pairs:
            B = len(rows)
            for k, (row, i) in enumerate(zip(rows, numbers)):
                if row.get("kl_completion") is not None:
                    self._add(sequences, row, row["prompt"], row["kl_completion"], images[k], i)
                else:
                    other = (k + 1) % B
                    self._add(sequences, rows[other], rows[other]["prompt"], row["completion"], images[other],
                              numbers[other])
        batch = split_batch(sequences.encode(self.processor, self.max_length))
        batch["completion_mask"] = batch.pop("loss_mask")
        if not self.paired:
            batch["label"] = torch.tensor([bool(r["label"]) for r in rows])
        for key in self.EXTRA:
            if rows[0].get(key) is not None:
                batch[key] = torch.tensor([float(r[key]) for r in rows])
        return batch
