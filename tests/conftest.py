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

# Trainer tests whose assertions hold on any device and in bf16 (whole runs through `Trainer`: every parameter
# moves, metrics finite, tools called; no CPU kernel, no float32 tolerance). `-m device_independent --device cuda
# --bf16` runs them on a GPU (benchmarks/gpu_check.sh).
DEVICE_INDEPENDENT = {
    "tests/trainers/test_sft.py::test_smoke_run_changes_every_parameter_and_logs_finite_metrics",
    "tests/trainers/test_sft.py::test_lora_changes_only_the_adapter",
    "tests/trainers/test_dpo.py::test_tiny_run_changes_every_parameter_and_logs_finite_metrics",
    "tests/trainers/test_reward.py::test_tiny_run_changes_every_parameter_and_logs_finite_metrics",
    "tests/trainers/test_kto.py::test_tiny_run_changes_every_parameter_and_logs_finite_metrics",
    "tests/trainers/test_grpo.py::test_smoke_every_parameter_changes_and_metrics_are_finite",
    "tests/trainers/test_grpo.py::test_variants_run",
    "tests/trainers/test_rloo.py::test_smoke_grpo_style",
    "tests/trainers/test_ppo.py::test_smoke_value_head",
    "tests/trainers/test_ppo.py::test_smoke_separate_critic_and_reward_model",
    "tests/trainers/test_agentic.py::test_tools_train_every_parameter_and_log_tool_metrics",
    "tests/trainers/test_agentic.py::test_guess_number_environment",
}


def pytest_addoption(parser):
    parser.addoption("--device", default=None, choices=["cpu", "cuda"],
                     help="train on this device in every trainer config (use with -m device_independent)")
    parser.addoption("--bf16", action="store_true", help="bf16 mixed precision in every trainer config")


def pytest_configure(config):
    config.addinivalue_line("markers", "device_independent: trainer tests that hold on any device and in bf16 "
                                       "(tests/conftest.py DEVICE_INDEPENDENT; run with --device cuda --bf16)")
    if config.getoption("--device") == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda, but torch sees no CUDA GPU")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in DEVICE_INDEPENDENT:
            item.add_marker(pytest.mark.device_independent)


@pytest.fixture(autouse=True)
def _device_and_precision(request, monkeypatch):
    """--device / --bf16: every posttrain config trains there and so (set before TrainingArguments reads them)."""
    device, bf16 = request.config.getoption("--device"), request.config.getoption("--bf16")
    if device is None and not bf16:
        return
    from posttrain.trainers.base import BaseConfig

    original = BaseConfig.__post_init__

    def post_init(self):
        if device is not None:
            self.use_cpu = device == "cpu"
        if bf16:
            self.bf16, self.fp16 = True, False
        original(self)

    monkeypatch.setattr(BaseConfig, "__post_init__", post_init)


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
