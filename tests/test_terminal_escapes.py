"""Terminal escape sequences in prompts or completions reach the console table escaped, never raw."""

from posttrain.callbacks import CompletionsTable, escape_controls


def test_the_completions_table_prints_escapes_as_text(capsys, tmp_path):
    hostile = "ok\x1b[2J\x1b]0;pwned\x07\x9b31m\rdone"
    rows = CompletionsTable(str(tmp_path)).write(3, [hostile], [hostile + " reply"], {"r": [1.0]})
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out and "\r" not in out
    assert "\\x1b[2J" in out and "pwned" in out
    assert rows[0]["completion"] == hostile + " reply"  # completions.jsonl keeps the text as sampled
    assert "\\u001b" in (tmp_path / "completions.jsonl").read_text()  # JSON escapes it there


def test_escape_controls_keeps_newlines_tabs_and_unicode():
    assert escape_controls("a\nb\tc é 漢") == "a\nb\tc é 漢"
    assert escape_controls("\x1b[1m\x00\x7f") == "\\x1b[1m\\x00\\x7f"
