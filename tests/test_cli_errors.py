"""Every data or config fault reaches the command-line user as one line naming the file, its line
(1-based, as an editor counts) and the column; a traceback only with --debug (issue #34)."""

import json

import pytest

from posttrain import cli

TINY = ["--model_name_or_path", "posttrain/tiny-qwen2", "--max_steps", "1", "--report_to", "none"]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("posttrain: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def run_sft(tmp_path, data):
    return cli.main(["sft", *TINY, "--dataset_name", str(data), "--output_dir", str(tmp_path / "out")])


@pytest.mark.parametrize("name, text, expected", [
    ("qa.jsonl", '{"question": "a", "answer": "b"}\n', "qa.jsonl: no dataset format matches the columns "
                                                      "['question', 'answer']"),
    ("missing.jsonl", '{"prompt": "a", "completion": " b"}\n\n{"completion": " d"}\n',
     "missing.jsonl, line 3, column 'prompt': expected a string"),
    ("rows.json", '[{"prompt": "a", "completion": " b"},\n {"prompt": 3,\n  "completion": " d"}]\n',
     "rows.json, line 2, column 'prompt': expected a string"),
    ("rows.csv", 'prompt,completion\na," b"\n"multi\nline"," c"\n,\n',
     "rows.csv, line 5, column 'prompt'"),
])
def test_a_data_fault_is_one_line_with_the_files_line(tmp_path, capsys, name, text, expected):
    data = tmp_path / name
    data.write_text(text)
    assert run_sft(tmp_path, data) == 1
    line = one_error_line(capsys)
    assert expected in line, line


def test_debug_shows_the_traceback(tmp_path):
    from posttrain.data.formats import FormatError

    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"question": "a", "answer": "b"}) + "\n")
    with pytest.raises(FormatError, match="no dataset format matches"):
        cli.main(["sft", "--debug", *TINY, "--dataset_name", str(data), "--output_dir", str(tmp_path / "out")])


def test_row_lines_and_locate(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('\n{"x": 1}\n\n{"x": 2}\n')
    assert cli._row_lines(str(jsonl)) == [2, 4]
    columns = tmp_path / "c.json"
    columns.write_text('{"x": [1, 2]}')
    assert cli._row_lines(str(columns)) is None
    lines_in_json = tmp_path / "l.json"
    lines_in_json.write_text('{"x": 1}\n\n{"x": 2}\n')
    assert cli._row_lines(str(lines_in_json)) == [1, 3]
    cli._SOURCE.update(path="c.json", lines=None)
    try:  # rows that are not lines are counted from 1
        assert cli.locate("row 0, column 'x': bad") == "c.json, row 1, column 'x': bad"
        assert cli.locate("streamed rows 0-3: bad") == "c.json: streamed rows 1-4: bad"
    finally:
        cli._SOURCE.clear()
    assert cli.locate("row 4: bad") == "row 5: bad"


@pytest.mark.parametrize("text, expected", [
    ("max_steps: 2\nlearning_rate: [1\n", "bad.yaml, line 3, column 1: not valid YAML"),
    ("max_steps: 2\nlearning_rat: 1\n", "bad.yaml: unknown field 'learning_rat' for `posttrain sft` "
                                        "(line 2, column 1)"),
    ("seed: 1\nmax_steps: x\n", "bad.yaml: max_steps: expected int, got str 'x' (line 2, column 1)"),
])
def test_a_config_file_fault_is_a_usage_error_naming_its_line(tmp_path, capsys, text, expected):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["sft", "--config", str(config), *TINY, "--dataset_name", "reverse"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and expected in err and len(err.strip().splitlines()) == 2, err


def test_short_help_and_help_all(capsys):
    with pytest.raises(SystemExit):
        cli.parse("sft", ["--help"])
    short = capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.parse("sft", ["--help-all"])
    full = capsys.readouterr().out
    assert "--learning_rate" in short and "--help-all" in short and "--lora_r" not in short
    assert "--lora_r" in full and "--adam_beta1" in full
    assert len(short.splitlines()) < 120 < len(full.splitlines())


def test_without_output_dir_the_command_says_where_it_writes(capsys):
    _, config = cli.parse("sft", ["--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "reverse"])
    assert config.output_dir == "sft_output"
    assert "no --output_dir given: writing to sft_output/" in capsys.readouterr().err
