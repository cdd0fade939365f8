"""Test-wide settings: offline, deterministic, and quiet."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

import pytest


@pytest.fixture(scope="session")
def tiny_lm():
    """(model, tokenizer) of the deterministic tiny Qwen2-style model."""
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    return load_causal_lm("posttrain/tiny-qwen2").eval(), load_tokenizer(None, model="posttrain/tiny-qwen2")
