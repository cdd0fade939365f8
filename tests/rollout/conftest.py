"""Fixtures shared by the rollout tests (helper functions: tests/helpers/)."""

import pytest


@pytest.fixture(scope="module")
def tok():
    """The tiny models' tokenizer."""
    from posttrain.models.loading import load_tokenizer

    return load_tokenizer("posttrain/tiny-qwen2")


@pytest.fixture(scope="module")
def model():
    """tiny-qwen2 with larger random weight matrices: the seeded model repeats one token forever, this one
    gives varied text, so parity and stop tests compare real sequences."""
    import torch

    from posttrain.models.loading import load_causal_lm

    m = load_causal_lm("posttrain/tiny-qwen2")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()
