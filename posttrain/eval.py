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
