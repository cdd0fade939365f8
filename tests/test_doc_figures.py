"""Every learning figure README.md and docs/quickstart.md state is the one docs/figures.json records, with
the machine class it was measured on beside it; scripts/check_doc_figures.py re-runs the commands and
compares them with the record (minutes of CPU: run it by hand or in a slow job, not here)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
QUICKSTART = (ROOT / "docs" / "quickstart.md").read_text()
RECORD = json.loads((ROOT / "docs" / "figures.json").read_text())


def _script():
    spec = importlib.util.spec_from_file_location("check_doc_figures", ROOT / "scripts" / "check_doc_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def figures(run: str) -> dict:
    return RECORD["runs"][run]["figures"]


def two(x: float) -> str:
    return f"{x:.2f}"


def test_the_demo_table_is_the_recorded_run():
    body = _script().section(README, "What `posttrain demo` shows")
    rows = re.findall(r"^\| (\w[\w ]*?) \| [^|]+ \| ([0-9.]+) -> ([0-9.]+) \|$", body, flags=re.M)
    recorded = {stage: ba for stage, ba in figures("demo").items() if ba[0] is not None}
    assert {stage for stage, *_ in rows} == set(recorded), "the README's demo table lists other stages"
    for stage, before, after in rows:
        assert (before, after) == tuple(map(two, recorded[stage])), f"demo table, {stage}"


@pytest.mark.parametrize("text", [README, QUICKSTART], ids=["README", "quickstart"])
def test_the_command_line_example_states_the_recorded_figures(text):
    found = re.findall(r"(\d\.\d+) -> (\d\.\d+) after SFT,\s+(\d\.\d+) -> (\d\.\d+)\s+after GRPO", text)
    cli = figures("cli")  # accuracy over 200 prompts: steps of 0.005, three decimals
    assert found == [("0.000", f"{cli['sft']:.3f}", f"{cli['sft']:.3f}", f"{cli['grpo']:.3f}")]


def test_the_quickstart_snippet_states_what_it_prints_and_learns():
    quick = figures("quickstart")
    flat = " ".join(README.split())
    assert f"`held-out accuracy after SFT: {quick['sft']:.3f}`" in flat
    assert f"`held-out accuracy after GRPO: {quick['grpo']:.3f}`" in flat
    assert quick["grpo"] > quick["sft"] + 0.1  # GRPO visibly learns
    snippet = _script().quickstart_snippet(README)
    assert 'save_model("out/sft")' in snippet and 'save_model("out/grpo")' in snippet


def test_the_smollm2_figures_are_the_recorded_run():
    smol = figures("smollm2")
    before, after = map(two, smol["grpo"])
    assert f"held-out accuracy **{before} -> {after}**" in README
    first, last = map(two, smol["grpo training reward"])
    assert f"sampled training reward {first} -> {last}" in " ".join(README.split())


def test_each_figure_states_the_machine_it_holds_for():
    machine = RECORD["machine"]
    assert " ".join(README.split()).count(machine) >= 4 and machine in " ".join(QUICKSTART.split())
    assert "about" in _script().section(README, "What `posttrain demo` shows").split("| stage |")[0]


def test_the_script_runs_the_commands_the_readme_shows():
    script = _script()
    commands = script.cli_example(README)
    assert [c.split()[1] for c in commands] == ["sft", "grpo"]
    assert all(c.replace("\\", "") in " ".join(README.replace("\\\n", " ").split()) for c in commands)
    compile(script.quickstart_snippet(README), "README Quickstart", "exec")
    assert set(RECORD["runs"]) == set(script.RUNS)


def test_differences_respect_the_tolerance():
    diff = _script().differences
    assert diff({"a": [None, 0.5]}, {"a": [None, 0.504]}) == []
    assert diff({"a": 0.5}, {"a": 0.51}) == ["a: recorded 0.5, measured 0.51"]
    assert diff({"a": 0.5}, {}) == ["a: recorded 0.5, measured None"]
