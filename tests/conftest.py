"""Test-wide settings: offline, deterministic, and quiet."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
# a thread count that follows the machine's load would make bit-identity tests depend on it (accel/threads.py)
os.environ.setdefault("POSTTRAIN_FIT_THREADS", "0")

import pytest


@pytest.fixture(scope="session")
def tiny_lm():
    """(model, tokenizer) of the deterministic tiny Qwen2-style model."""
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    return load_causal_lm("posttrain/tiny-qwen2").eval(), load_tokenizer(None, model="posttrain/tiny-qwen2")


@pytest.fixture
def remote_code_model(tmp_path):
    """Folder of tiny-qwen2 whose config and tokenizer config name classes of its own (`custom.py`,
    `auto_map`): loaded as RemoteLM / RemoteTokenizer only with trust_remote_code."""
    import json
    import shutil

    from posttrain.models.loading import resolve

    folder = tmp_path / "remote_model"
    shutil.copytree(resolve("posttrain/tiny-qwen2"), folder)
    (folder / "custom.py").write_text("from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM\n\n\n"
                                      "class RemoteLM(Qwen2ForCausalLM):\n    pass\n\n\n"
                                      "class RemoteTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    for name, auto_map in (("config.json", {"AutoModelForCausalLM": "custom.RemoteLM"}),
                           ("tokenizer_config.json", {"AutoTokenizer": [None, "custom.RemoteTokenizer"]})):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, "auto_map": auto_map}))
    return folder
