"""Scripts of TRL's shape (examples/trl_scripts/sft.py and dpo.py: parser -> ScriptArguments/Config/ModelConfig/
DatasetMixtureConfig, dataset or mixture, get_peft_config, get_quantization_config, trainer, train, save) run with
only the import changed, as Python and as the same flags through the `posttrain` console script; a --config file
written for `trl sft` (env:, a datasets: mixture) runs both ways; QLoRA (4-bit base, LoRA adapter) trains on CPU."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.tasks.builtin import load_builtin
from posttrain.models import loading

ROOT = Path(__file__).resolve().parent.parent
POSTTRAIN = os.path.join(os.path.dirname(sys.executable), "posttrain")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
COMMON = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--logging_steps", "1",
          "--seed", "0", "--report_to", "none", "--disable_tqdm", "true"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Local data folders, one jsonl per split, as `datasets.load_dataset(folder)` reads them in TRL's scripts."""
    root = tmp_path_factory.mktemp("data")
    for name, builtin in (("sft", "reverse"), ("dpo", "reverse/preference")):
        for split in ("train", "test"):
            load_builtin(builtin, split).select(range(12)).to_json(root / name / f"{split}.jsonl")
    return root


def run(argv, cwd) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def train_loss(stdout: str) -> float:
    return float(re.search(r"'train_loss': '?([0-9.]+)", stdout).group(1))


def both_ways(command: str, argv: list[str], out: Path) -> tuple[str, str]:
    """stdout of `python examples/trl_scripts/<command>.py ARGV` and of `posttrain <command> ARGV`."""
    script = run([sys.executable, str(ROOT / "examples" / "trl_scripts" / f"{command}.py"), *argv, "--output_dir",
                  str(out / "script")], cwd=out)
    console = run([POSTTRAIN, command, *argv, "--output_dir", str(out / "console")], cwd=out)
    return script, console


def test_trl_sft_script_with_lora_runs_as_python_and_through_the_console(data, tmp_path):
    model = loading.resolve("posttrain/tiny-qwen2")
    argv = ["--model_name_or_path", model, "--dataset_name", str(data / "sft"), *COMMON, "--use_peft", "--lora_r", "4",
            "--lora_target_modules", "q_proj", "v_proj"]
    script, console = both_ways("sft", argv, tmp_path)
    for out in ("script", "console"):
        adapter = json.loads((tmp_path / out / "adapter_config.json").read_text())
        assert adapter["r"] == 4 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    assert train_loss(script) == pytest.approx(train_loss(console), rel=1e-4)  # same model, data, seed, adapter


@pytest.mark.slow
def test_a_trl_sft_config_file_with_env_and_a_mixture_runs_both_ways(data, tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text(f"""# written for `trl sft --config recipe.yaml`
env:
  POSTTRAIN_RECIPE_SEEN: "yes"
model_name_or_path: {loading.resolve("posttrain/tiny-qwen2")}
datasets:
  - path: json
    data_files: {data / "sft" / "train.jsonl"}
    columns: [prompt, completion]
  - path: add
    split: train[:8]
    columns: [prompt, completion]
test_split_size: 0.25
eval_strategy: steps
eval_steps: 2
max_steps: 2
per_device_train_batch_size: 4
learning_rate: 1.0e-3
gradient_checkpointing: true
report_to: none
""")
    script, console = both_ways("sft", ["--config", str(config), "--seed", "0", "--disable_tqdm", "true"], tmp_path)
    for stdout in (script, console):
        assert "'eval_loss'" in stdout  # the mixture's 20 rows: 15 train, 5 test
    assert all((tmp_path / out / "model.safetensors").exists() for out in ("script", "console"))
    assert train_loss(script) == pytest.approx(train_loss(console), rel=1e-4)


@pytest.mark.slow
def test_trl_dpo_script_runs_as_python_and_through_the_console(data, tmp_path):
    model = loading.resolve("posttrain/tiny-qwen2")
    argv = ["--model_name_or_path", model, "--dataset_name", str(data / "dpo"), *COMMON, "--eval_strategy", "no",
            "--beta", "0.1"]
    script, console = both_ways("dpo", argv, tmp_path)
    assert train_loss(script) == pytest.approx(train_loss(console), rel=1e-4)  # ref: a second load / a frozen copy
    assert all((tmp_path / out / "model.safetensors").exists() for out in ("script", "console"))


def test_qlora_trains_a_lora_adapter_on_a_4bit_model_on_cpu(tmp_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from peft import LoraConfig

    from posttrain import ModelConfig, SFTConfig, SFTTrainer, get_quantization_config

    quantization = get_quantization_config(ModelConfig(load_in_4bit=True))
    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                     report_to="none", disable_tqdm=True, model_init_kwargs={"quantization_config": quantization})
    trainer = SFTTrainer("posttrain/tiny-qwen2", args=args, train_dataset=load_builtin("reverse").select(range(8)),
                         peft_config=LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    model = trainer.model
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    trainer.train()
    moved = [n for n, p in model.named_parameters() if n in trained and not torch.equal(p, trained[n])]
    assert sorted(moved) == sorted(trained)
    assert trainer.state.log_history[-1]["train_loss"] > 0
    with pytest.raises(ValueError, match="pass peft_config"):
        SFTTrainer("posttrain/tiny-qwen2", args=args, train_dataset=load_builtin("reverse").select(range(8)))


def test_qlora_through_the_console(tmp_path):
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "out"
    run([POSTTRAIN, "sft", "--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "reverse", *COMMON,
         "--load_in_4bit", "--use_peft", "--lora_r", "4", "--output_dir", str(out)], cwd=tmp_path)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
