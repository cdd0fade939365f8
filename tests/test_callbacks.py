"""CompletionsTable: user text printed literally (no rich markup), one file never mixing two runs, and a
table for wandb / trackio when they are in report_to."""

import json
import sys
import types

import pytest

from posttrain.callbacks import CompletionsTable


def test_markup_in_prompts_and_completions_is_printed_literally(tmp_path, capsys):
    table = CompletionsTable(str(tmp_path))
    table.write(0, ["[INST] hi [/INST]"], ["[bold]x[/bold]"], {"[red]score": [1.0]})
    out = capsys.readouterr().out
    assert "[/INST]" in out and "[bold]x[/bold]" in out and "[red]score" in out


def rows(path) -> list[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        return [(row["step"], row["completion"]) for row in map(json.loads, f)]


def test_a_fresh_run_moves_the_earlier_file_aside(tmp_path, capsys):
    first = CompletionsTable(str(tmp_path))
    first.start()
    first.write(1, ["p"], ["first run"], {})
    for _ in range(2):
        run = CompletionsTable(str(tmp_path))
        run.start()
        run.write(1, ["p"], ["a later run"], {})
    assert rows(tmp_path / "completions.jsonl") == [(1, "a later run")]
    assert rows(tmp_path / "completions.1.jsonl") == [(1, "first run")]
    assert rows(tmp_path / "completions.2.jsonl") == [(1, "a later run")]


def test_a_resumed_run_writes_only_what_follows_its_checkpoint(tmp_path, capsys):
    killed = CompletionsTable(str(tmp_path))
    killed.start()
    for step in (1, 2, 3):  # killed after writing step 3; resumed from checkpoint-2
        killed.write(step, ["p"], [f"killed run {step}"], {})
    resumed = CompletionsTable(str(tmp_path))
    resumed.start(resumed_step=2)
    for step in (2, 3, 4):  # a sample of step 2 is taken during step 3, after checkpoint-2
        resumed.write(step, ["p"], [f"resumed run {step}"], {})
    assert rows(tmp_path / "completions.jsonl") == [(1, "killed run 1"), (2, "killed run 2"),
                                                    (3, "resumed run 3"), (4, "resumed run 4")]


def test_callbacks_live_here_and_keep_their_old_import_paths():
    import posttrain
    from posttrain import callbacks, judges, plotting
    from posttrain.trainers import base

    assert (plotting.PlotCallback, judges.WinRateCallback, base.SyncRefModelCallback) == \
        (callbacks.PlotCallback, callbacks.WinRateCallback, callbacks.SyncRefModelCallback)
    assert (posttrain.PlotCallback, posttrain.WinRateCallback) == (callbacks.PlotCallback, callbacks.WinRateCallback)


class _FakeTracker(types.ModuleType):
    """Stands in for wandb / trackio (not installed here): records what `log` received."""

    def __init__(self, name, run=True):
        super().__init__(name)
        self.logged, self.run = [], (object() if run else None)

        class Table:
            def __init__(self, columns=None, data=None):
                self.columns, self.data = columns, data

        self.Table = Table

    def log(self, values):
        self.logged.append(values)


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_completions_go_to_the_tracker_in_report_to_as_a_table(tmp_path, capsys, monkeypatch, name):
    tracker = _FakeTracker(name)
    monkeypatch.setitem(sys.modules, name, tracker)
    table = CompletionsTable(str(tmp_path), num_to_print=1, report_to=["tensorboard", name])
    table.write(3, ["2+2=", [{"role": "user", "content": "hi"}]], ["4", "hello"],
                {"accuracy": [1.0, float("nan")], "length": [0.5, 0.25]})
    assert len(tracker.logged) == 1 and list(tracker.logged[0]) == ["completions"]
    logged = tracker.logged[0]["completions"]
    assert logged.columns == ["step", "prompt", "completion", "accuracy", "length"]
    # every row (not only the num_to_print shown on the console); NaN (abstained) becomes None
    assert logged.data == [[3, "2+2=", "4", 1.0, 0.5], [3, "user: hi", "hello", None, 0.25]]


def test_no_table_without_a_tracker_in_report_to_or_a_wandb_run(tmp_path, capsys, monkeypatch):
    wandb, trackio = _FakeTracker("wandb", run=False), _FakeTracker("trackio")
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    CompletionsTable(str(tmp_path), report_to=["wandb"]).write(1, ["p"], ["c"], {"r": [1.0]})  # wandb.init not run
    CompletionsTable(str(tmp_path), report_to="none").write(2, ["p"], ["c"], {"r": [1.0]})
    CompletionsTable(str(tmp_path)).write(3, ["p"], ["c"], {"r": [1.0]})
    assert wandb.logged == [] and trackio.logged == []
