"""CompletionsTable: user text printed literally (no rich markup), and one file never mixing two runs."""

import json

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
