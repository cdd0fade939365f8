"""Fixtures shared by the trainer tests (helper functions: tests/helpers/)."""

import pytest


def sft_reverse(steps: int = 150, batch_size: int = 32, lr: float = 3e-3, warmup: int = 10, seed: int = 0):
    """tiny-qwen2 after a short completion-only SFT on the built-in `reverse` task (plain torch loop,
    AdamW, linear warm-up then a constant learning rate).

    Partially trained on purpose: it stops just before the model "gets" reversal (measured at 150
    steps: held-out greedy exact match 0.18, sampled digit_match reward 0.43; at 200 steps both are
    ~1), so RL has room to raise both. Returns (model, tokenizer).
    """
    import torch

    from posttrain.data.collate import pad
    from posttrain.data.tokenize import encode_prompt_completion
    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.tasks.builtin import task_dataset

    torch.manual_seed(seed)
    model = load_causal_lm("posttrain/tiny-qwen2")
    tok = load_tokenizer(None, model="posttrain/tiny-qwen2")
    rows = [encode_prompt_completion(tok, r["prompt"], r["completion"]) for r in task_dataset("reverse", "train")]
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / warmup))
    model.train()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        picked = [rows[i] for i in torch.randint(len(rows), (batch_size,), generator=g).tolist()]
        ids = pad([r["prompt_ids"] + r["completion_ids"] for r in picked], tok.pad_token_id)
        labels = pad([[-100] * len(r["prompt_ids"]) + r["completion_ids"] for r in picked], -100)
        mask = pad([[1] * (len(r["prompt_ids"]) + len(r["completion_ids"])) for r in picked], 0)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optim.step()
        schedule.step()
        optim.zero_grad()
    return model.eval(), tok


@pytest.fixture
def one_thread():
    """Tiny models: one thread is faster than two that wait on each other on a busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def sft_reverse_path(tmp_path_factory):
    """Folder of the partially SFT-trained tiny model (built once per test session)."""
    model, tok = sft_reverse()
    path = tmp_path_factory.mktemp("sft_reverse")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
