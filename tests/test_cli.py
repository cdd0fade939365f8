"""The `posttrain` command: sft end to end, YAML + flag precedence, env, dataset resolution, errors."""

import dataclasses
import json

import pytest
from datasets import Dataset, DatasetDict

from posttrain import cli

TINY = ["--model_name_or_path", "posttrain/tiny-qwen2"]


def test_sft_end_to_end_writes_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    trainer = cli.run(["sft", *TINY, "--dataset_name", "zen/prompt_completion", "--output_dir", str(out),
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
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fly"])
    assert exit_info.value.code == 2 and "unknown command 'fly'" in capsys.readouterr().err


def test_env(capsys):
    assert cli.run(["env"]) is None
    out = capsys.readouterr().out
    for key in ("posttrain", "python", "torch", "transformers", "datasets", "accelerate", "peft",
                "CPU count", "memory", "CUDA available", "bf16 supported"):
        assert key in out


def test_help_lists_commands(capsys):
    cli.main(["--help"])
    out = capsys.readouterr().out
    assert "sft" in out and "env" in out


def test_bare_posttrain_prints_usage_and_exits_2_and_version_prints_it(capsys):
    import posttrain

    with pytest.raises(SystemExit) as exit_info:
        cli.main([])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "sft" in err and "env" in err and "no command given" in err
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"posttrain {posttrain.__version__}"


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
    with pytest.raises(cli.DatasetError, match="not a built-in dataset, a local file or a local folder"):
        cli.load_dataset_arg("someone/some-hub-dataset")


ONLINE = [*TINY, "--dataset_name", "reverse", "--output_dir", "o"]


@pytest.mark.parametrize("line, shown", [
    ("max_steps: 1.7", "max_steps: expected int, got float 1.7"),
    ("max_steps: [1, 2]", "max_steps: expected int, got list [1, 2]"),
    ("max_steps: true", "max_steps: expected int, got bool True"),
    ("learning_rate: fast", "learning_rate: expected float, got str 'fast'"),
    ("packing: 3", "packing: expected bool, got int 3"),
    ("model_init_kwargs: [1]", "model_init_kwargs: expected dict | None, got list [1]"),
])
def test_yaml_values_are_type_checked_before_anything_loads(tmp_path, capsys, line, shown):
    path = tmp_path / "sft.yaml"
    path.write_text(line + "\n")
    with pytest.raises(SystemExit):
        cli.parse("sft", ["--config", str(path), *TINY, "--dataset_name", "zen", "--output_dir", "o"])
    assert f"{path}: {shown}" in capsys.readouterr().err


def test_yaml_typed_values_that_fit(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text("max_steps: 3\nlearning_rate: 1\nreward_funcs: digit_match\nreward_weights: [1, 0.5]\n"
                    "report_to: none\n")
    script_args, config = cli.parse("grpo", ["--config", str(path), *ONLINE])
    assert config.max_steps == 3 and config.learning_rate == 1
    assert script_args.reward_funcs == ["digit_match"]  # one name for a list field is a list of one
    assert config.reward_weights == [1, 0.5]


def test_unknown_reward_name_is_named_with_the_accepted_forms(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.parse("grpo", [*ONLINE, "--reward_funcs", "exact_match", "digit_mach"])
    err = capsys.readouterr().err
    assert ("'digit_mach' is neither a built-in reward name, a module:function, nor a local model path; "
            "did you mean 'digit_match'? built-in names: exact_match, digit_match, final_answer") in err
    (tmp_path / "rm").mkdir()
    script_args, _ = cli.parse("grpo", [*ONLINE, "--reward_funcs", "digit_match", "my_rewards:score",
                                        "posttrain/tiny-qwen2-seqcls", str(tmp_path / "rm")])
    assert len(script_args.reward_funcs) == 4


def test_reward_funcs_help_says_module_code_runs(capsys):
    with pytest.raises(SystemExit):
        cli.parse("grpo", ["--help"])
    assert "executes that module's code" in " ".join(capsys.readouterr().out.split())


def test_resume_and_earlier_checkpoints_are_checked_before_the_model_loads(tmp_path, capsys):
    def error(*argv):
        with pytest.raises(SystemExit) as exit_info:
            cli.parse("sft", [*TINY, "--dataset_name", "zen", "--output_dir", str(tmp_path), *argv])
        assert exit_info.value.code == 2
        return capsys.readouterr().err

    assert f"latest checkpoint in --output_dir '{tmp_path}', which holds no complete checkpoint-N folder" in \
        error("--resume_from_checkpoint", "true")
    assert "checkpoint-9' is not a checkpoint folder: it does not exist" in \
        error("--resume_from_checkpoint", str(tmp_path / "checkpoint-9"))
    (tmp_path / "checkpoint-4").mkdir()  # cut short: no trainer_state.json
    assert "which holds no complete checkpoint-N folder" in error("--resume_from_checkpoint", "true")
    assert "checkpoint-4' is not a checkpoint folder: it holds no trainer_state.json" in \
        error("--resume_from_checkpoint", str(tmp_path / "checkpoint-4"))
    assert (f"--output_dir '{tmp_path}' holds checkpoints of an earlier run (checkpoint-4): add "
            "--resume_from_checkpoint true to continue it, --overwrite_output_dir true") in error()
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    _, config = cli.parse("sft", [*TINY, "--dataset_name", "zen", "--output_dir", str(tmp_path),
                                  "--resume_from_checkpoint", "true"])
    assert cli._resume_arg(config.resume_from_checkpoint) is True
    _, config = cli.parse("sft", [*TINY, "--dataset_name", "zen", "--output_dir", str(tmp_path),
                                  "--overwrite_output_dir", "true"])
    assert config.overwrite_output_dir and cli._resume_arg(config.resume_from_checkpoint) is None
    assert cli._resume_arg("True") is True and cli._resume_arg("false") is None


def test_usage_error_is_one_line_of_usage_and_the_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse("sft", [*TINY, "--dataset_name", "zen", "--max_steps", "x"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert lines == ["usage: posttrain sft [options] (see posttrain sft --help)",
                     "posttrain sft: error: argument --max_steps/--max-steps: invalid int value: 'x'"]


@pytest.mark.parametrize("name, content, message", [
    ("empty.jsonl", b"", "is empty"),
    ("blank.jsonl", b"\n  \n", "holds only blank lines"),
    ("broken.jsonl", b'{"prompt": "a", "completion": "b"}\n{"prompt": "c", "completion": \n',
     "line 2, column 1: not valid JSON: Expecting value (each line must be one JSON object)"),
    ("latin1.jsonl", b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "d"}\n',
     "line 2: byte 16 of the line (b'\\xe9') is not UTF-8; save the file as UTF-8"),
    ("latin1.csv", b"prompt,completion\na,b\ncaf\xe9,d\n", "line 3: byte 4 of the line"),
    ("empty.csv", b"", "is empty"),
    ("list.jsonl", b'{"prompt": "a"}\n["b"]\n', 'line 2: expected a JSON object {"column": value, ...}, got list'),
    ("mixed.jsonl", b'{"prompt": "a", "score": 1}\n{"prompt": "b", "score": "high"}\n',
     "line 2: column 'score' is a str here but a number on line 1; a column holds one type"),
    ("doc.json", b'[\n {"prompt": "a"},\n {"prompt": "b",}\n]\n', "line 3, column 17: not valid JSON"),
    ("bad.parquet", b"not parquet", "cannot be read as parquet"),
])
def test_dataset_file_faults_name_the_file_and_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(cli.DatasetError) as err:
        cli.load_dataset_arg(str(path))
    assert str(path) in str(err.value) and message in str(err.value)


def test_json_files_in_either_layout_load(tmp_path):
    rows = [{"prompt": "a", "score": 1}, {"prompt": "b", "score": 2.5}, {"prompt": "c", "score": None}]
    document, lines = tmp_path / "doc.json", tmp_path / "lines.json"
    document.write_text(json.dumps(rows, indent=1))
    lines.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert cli.load_dataset_arg(str(document))["score"] == [1, 2.5, None]
    assert cli.load_dataset_arg(str(lines))["prompt"] == ["a", "b", "c"]


def test_a_faulty_file_in_a_dataset_folder_is_named(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(cli.DatasetError, match=r"train.jsonl', line 2, column 1: not valid JSON"):
        cli.load_dataset_arg(str(tmp_path))


@pytest.mark.parametrize("name", ["sft", "reward", "dpo", "bco", "kto", "grpo", "rloo", "ppo", "distillation", "gkd",
                                  "minillm"])
def test_every_default_written_as_yaml_passes_the_type_check(name):
    """The YAML type check accepts each field's own default, so it cannot refuse a valid config."""
    import enum

    import yaml

    fn = cli.COMMANDS[name]
    for cls in (fn.script_args_class, cli._config_class(fn)):
        flags = cli._flags(cls)
        for f in dataclasses.fields(cls):
            if f.name not in flags:
                continue
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            default = default.value if isinstance(default, enum.Enum) else default
            cli._yaml_value(flags[f.name], yaml.safe_load(yaml.safe_dump(default)))


def test_unreadable_or_non_mapping_yaml_is_a_usage_error(tmp_path, capsys):
    listed = tmp_path / "list.yaml"
    listed.write_text("- max_steps: 2\n")
    for argv, message in [([str(tmp_path / "none.yaml")], "cannot read --config file"),
                          ([str(listed)], "must hold `field: value` pairs, got list")]:
        with pytest.raises(SystemExit) as exit_info:
            cli.parse("sft", ["--config", *argv, *TINY, "--dataset_name", "zen"])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "missing.jsonl"],
     "posttrain: error: dataset 'missing.jsonl' is not a built-in dataset"),
    (["--model_name_or_path", "no-such-model", "--dataset_name", "reverse"],
     "posttrain: error: could not load 'no-such-model': it is not a local folder"),
])
def test_main_reports_what_cannot_be_loaded_in_one_line_and_returns_1(tmp_path, capsys, argv, message):
    assert cli.main(["sft", *argv, "--output_dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
