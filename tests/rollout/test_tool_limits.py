"""Hostile tool traffic: a call nested ~1,000 levels deep, an over-long call and a 10 MB result become error
texts or cut results for the model to read; training never sees an exception, and the cuts are counted."""

import pytest

from posttrain.rollout.multiturn import Episodes
from posttrain.rollout.tools import parse_tool_calls, run_tool_call, run_tool_calls, tool_schemas, was_truncated


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def flood(n: int) -> str:
    """Return a lot of text.

    Args:
        n: How many characters.
    """
    return "x" * n


def test_a_call_nested_a_thousand_levels_deep_is_an_error_text():
    deep = '{"name": "add", "arguments": {"a": ' + "[" * 1000 + "]" * 1000 + ', "b": 1}}'
    calls, errors = parse_tool_calls(f"<tool_call>{deep}</tool_call>")
    assert calls == [] and len(errors) == 1 and "nested too deeply" in errors[0] and len(errors[0]) < 400
    string_arguments = '{"name": "add", "arguments": "' + "[" * 5000 + "]" * 5000 + '"}'
    calls, errors = parse_tool_calls(f"<tool_call>{string_arguments}</tool_call>")
    assert calls == [] and '"arguments" must be a JSON object' in errors[0]
    message, error = run_tool_call({"name": "add", "arguments": "[" * 5000 + "]" * 5000}, {"add": add})
    assert error == message["content"] and "nested too deeply" in error


def test_an_over_long_call_is_refused_without_parsing():
    body = '{"name": "add", "arguments": {"a": 1, "b": 2, "pad": "' + "y" * 500 + '"}}'
    calls, errors = parse_tool_calls(f"<tool_call>{body}</tool_call>", max_call_chars=100)
    assert calls == [] and f"is {len(body)} characters long, over the limit of 100 (max_tool_call_chars)" in errors[0]
    assert parse_tool_calls(f"<tool_call>{body}</tool_call>")[0]  # no limit: parsed


def test_a_huge_result_is_cut_with_a_note_and_counted():
    (message, error), = run_tool_calls([{"name": "flood", "arguments": {"n": 10_000_000}}], {"flood": flood},
                                       max_result_chars=1000)
    assert error is None and len(message["content"]) < 1100 and was_truncated(message)
    assert message["content"].endswith("\n[truncated: 9999000 more characters]")
    (small, _), = run_tool_calls([{"name": "flood", "arguments": {"n": 10}}], {"flood": flood}, max_result_chars=1000)
    assert small["content"] == "x" * 10 and not was_truncated(small)


def test_an_unprintable_result_is_an_error_text():
    class Bad:
        def __str__(self):
            raise RuntimeError("no")

    message, error = run_tool_call({"name": "bad", "arguments": {}}, {"bad": lambda: Bad()})
    assert error is None and message["content"].startswith("Error: the result (Bad) cannot be shown as text")


@pytest.fixture(scope="module")
def tok():
    from posttrain.models.loading import load_tokenizer

    return load_tokenizer("posttrain/tiny-qwen2")


def test_episodes_cap_calls_and_results_and_report_the_truncation_rate(tok):
    prompt = [{"role": "user", "content": "go"}]
    tools = {"flood": flood, "add": add}
    episodes = Episodes(tok, [prompt] * 3, [tools] * 3, [tool_schemas([flood, add])] * 3, max_iterations=1,
                        timeout=5, max_call_chars=200, max_result_chars=50)
    texts = ['<tool_call>{"name": "flood", "arguments": {"n": 5000}}</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"a": ' + "[" * 1000 + "]" * 1000 + ', "b": 1}}</tool_call>',
             '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>']
    turns = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    fed = episodes([0, 1, 2], turns)
    assert all(ids is not None for ids in fed)
    assert was_truncated(episodes.turns[0][1]) and len(episodes.turns[0][1]["content"]) < 100
    assert "over the limit of 200" in episodes.turns[1][1]["content"]  # 2,000 brackets: refused unparsed
    assert "tool_calls" not in episodes.turns[1][0]
    assert episodes.turns[2][1]["content"] == "5"
    metrics = episodes.metrics()
    assert metrics["tools/truncation_rate"] == pytest.approx(1 / 3) and metrics["tools/failure_rate"] == pytest.approx(1 / 3)


def test_a_busy_looping_tool_is_said_to_be_still_running(caplog):
    import threading

    from posttrain.rollout.tools import still_running
    from posttrain.trainers.base import warn_still_running

    stop = threading.Event()

    def spin() -> str:
        """Loop until stopped."""
        while not stop.is_set():
            pass
        return "done"

    try:
        message, error = run_tool_call({"name": "spin", "arguments": {}}, {"spin": spin}, timeout=0.2)
        assert error == "Error: spin did not return within 0.2 s"
        assert "tool-spin" in still_running()
        with caplog.at_level("WARNING", logger="posttrain"):
            warn_still_running()
        assert "still running (tool-spin)" in caplog.text and "Python cannot stop a thread" in caplog.text
    finally:
        stop.set()
