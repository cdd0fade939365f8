"""The `posttrain` command: sft end to end, YAML + flag precedence, env, dataset resolution, errors."""

import json

import pytest
from datasets import Dataset, DatasetDict

from posttrain import cli

TINY = ["--model_name_or_path", "posttrain/tiny-qwen2"]


def test_sft_end_to_end_writes_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    trainer = cli.main(["sft", *TINY, "--dataset_name", "zen/prompt_completion", "--output_dir", str(out),
                        "--max_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate", "1e-3",
                        "--packing", "--max_length", "64", "--disable_tqdm", "true"])
    assert trainer.state.global_step == 2 and trainer.args.packing and trainer.args.padding_free is False
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2"
    assert (out / "tokenizer.json").exists()


def test_yaml_values_are_overridden_by_flags(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: posttrain/tiny-qwen2\ndataset_name: zen\nlearning_rate: 1e-3\n"
                    "max_length: 128\npacking: true\nmodel_init_kwargs: {dtype: float32}\nreport_to: none\n")
    script_args, config = cli.parse("sft", ["--config", str(path), "--max_length", "32", "--output_dir", "o",
                                            "--packing", "false", "--lr_scheduler_kwargs", '{"num_cycles": 2}'])
    assert script_args.model_name_or_path == "posttrain/tiny-qwen2" and script_args.dataset_name == "zen"
    assert config.learning_rate == 1e-3  # PyYAML reads 1e-3 as a string; the field's type converts it
    assert config.max_length == 32 and config.packing is False and config.padding_free is None
    assert config.model_init_kwargs == {"dtype": "float32"} and config.lr_scheduler_kwargs == {"num_cycles": 2}
    _, config = cli.parse("sft", [*TINY, "--dataset_name", "zen", "--output_dir", "o", "--completion_only_loss", "none",
                                  "--eval_packing", "true", "--max-length", "7"])
    assert config.completion_only_loss is None and config.eval_packing is True and config.max_length == 7


@pytest.mark.parametrize("argv, message", [
    (["--bogus", "1"], "unrecognized arguments: --bogus"),
    (["--max_length", "abc"], "argument --max_length/--max-length: invalid int | None value: 'abc'"),
    (["--packing", "maybe"], "invalid bool value: 'maybe'"),
    (["--packing_strategy", "greedy"], "invalid SFTConfig: packing_strategy='greedy'"),
])
def test_bad_flags_give_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.parse("sft", [*TINY, "--dataset_name", "zen", "--output_dir", "o", *argv])
    assert message in capsys.readouterr().err


def test_bad_yaml_and_missing_arguments(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("learning_rat: 0.1\n")
    with pytest.raises(SystemExit):
        cli.parse("sft", ["--config", str(path), *TINY, "--dataset_name", "zen"])
    assert "unknown field 'learning_rat'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse("sft", ["--output_dir", "o", *TINY])
    assert "required: --dataset_name" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown command 'fly'"):
        cli.main(["fly"])


def test_env(capsys):
    assert cli.main(["env"]) is None
    out = capsys.readouterr().out
    for key in ("posttrain", "python", "torch", "transformers", "datasets", "accelerate", "peft",
                "CPU count", "memory", "CUDA available", "bf16 supported"):
        assert key in out


def test_help_lists_commands(capsys):
    cli.main([])
    out = capsys.readouterr().out
    assert "sft" in out and "env" in out


def test_load_dataset_arg(tmp_path):
    assert cli.load_dataset_arg("reverse", "test").column_names == ["prompt", "completion", "answer"]
    rows = [{"prompt": "a", "completion": " b"}, {"prompt": "c", "completion": " d"}]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    assert cli.load_dataset_arg(str(jsonl))["prompt"] == ["a", "c"]
    with pytest.raises(ValueError, match="single split"):
        cli.load_dataset_arg(str(jsonl), "test")
    folder = tmp_path / "saved"
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])}).save_to_disk(str(folder))
    assert len(cli.load_dataset_arg(str(folder), "test")) == 1
    files = tmp_path / "files"
    files.mkdir()
    (files / "train.jsonl").write_text(jsonl.read_text())
    assert len(cli.load_dataset_arg(str(files), "train")) == 2
    with pytest.raises(ValueError, match="not a built-in dataset, a local file or a local folder"):
        cli.load_dataset_arg("someone/some-hub-dataset")
