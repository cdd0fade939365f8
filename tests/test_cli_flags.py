"""The CLI flags TRL users pass: model loading and LoRA (`--dtype`, `--use_peft`, ...), `--accelerate_config`,
the classic RLOO benchmark command, `posttrain env`'s accelerate config and optional engines, and the commands
docs/quickstart.md shows."""

import dataclasses
import filecmp
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from posttrain import cli

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model_name_or_path", "posttrain/tiny-qwen2"]
SFT = ["sft", *TINY, "--dataset_name", "reverse", "--max_steps", "1", "--per_device_train_batch_size", "4",
       "--learning_rate", "1e-2", "--disable_tqdm", "true", "--report_to", "none"]


# ---------------------------------------------------------------------------- model flags

def test_use_peft_trains_a_lora_adapter_of_the_given_rank_and_modules(tmp_path):
    out = tmp_path / "out"
    trainer = cli.run([*SFT, "--output_dir", str(out), "--use_peft", "--lora_r", "4", "--lora_target_modules",
                       "q_proj", "v_proj"])
    trained = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in name for name in trained)
    assert {name.split(".")[-4] for name in trained} == {"q_proj", "v_proj"}  # ...q_proj.lora_A.default.weight
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 32 and sorted(adapter["target_modules"]) == ["q_proj",
                                                                                                      "v_proj"]
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()


def test_dtype_loads_the_model_in_that_dtype(tmp_path):
    trainer = cli.run([*SFT, "--output_dir", str(tmp_path), "--dtype", "bfloat16"])
    assert trainer.model.dtype == torch.bfloat16
    assert trainer.args.model_init_kwargs == {"dtype": "bfloat16"}


def test_model_flags_go_into_model_init_kwargs():
    _, config = cli.parse("sft", [*SFT[1:], "--output_dir", "o"])
    assert config.model_init_kwargs is None  # trust_remote_code stays off unless asked for
    script_args, config = cli.parse("sft", [*SFT[1:], "--output_dir", "o", "--dtype", "auto", "--attn_implementation",
                                            "eager", "--trust_remote_code", "--model_init_kwargs",
                                            '{"low_cpu_mem_usage": true}'])
    assert config.model_init_kwargs == {"dtype": "auto", "attn_implementation": "eager", "trust_remote_code": True,
                                        "low_cpu_mem_usage": True}
    assert cli.peft_config(script_args) is None


def test_trust_remote_code_runs_the_model_folders_own_classes_only_when_given(tmp_path, remote_code_model):
    folder = remote_code_model
    argv = ["--model_name_or_path", str(folder), "--dataset_name", "zen", "--output_dir", str(tmp_path / "out")]
    trainer = cli.COMMANDS["sft"](*cli.parse("sft", argv))  # off by default: transformers' own Qwen2 classes
    assert type(trainer.model).__name__ == "Qwen2ForCausalLM"
    assert type(trainer.processing_class).__name__ != "RemoteTokenizer"
    trainer = cli.COMMANDS["sft"](*cli.parse("sft", [*argv, "--trust_remote_code"]))
    assert (type(trainer.model).__name__, type(trainer.processing_class).__name__) == ("RemoteLM", "RemoteTokenizer")


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "float64"], "argument --dtype: invalid"),
    (["--dtype", "float16", "--model_init_kwargs", '{"dtype": "bfloat16"}'],
     "--dtype float16 contradicts model_init_kwargs {'dtype': 'bfloat16'}"),
])
def test_bad_model_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse("sft", [*SFT[1:], "--output_dir", "o", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_lora_flags_make_the_peft_config():
    script_args, _ = cli.parse("reward", [*TINY, "--dataset_name", "reverse/preference", "--output_dir", "o",
                                          "--use_peft", "true", "--lora_r", "8", "--lora_alpha", "16",
                                          "--lora_dropout", "0", "--lora_target_modules", "all-linear",
                                          "--lora_modules_to_save", "score", "--use_rslora"])
    lora = cli.peft_config(script_args, "SEQ_CLS")  # posttrain reward's default task type
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.target_modules) == (8, 16, 0.0, "all-linear")
    assert lora.task_type == "SEQ_CLS" and lora.use_rslora and not lora.use_dora
    assert set(lora.modules_to_save) == {"score"}
    script_args, _ = cli.parse("sft", [*SFT[1:], "--output_dir", "o", "--use_peft", "--lora_task_type", "SEQ_2_SEQ_LM"])
    assert cli.peft_config(script_args).task_type == "SEQ_2_SEQ_LM"


def test_model_flags_have_their_own_help_group(capsys):
    with pytest.raises(SystemExit):
        cli.parse("grpo", ["--help-all"])
    out = capsys.readouterr().out
    model, script = out.index("ModelArguments:"), out.index("OnlineScriptArguments:")
    assert model < out.index("\n  --lora_r") < script < out.index("\n  --dataset_name")


# ---------------------------------------------------------------------------- posttrain env

def test_env_reports_the_accelerate_config_and_optional_engines(tmp_path, monkeypatch, capsys):
    import importlib.metadata as metadata

    from accelerate.commands.config import config_args

    saved = tmp_path / "default_config.yaml"
    saved.write_text((ROOT / "posttrain" / "accelerate_configs" / "multi_gpu.yaml").read_text())
    monkeypatch.setattr(config_args, "default_config_file", str(saved))
    real_version = metadata.version

    def version(name):  # as if vllm were missing and deepspeed installed, whatever this machine has
        if name == "vllm":
            raise metadata.PackageNotFoundError(name)
        return "0.99.1" if name == "deepspeed" else real_version(name)

    monkeypatch.setattr(metadata, "version", version)
    cli.run(["env"])
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert rows["accelerate config"] == f"{saved} (distributed_type: MULTI_GPU)"
    assert rows["vllm"] == "not installed" and rows["deepspeed"] == "0.99.1"
    assert rows["peft"] == real_version("peft")
    for engine in ("liger-kernel", "bitsandbytes", "wandb", "trackio"):
        assert rows[engine]  # a version or "not installed"
    monkeypatch.setattr(config_args, "default_config_file", str(tmp_path / "absent.yaml"))
    cli.run(["env"])
    assert re.search(r"^accelerate config\s+none$", capsys.readouterr().out, flags=re.M)


# ---------------------------------------------------------------------------- --accelerate_config

def test_shipped_accelerate_configs_are_the_documented_examples():
    shipped = sorted(os.listdir(ROOT / "posttrain" / "accelerate_configs"))
    assert shipped == sorted(os.listdir(ROOT / "examples" / "accelerate_configs"))
    assert cli.accelerate_config_names() == [name[:-5] for name in shipped]
    match, mismatch, errors = filecmp.cmpfiles(ROOT / "posttrain" / "accelerate_configs",
                                               ROOT / "examples" / "accelerate_configs", shipped, shallow=False)
    assert (mismatch, errors) == ([], []), "copy examples/accelerate_configs/ to posttrain/accelerate_configs/"


def test_accelerate_config_builds_the_launch_command(tmp_path):
    shipped = os.path.join(cli.ACCELERATE_CONFIGS, "multi_gpu.yaml")
    argv = [*TINY, "--accelerate_config", "multi_gpu", "--num_processes", "2", "--dataset_name", "reverse",
            "--main_process_port=29511", "--reward_funcs", "digit_match", "exact_match"]
    assert cli.launch_command("grpo", argv) == [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", shipped, "--num_processes", "2",
        "--main_process_port", "29511", "-m", "posttrain.cli", "grpo", *TINY, "--dataset_name", "reverse",
        "--reward_funcs", "digit_match", "exact_match"]
    own = tmp_path / "mine.yaml"
    own.write_text("distributed_type: 'NO'\n")
    assert cli.launch_command("sft", ["--accelerate-config", str(own), *TINY])[3:5] == ["--config_file", str(own)]
    zero3 = cli.launch_command("sft", ["--accelerate_config", "zero3"])  # TRL's name
    assert zero3[4] == os.path.join(cli.ACCELERATE_CONFIGS, "deepspeed_zero3.yaml")
    assert cli.launch_command("sft", [*TINY]) is None


@pytest.mark.parametrize("argv, message", [
    (["--accelerate_config", "multi_gpus"], "--accelerate_config 'multi_gpus' is neither a file nor a shipped "
                                            "config; shipped: deepspeed_zero2, deepspeed_zero3, fsdp2, multi_gpu"),
    (["--num_processes", "2"], "--num_processes is a launcher flag: it needs --accelerate_config"),
])
def test_accelerate_config_mistakes_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.run([*SFT, "--output_dir", "o", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def _moved(state: dict) -> list[str]:
    """Names of the weights that differ from the built-in tiny-qwen2's."""
    from posttrain.models.loading import load_causal_lm

    start = load_causal_lm("posttrain/tiny-qwen2").state_dict()
    return [name for name, value in state.items() if not torch.equal(value.float(), start[name].float())]


def test_accelerate_config_single_process_runs_the_command_under_accelerate(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    assert cli.run([*SFT, "--output_dir", str(out), "--accelerate_config", "single_process", "--use_cpu",
                    "true"]) is None  # the trainer lived in the launched process
    assert _moved(load_file(out / "model.safetensors"))


def test_a_failed_launch_exits_with_its_status(monkeypatch):
    import subprocess

    launched = []
    monkeypatch.setattr(subprocess, "run", lambda command: launched.append(command) or
                        subprocess.CompletedProcess(command, 3))
    with pytest.raises(SystemExit) as exit_info:
        cli.run([*SFT, "--output_dir", "o", "--accelerate_config", "single_process"])
    assert exit_info.value.code == 3 and launched[0][-len(SFT) - 2:] == [*SFT, "--output_dir", "o"]


# ---------------------------------------------------------------------------- classic RLOO command, rewards

def test_classic_rloo_benchmark_command_runs(tmp_path):
    """The classic RLOO docs' benchmark command, with tiny models and sizes."""
    trainer = cli.run([
        "rloo", "--output_dir", str(tmp_path), "--num_ppo_epochs", "2", "--num_mini_batches", "2",
        "--learning_rate", "3e-6", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
        "--total_episodes", "16", "--model_name_or_path", "posttrain/tiny-qwen2", "--sft_model_path",
        "posttrain/tiny-qwen2", "--reward_model_path", "posttrain/tiny-qwen2-seqcls",
        "--local_rollout_forward_batch_size", "16", "--missing_eos_penalty", "1.0", "--stop_token", "eos",
        "--kl_coef", "0.03", "--dataset_name", "reverse", "--dataset_test_split", "validation",
        "--response_length", "8", "--logging_steps", "1", "--disable_tqdm", "true", "--report_to", "none"])
    # 16 completions per generation, 2 passes of 2 mini-batches each
    assert trainer.state.global_step == 4 and trainer.args.beta == 0.03
    assert trainer.eval_dataset is None  # the split is only read when evaluating
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert _moved({name: p.detach() for name, p in trainer.model.state_dict().items()})
    assert (tmp_path / "model.safetensors").exists()


def test_sft_model_path_is_the_policy_and_model_name_the_tokenizer(tmp_path, monkeypatch):
    from posttrain.trainers.rloo import RLOOTrainer

    seen = {}
    monkeypatch.setattr(RLOOTrainer, "__init__", lambda self, **kwargs: seen.update(kwargs))
    base = ["--dataset_name", "reverse", "--output_dir", str(tmp_path), "--reward_funcs", "digit_match"]
    script_args, config = cli.parse("rloo", [*base, "--sft_model_path", "sft-folder", *TINY])
    cli.COMMANDS["rloo"](script_args, config)
    assert seen["model"] == "sft-folder" and seen["processing_class"] == "posttrain/tiny-qwen2"
    script_args, config = cli.parse("rloo", [*base, "--sft_model_path", "sft-folder"])  # no model name needed
    cli.COMMANDS["rloo"](script_args, config)
    assert seen["model"] == "sft-folder" and seen["processing_class"] == "sft-folder"
    _, config = cli.parse("rloo", [*base, *TINY, "--exp_name", "pythia-rloo"])
    assert config.run_name == "pythia-rloo"


# OnPolicyConfig + RLOOConfig fields of classic TRL (0.11-0.13) that are set by users
CLASSIC_RLOO_FIELDS = [
    "run_name", "num_mini_batches", "total_episodes", "local_rollout_forward_batch_size", "num_sample_generations",
    "response_length", "stop_token", "stop_token_id", "temperature", "missing_eos_penalty", "sft_model_path",
    "push_to_hub", "exp_name", "reward_model_path", "num_ppo_epochs", "whiten_rewards", "kl_coef", "cliprange",
    "rloo_k", "normalize_reward", "reward_clip_range", "normalize_advantage", "token_level_kl"]
# meaningless here: batch sizes the classic trainer computed into its config (world_size, batch_size, ...) are
# derived, not set; dataset_num_proc (prompts are tokenised as batches are drawn) and ds3_gather_for_generation
# (no DeepSpeed-specific generation path) have nothing to act on
CLASSIC_RLOO_DROPPED = ["world_size", "num_total_batches", "micro_batch_size", "local_batch_size", "batch_size",
                        "local_mini_batch_size", "mini_batch_size", "dataset_num_proc", "ds3_gather_for_generation"]


def test_every_classic_rloo_field_that_means_something_is_a_flag():
    from posttrain.trainers.rloo import RLOOConfig

    fields = {f.name for f in dataclasses.fields(RLOOConfig)}
    assert [name for name in CLASSIC_RLOO_FIELDS if name not in fields] == []
    assert not set(CLASSIC_RLOO_FIELDS) & set(CLASSIC_RLOO_DROPPED)


@pytest.mark.parametrize("command", ["grpo", "rloo", "ppo"])
def test_no_reward_is_a_usage_error_before_loading(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.run([command, *TINY, "--dataset_name", "reverse", "--output_dir", "o"])
    assert exit_info.value.code == 2
    assert "no reward: give --reward_funcs" in capsys.readouterr().err


# ---------------------------------------------------------------------------- docs

def _shell_commands(text: str) -> list[list[str]]:
    """The `posttrain ...` commands of the bash blocks (continuation lines joined)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("posttrain "):
                commands.append(shlex.split(line)[1:])
    return commands


def test_quickstart_commands_parse():
    commands = _shell_commands((ROOT / "docs" / "quickstart.md").read_text())
    assert {argv[0] for argv in commands} >= {"sft", "grpo"}
    for argv in commands:
        if argv[0] in ("env", "demo"):
            continue
        script_args, config = cli.parse(argv[0], argv[1:])
        assert script_args.model_name_or_path or getattr(config, "sft_model_path", None)
