"""examples/scripts/evals/judge_tldr.py: a model's greedy completions against references, judged."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "scripts" / "evals" / "judge_tldr.py"


def _script():
    spec = importlib.util.spec_from_file_location("judge_tldr", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_judge_script_with_a_reward_model_judge(tmp_path, capsys):
    from posttrain.cli import load_dataset_arg
    from posttrain.eval import generate_completions
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    out = tmp_path / "rows.jsonl"
    result = _script().main(["--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "reverse",
                             "--judge_model", "posttrain/tiny-qwen2-seqcls", "--num_examples", "6",
                             "--max_new_tokens", "6", "--output_file", str(out)])
    assert result["num_judged"] + result["num_ties"] + result["num_failed"] == 6
    assert result["num_failed"] == 0 and 0.0 <= result["win_rate"] <= 1.0
    assert "model win rate:" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    data = load_dataset_arg("reverse", "test").select(range(6))
    assert [r["reference"] for r in rows] == data["completion"]
    model, tok = load_causal_lm("posttrain/tiny-qwen2"), load_tokenizer(None, model="posttrain/tiny-qwen2")
    assert [r["completion"] for r in rows] == generate_completions(model, tok, data["prompt"], 6)


def test_judge_script_names_a_missing_reference_column(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="no column"):
        _script().main(["--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "reverse",
                        "--judge_model", "posttrain/tiny-qwen2-seqcls", "--reference_column", "summary"])
