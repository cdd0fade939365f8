"""Held-out evaluation helpers shared by tests, examples and the demo."""

from __future__ import annotations

import torch

from posttrain.data.builtin import check
from posttrain.data.collate import pad
from posttrain.data.tokenize import encode_prompt


@torch.no_grad()
def generation_accuracy(model, tokenizer, dataset, max_new_tokens: int = 8, batch_size: int = 64) -> float:
    """Fraction of rows whose greedy completion passes `check(completion, row["answer"])`.

    `dataset` has `prompt` (a string or messages) and `answer` columns, as the built-in tasks do.
    Prompts are left-padded and generated in batches; the model's train/eval mode is restored.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    correct = 0
    try:
        for start in range(0, len(dataset), batch_size):
            rows = dataset[start:start + batch_size]
            prompts = [encode_prompt(tokenizer, p) for p in rows["prompt"]]
            input_ids = pad(prompts, pad_id, side="left").to(device)
            attention_mask = pad([[1] * len(p) for p in prompts], 0, side="left").to(device)
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                                 eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)
            correct += sum(check(text, answer) for text, answer in zip(texts, rows["answer"]))
    finally:
        model.train(was_training)
    return correct / max(len(dataset), 1)
