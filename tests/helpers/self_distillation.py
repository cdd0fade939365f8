"""A student for the self-distillation trainers' learning runs (SDFT, SDPO): tiny-qwen2 after a short SFT on
`reverse` in which half the prompts also show the answer, in SDPO's reprompt layout (the teacher's prompt).

Self-distillation presumes a model that reads a demonstration in its prompt (the papers use instruction models);
a tiny model trained on plain prompts only does not: shown the answer it scored lower than without it (0.14
against 0.27), so its "teacher" had nothing to teach. This student has learnt to copy a shown answer, and only
partly to reverse, so the model with the demonstration in view is a better teacher than the model without it."""

REPROMPT = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"  # SDPOConfig's default
SOLUTION = "\nCorrect solution:\n\n{successful_previous_attempt}\n\n"  # SDPOConfig's default


def hinted_prompt(prompt: str, answer: str) -> str:
    """The prompt as SDPO's teacher sees it with a successful attempt ` answer` (and as SDFT's, by its template)."""
    return REPROMPT.format(prompt=prompt, solution=SOLUTION.format(successful_previous_attempt=" " + answer),
                           feedback="")


def sft_reverse_with_hints(steps: int = 120, batch_size: int = 32, lr: float = 3e-3, seed: int = 0):
    """(model, tokenizer): completion-only SFT, each batch half plain prompts and half hinted ones."""
    import torch

    from posttrain.data.collate import pad
    from posttrain.data.tokenize import encode_prompt_completion
    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.tasks.builtin import task_dataset

    torch.manual_seed(seed)
    model = load_causal_lm("posttrain/tiny-qwen2")
    tok = load_tokenizer(None, model="posttrain/tiny-qwen2")
    train = task_dataset("reverse", "train")
    plain = [encode_prompt_completion(tok, r["prompt"], r["completion"]) for r in train]
    hinted = [encode_prompt_completion(tok, hinted_prompt(r["prompt"], r["answer"]), r["completion"]) for r in train]
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / 10))
    model.train()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(len(train), (batch_size,), generator=g).tolist()
        picked = [(hinted if j % 2 else plain)[i] for j, i in enumerate(index)]
        ids = pad([r["prompt_ids"] + r["completion_ids"] for r in picked], tok.pad_token_id)
        labels = pad([[-100] * len(r["prompt_ids"]) + r["completion_ids"] for r in picked], -100)
        mask = pad([[1] * (len(r["prompt_ids"]) + len(r["completion_ids"])) for r in picked], 0)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optim.step()
        schedule.step()
        optim.zero_grad()
    return model.eval(), tok


def accuracies(model, tok, size: int = 100) -> tuple[float, float]:
    """Held-out greedy exact match on `reverse`: (plain prompts, prompts showing the answer)."""
    from datasets import Dataset

    from posttrain.eval import generation_accuracy
    from posttrain.tasks.builtin import task_dataset

    test = task_dataset("reverse", "test", size=size)
    shown = Dataset.from_list([{"prompt": hinted_prompt(r["prompt"], r["answer"]), "answer": r["answer"]}
                               for r in test])
    return (generation_accuracy(model, tok, test, max_new_tokens=6),
            generation_accuracy(model, tok, shown, max_new_tokens=6))
