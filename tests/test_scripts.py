"""TRL's script helpers (`posttrain.scripts`) against what TRL documents: the dataclasses' fields and defaults,
TrlParser's flags, --config files with `env:`, unknown keys, the dataset mixture, the PEFT and quantization configs."""

import dataclasses
import os

import pytest
import torch

from posttrain import (DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser, get_dataset, get_kbit_device_map,
                       get_peft_config, get_quantization_config)
from posttrain.tasks.builtin import load_builtin
from posttrain.scripts import DatasetConfig, load_split


def defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_script_arguments_and_model_config_have_trls_fields_and_defaults():
    assert defaults(ScriptArguments) == {
        "dataset_name": None, "dataset_config": None, "dataset_train_split": "train", "dataset_test_split": "test",
        "dataset_streaming": False, "gradient_checkpointing_use_reentrant": False, "ignore_bias_buffers": False}
    assert defaults(ModelConfig) == {
        "model_name_or_path": None, "model_revision": "main", "dtype": "float32", "trust_remote_code": False,
        "attn_implementation": None, "use_peft": False, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
        "lora_target_modules": None, "lora_target_parameters": None, "lora_modules_to_save": None,
        "lora_task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False, "load_in_8bit": False,
        "load_in_4bit": False, "bnb_4bit_quant_type": "nf4", "use_bnb_nested_quant": False}
    assert {f.name for f in dataclasses.fields(DatasetMixtureConfig)} == {"datasets", "streaming", "test_split_size"}
    assert DatasetMixtureConfig().datasets == [] and DatasetMixtureConfig().test_split_size is None
    assert ModelConfig(lora_target_modules=["all-linear"]).lora_target_modules == "all-linear"
    with pytest.raises(ValueError, match="choose one precision"):
        ModelConfig(load_in_4bit=True, load_in_8bit=True)
    for cls in (ScriptArguments, ModelConfig, DatasetMixtureConfig, DatasetConfig):
        assert all(f.metadata.get("help") for f in dataclasses.fields(cls)), cls


@dataclasses.dataclass
class MyArguments:
    arg1: int
    arg2: str = "alpha"
    flag: bool = False
    on: bool = True
    words: list[str] | None = None


def test_trl_parser_reads_flags_and_a_config_file_with_env(tmp_path, monkeypatch):
    """TRL's documented example: a YAML with `env: {VAR1: value1}` and `arg1: 23`; flags override the file."""
    monkeypatch.delenv("VAR1", raising=False)
    config = tmp_path / "config.yaml"
    config.write_text("env:\n  VAR1: value1\narg1: 23\n")
    parser = TrlParser(dataclass_types=[MyArguments])
    assert parser.parse_args_and_config(["--config", str(config)]) == (MyArguments(arg1=23),)
    assert os.environ["VAR1"] == "value1"
    assert parser.parse_args_and_config(["--arg1", "5", "--arg2", "beta"]) == (MyArguments(5, "beta"),)
    parser = TrlParser(MyArguments)
    assert parser.parse_args_and_config([f"--config={config}", "--arg1", "7"])[0].arg1 == 7


@pytest.mark.parametrize("argv, expected", [
    (["--flag"], dict(flag=True)), (["--flag", "false"], dict(flag=False)), (["--flag", "yes"], dict(flag=True)),
    (["--no_on"], dict(on=False)), (["--on", "false"], dict(on=False)), (["--words", "a", "b"], dict(words=["a", "b"])),
])
def test_trl_parser_bool_and_list_flags_as_hfargumentparser(argv, expected):
    (parsed,) = TrlParser([MyArguments]).parse_args_and_config(["--arg1", "1", *argv])
    assert parsed == MyArguments(arg1=1, **expected)


def test_trl_parser_unknown_config_keys_and_remaining_strings(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("arg1: 2\nstranger: 3\n")
    parser = TrlParser([MyArguments])
    with pytest.raises(ValueError, match=r"unknown field\(s\) in the config file: \['--stranger'\]"):
        parser.parse_args_and_config(["--config", str(config)])
    parsed, remaining = TrlParser([MyArguments]).parse_args_and_config(
        ["--config", str(config), "--launcher_flag", "x"], return_remaining_strings=True)
    assert parsed == MyArguments(arg1=2) and remaining == ["--stranger", "3", "--launcher_flag", "x"]
    assert TrlParser([MyArguments]).parse_args_and_config(["--config", str(config)],
                                                          fail_with_unknown_args=False) == (MyArguments(arg1=2),)
    with pytest.raises(ValueError, match="not used by the TrlParser"):
        TrlParser([MyArguments]).parse_args_and_config(["--arg1", "1", "--stray"])


def test_trl_parser_refusals(tmp_path):
    @dataclasses.dataclass
    class WithConfig:
        config: str = "x"

    with pytest.raises(ValueError, match="field named 'config'"):
        TrlParser([WithConfig])
    bad = tmp_path / "bad.yaml"
    bad.write_text("arg1: many\n")
    with pytest.raises(ValueError, match=r"config field 'arg1': expected int, got str 'many'"):
        TrlParser([MyArguments]).parse_args_and_config(["--config", str(bad)])
    bad.write_text("env: [A]\narg1: 1\n")
    with pytest.raises(ValueError, match="`env` must be a mapping"):
        TrlParser([MyArguments]).parse_args_and_config(["--config", str(bad)])
    with pytest.raises(SystemExit):  # argparse's usage error, as HfArgumentParser's
        TrlParser([MyArguments]).parse_args_and_config([])  # arg1 is required


def test_trl_parser_takes_the_training_dataclasses_of_a_trl_script(tmp_path):
    """(ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig) as TRL's sft.py parses them; the YAML's
    `datasets:` list becomes DatasetConfigs; trust_remote_code, a field of SFTConfig and ModelConfig, sets both."""
    from posttrain import SFTConfig

    config = tmp_path / "sft.yaml"
    config.write_text("model_name_or_path: posttrain/tiny-qwen2\nlearning_rate: 2.0e-5\npacking: true\n"
                      "datasets:\n  - path: reverse\n    split: train[:10]\n    columns: [prompt, completion]\n"
                      "test_split_size: 0.2\nlora_target_modules: all-linear\n")
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig))
    script, training, model, data = parser.parse_args_and_config(
        ["--config", str(config), "--output_dir", str(tmp_path), "--use_peft", "--trust_remote_code", "--lora_r", "4"])
    assert script == ScriptArguments() and training.learning_rate == 2e-5 and training.packing
    assert (model.use_peft, model.lora_r, model.lora_target_modules) == (True, 4, "all-linear")
    assert model.trust_remote_code and training.trust_remote_code
    assert data.datasets == [DatasetConfig(path="reverse", split="train[:10]", columns=["prompt", "completion"])]


def test_get_dataset_mixes_slices_columns_and_splits_off_a_test_set(tmp_path):
    reverse, add = load_builtin("reverse"), load_builtin("add")
    mixture = DatasetMixtureConfig(datasets=[
        {"path": "reverse", "split": "train[:1%]", "columns": ["prompt", "completion"]},  # 1% of 2000: 20 rows
        DatasetConfig(path="add", split="train[10:15]", columns=["prompt", "completion"])])
    (train,) = get_dataset(mixture).values()
    assert len(train) == 25 and train.column_names == ["prompt", "completion"]
    assert list(train["prompt"]) == list(reverse["prompt"][:20]) + list(add["prompt"][10:15])
    split = get_dataset(dataclasses.replace(mixture, test_split_size=0.2))
    assert (len(split["train"]), len(split["test"])) == (20, 5)
    assert sorted([*split["train"]["prompt"], *split["test"]["prompt"]]) == sorted(train["prompt"])
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c", "completion": "d"}\n')
    files = get_dataset(DatasetMixtureConfig(datasets=[{"path": "json", "data_files": str(rows)}]))["train"]
    assert list(files["prompt"]) == ["a", "c"]
    streamed = get_dataset(DatasetMixtureConfig(datasets=["reverse"], streaming=True))["train"]
    assert next(iter(streamed))["prompt"] == reverse[0]["prompt"]


def test_get_dataset_refusals():
    with pytest.raises(ValueError, match="mixture is empty"):
        get_dataset(DatasetMixtureConfig())
    with pytest.raises(ValueError, match=r"datasets\[0\] \('reverse', split 'train'\): no column\(s\) \['label'\]"):
        get_dataset(DatasetMixtureConfig(datasets=[{"path": "reverse", "columns": ["prompt", "label"]}]))
    with pytest.raises(ValueError, match=r"datasets\[0\]: unknown key\(s\) \['weight'\]"):
        DatasetMixtureConfig(datasets=[{"path": "reverse", "weight": 0.5}])
    with pytest.raises(ValueError, match="not a split name or a slice"):
        load_split("reverse", "train[:half]")


def test_get_peft_config_as_trl_builds_it():
    assert get_peft_config(ModelConfig()) is None
    lora = get_peft_config(ModelConfig(use_peft=True, lora_r=8, lora_alpha=16, lora_dropout=0.0,
                                       lora_target_modules=["q_proj", "v_proj"], lora_modules_to_save=["lm_head"],
                                       use_rslora=True))
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.bias, lora.task_type) == (8, 16, 0.0, "none", "CAUSAL_LM")
    assert set(lora.target_modules) == {"q_proj", "v_proj"} and set(lora.modules_to_save) == {"lm_head"}
    assert lora.use_rslora and not lora.use_dora


def test_get_quantization_config_and_device_map():
    assert get_quantization_config(ModelConfig()) is None
    four = get_quantization_config(ModelConfig(load_in_4bit=True, dtype="bfloat16", bnb_4bit_quant_type="fp4",
                                               use_bnb_nested_quant=True))
    assert four.load_in_4bit and not four.load_in_8bit and four.bnb_4bit_quant_type == "fp4"
    assert four.bnb_4bit_compute_dtype == torch.bfloat16 and four.bnb_4bit_use_double_quant
    assert four.bnb_4bit_quant_storage == torch.bfloat16
    auto = get_quantization_config(ModelConfig(load_in_4bit=True, dtype="auto"))  # bitsandbytes' own defaults
    assert auto.bnb_4bit_compute_dtype == torch.float32 and auto.bnb_4bit_quant_storage == torch.uint8
    eight = get_quantization_config(ModelConfig(load_in_8bit=True))
    assert eight.load_in_8bit and not eight.load_in_4bit
    assert get_kbit_device_map() == (None if not torch.cuda.is_available() else {"": 0})


# ---------------------------------------------------------------------------- the posttrain commands take TRL's flags

def test_cli_takes_trls_dataset_and_model_flags(tmp_path, monkeypatch):
    from posttrain import cli

    monkeypatch.delenv("RECIPE_VAR", raising=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("env:\n  RECIPE_VAR: 7\nmodel_name_or_path: posttrain/tiny-qwen2\n"
                      "datasets:\n  - path: reverse\n    split: train[:4]\n  - path: add\n    split: test[:2]\n"
                      "test_split_size: 2\nmodel_revision: v1\n")
    script_args, config = cli.parse("sft", ["--config", str(recipe), "--output_dir", str(tmp_path), "--eval_strategy",
                                            "steps", "--load_in_4bit", "--use_peft", "--no_lean_activations"])
    assert os.environ["RECIPE_VAR"] == "7" and config.lean_activations is False
    train, evaluation = cli.load_datasets(script_args, config)
    assert (len(train), len(evaluation)) == (4, 2)
    kwargs = config.model_init_kwargs
    assert kwargs["revision"] == "v1" and kwargs["quantization_config"].load_in_4bit
    script_args, config = cli.parse("dpo", ["--model_name_or_path", "posttrain/tiny-qwen2", "--output_dir", "o",
                                            "--datasets", '{"path": "reverse/preference", "split": "train[:3]"}',
                                            "zen/preference"])
    assert [d.path for d in script_args.datasets] == ["reverse/preference", "zen/preference"]
    assert len(cli.load_datasets(script_args, config)[0]) == 3 + len(load_builtin("zen/preference"))
    script_args, config = cli.parse("sft", ["--model_name_or_path", "posttrain/tiny-qwen2", "--output_dir", "o",
                                            "--dataset_name", "reverse", "--dataset_train_split", "train[:5]"])
    assert len(cli.load_datasets(script_args, config)[0]) == 5 and config.model_init_kwargs is None


def test_cli_mixture_without_a_test_split_is_named_when_evaluation_needs_one(tmp_path):
    from posttrain import cli

    script_args, config = cli.parse("sft", ["--model_name_or_path", "posttrain/tiny-qwen2", "--output_dir", "o",
                                            "--datasets", "reverse", "--eval_strategy", "steps"])
    with pytest.raises(cli.DatasetError, match="give --test_split_size"):
        cli.load_datasets(script_args, config)


def test_env_prints_the_fields_trl_env_prints(capsys):
    from posttrain import cli

    cli.run(["env"])
    rows = dict(line.split(None, 1) if "  " not in line else [p.strip() for p in line.split("  ", 1)]
                for line in capsys.readouterr().out.splitlines())
    for name in ("platform", "python", "torch", "transformers", "accelerate", "accelerate config", "datasets",
                 "huggingface_hub", "bitsandbytes", "deepspeed", "diffusers", "liger-kernel", "llm-blender", "openai",
                 "peft", "vllm", "CUDA device(s)"):
        assert rows.get(name), name


def test_trust_remote_code_is_a_field_of_every_config(tmp_path):
    from posttrain import DPOConfig, GRPOConfig, RewardConfig, SFTConfig

    for config_class in (SFTConfig, DPOConfig, GRPOConfig, RewardConfig):
        config = config_class(output_dir=str(tmp_path), trust_remote_code=True)
        assert config.model_init_kwargs == {"trust_remote_code": True}
        assert config_class(output_dir=str(tmp_path)).model_init_kwargs is None
    with pytest.raises(ValueError, match="contradicts"):
        SFTConfig(output_dir=str(tmp_path), trust_remote_code=True, model_init_kwargs={"trust_remote_code": False})


def test_value_head_model_from_a_model_object():
    from posttrain import AutoModelForCausalLMWithValueHead, load_causal_lm

    policy = load_causal_lm("posttrain/tiny-qwen2")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(policy)
    assert model.pretrained_model is policy and torch.count_nonzero(model.v_head.summary.weight) == 0
    assert AutoModelForCausalLMWithValueHead.from_pretrained(model) is model
    logits, loss, value = model(torch.tensor([[1, 2, 3]]))
    assert logits.shape[:2] == value.shape == (1, 3) and loss is None


def test_sft_skip_prepare_dataset_with_a_mask_asked_for_but_absent_is_refused(tmp_path):
    from datasets import Dataset

    from posttrain import SFTConfig, SFTTrainer

    rows = Dataset.from_list([{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6, 7]}])
    args = SFTConfig(output_dir=str(tmp_path), dataset_kwargs={"skip_prepare_dataset": True}, assistant_only_loss=True)
    with pytest.raises(ValueError, match=r"assistant_only_loss=True .* needs the rows' mask"):
        SFTTrainer("posttrain/tiny-qwen2", args=args, train_dataset=rows)
    masked = rows.add_column("assistant_masks", [[0, 0, 1, 1], [0, 1, 1]])
    assert SFTTrainer("posttrain/tiny-qwen2", args=args, train_dataset=masked).train_dataset is masked


def test_cli_gradient_checkpointing_use_reentrant_reaches_the_config():
    from posttrain import cli

    argv = ["--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "reverse", "--output_dir", "o"]
    assert cli.parse("sft", argv)[1].gradient_checkpointing_kwargs is None
    _, config = cli.parse("sft", [*argv, "--gradient_checkpointing", "--gradient_checkpointing_use_reentrant"])
    assert config.gradient_checkpointing_kwargs == {"use_reentrant": True}


def test_cli_quantized_loading_needs_an_adapter_and_bitsandbytes(capsys, monkeypatch):
    import importlib.util

    from posttrain import cli

    argv = ["--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "reverse", "--output_dir", "o"]
    with pytest.raises(SystemExit):
        cli.parse("sft", [*argv, "--load_in_8bit"])
    assert "--load_in_8bit loads weights that cannot be trained: add --use_peft" in capsys.readouterr().err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(SystemExit):
        cli.parse("sft", [*argv, "--load_in_4bit", "--use_peft"])
    assert "needs the bitsandbytes package: pip install 'posttrain[qlora]'" in capsys.readouterr().err


def test_kto_precomputed_reference_scores_new_eval_data_until_training(tmp_path):
    from posttrain import KTOConfig, KTOTrainer

    data = load_builtin("zen/unpaired_preference")
    args = KTOConfig(output_dir=str(tmp_path), precompute_ref_log_probs=True, per_device_train_batch_size=4,
                     max_steps=1, report_to="none", disable_tqdm=True)
    trainer = KTOTrainer("posttrain/tiny-qwen2", args=args, train_dataset=data.select(range(8)))
    metrics = trainer.evaluate(eval_dataset=data.select(range(8, 12)))
    assert metrics["eval_loss"] == pytest.approx(0.5, abs=1e-4)  # at the reference every reward is 0: 1 - σ(0)
    trainer.train()
    with pytest.raises(ValueError, match="trained since"):
        trainer.evaluate(eval_dataset=data.select(range(8, 12)))
