"""Held-out evaluation helpers shared by tests, examples, judges and the demo."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from posttrain.models.modes import eval_mode
from posttrain.tasks.builtin import check


@torch.no_grad()
def generate_completions(model, tokenizer, prompts: Sequence[Any], max_new_tokens: int = 32,
                         batch_size: int = 64, **generation_kwargs) -> list[str]:
    """Greedy completions (text, special tokens dropped) of `prompts`: strings or message lists.

    Prompts are encoded like the trainers encode them (chat template with the generation prompt
    for conversations) and left-padded so every row ends where generation starts.
    `generation_kwargs` go to `model.generate` (e.g. `generation_config=`, which then decides the decoding).
    The model's train/eval mode is restored.
    """
    from posttrain.data.collate import pad
    from posttrain.data.tokenize import encode_prompt

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = dict(pad_token_id=pad_id, eos_token_id=tokenizer.eos_token_id, use_cache=True)
    if "generation_config" not in generation_kwargs:  # a GenerationConfig, when given, decides the decoding
        kwargs.update(do_sample=False, max_new_tokens=max_new_tokens)
    kwargs.update(generation_kwargs)
    device = next(model.parameters()).device
    texts = []
    with eval_mode(model):
        for start in range(0, len(prompts), batch_size):
            encoded = [encode_prompt(tokenizer, p) for p in prompts[start:start + batch_size]]
            ids = pad(encoded, pad_id, "left").to(device)
            mask = pad([[1] * len(e) for e in encoded], 0, "left").to(device)
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
            texts += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    return texts


def generation_accuracy(model, tokenizer, dataset, max_new_tokens: int = 8, batch_size: int = 64,
                        checker=None) -> float:
    """Fraction of rows whose greedy completion passes `checker(completion, row["answer"])`
    (default: exact match, `posttrain.tasks.builtin.check`).

    `dataset` has `prompt` (a string or messages) and `answer` columns, as the built-in tasks do.
    """
    texts = generate_completions(model, tokenizer, list(dataset["prompt"]), max_new_tokens, batch_size)
    answers = list(dataset["answer"])
    checker = checker or check
    return sum(checker(t, a) for t, a in zip(texts, answers)) / max(len(answers), 1)


@torch.no_grad()
def vision_completions(model, processor, prompts: Sequence[Any], images: Sequence[list], max_new_tokens: int = 8,
                       batch_size: int = 32, **generation_kwargs) -> list[str]:
    """Greedy completions (text, special tokens dropped) of a vision-language model: `prompts` are message lists
    (content strings or parts), `images` each prompt's images (PIL, paths, bytes). Prompts are rendered by the
    chat template with the generation prompt and processed with their images, left-padded."""
    from posttrain.data.multimodal import load_image, prepare_multimodal_messages
    from posttrain.data.tokenize import render_chat

    tokenizer = processor.tokenizer
    kwargs = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, use_cache=True,
                  do_sample=False, max_new_tokens=max_new_tokens, **generation_kwargs)
    device = next(model.parameters()).device
    texts = []
    with eval_mode(model):
        for start in range(0, len(prompts), batch_size):
            pictures = [[load_image(i) for i in row] for row in images[start:start + batch_size]]
            rendered = [render_chat(tokenizer, prepare_multimodal_messages(p, i), add_generation_prompt=True)
                        for p, i in zip(prompts[start:start + batch_size], pictures)]
            extra = {"images": pictures} if any(pictures) else {}
            inputs = processor(text=rendered, padding=True, padding_side="left", return_tensors="pt",
                               add_special_tokens=False, **extra).to(device)
            out = model.generate(**inputs, **kwargs)
            texts += tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return texts


def vision_accuracy(model, processor, dataset, max_new_tokens: int = 4, batch_size: int = 32, checker=None) -> float:
    """Fraction of rows whose greedy completion passes `checker(completion, row["answer"])` (default: the visual
    task's `vision_check`); `dataset` has `prompt`, `images` (or `image`) and `answer` columns."""
    from posttrain.data.multimodal import row_images
    from posttrain.tasks.vision import vision_check

    rows = list(dataset)
    texts = vision_completions(model, processor, [r["prompt"] for r in rows],
                               [row_images(r, i, load=False) for i, r in enumerate(rows)], max_new_tokens, batch_size)
    checker = checker or vision_check
    return sum(checker(t, r["answer"]) for t, r in zip(texts, rows)) / max(len(rows), 1)
