"""The accelerate config files shipped in examples/accelerate_configs/.

Every file parses as accelerate's own config class; the DDP file launches the `posttrain` CLI on 2 CPU
processes (gloo) and trains to the same weights as 1 process with the same global batch.
"""

import functools
import glob
import os
import sys

import pytest
import torch
from tests.helpers.launch import free_port, run_launch

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "examples", "accelerate_configs")
_run = functools.partial(run_launch, timeout=300)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIGS, "*.yaml"))), ids=os.path.basename)
def test_config_files_load(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(path)
    expected = {"single_process.yaml": "NO", "multi_gpu.yaml": "MULTI_GPU", "fsdp2.yaml": "FSDP",
                "deepspeed_zero2.yaml": "DEEPSPEED", "deepspeed_zero3.yaml": "DEEPSPEED"}[os.path.basename(path)]
    assert str(config.distributed_type).split(".")[-1] == expected
    if expected == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2
    if expected == "DEEPSPEED":
        assert config.deepspeed_config["zero_stage"] == int(os.path.basename(path)[-6])


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_ddp_config_runs_the_cli_on_two_processes_like_one(tmp_path):
    # plain SGD: Adam's first step is about lr * sign(gradient), which turns float-order noise in near-zero
    # gradients into differences of 2 * lr
    common = ["sft", "--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "reverse", "--max_steps", "1",
              "--learning_rate", "1.0", "--optim", "sgd", "--seed", "0", "--use_cpu", "true", "--report_to", "none"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    _run([sys.executable, "-m", "posttrain.cli", *common, "--per_device_train_batch_size", "8", "--output_dir", one],
         tmp_path)
    _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(CONFIGS, "multi_gpu.yaml"),
          "--num_processes", "2", "--main_process_port", str(free_port()), "-m", "posttrain.cli", *common,
          "--per_device_train_batch_size", "4", "--output_dir", two], tmp_path)
    a, b = _weights(one), _weights(two)
    assert sorted(a) == sorted(b)
    start = _weights_of_builtin()
    moved = [name for name in a if not torch.equal(a[name], start[name])]
    assert moved, "one SGD step at lr 1 moved no weight"
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=name)


def _weights_of_builtin():
    from posttrain.models.loading import load_causal_lm

    return {k: v.detach() for k, v in load_causal_lm("posttrain/tiny-qwen2").state_dict().items()}
