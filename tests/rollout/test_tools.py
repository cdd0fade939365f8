"""Tool calls by hand: schemas from functions, parsing valid and malformed blocks, and running
calls whose failures (unknown tool, bad JSON arguments, exceptions, timeouts) become error texts."""

import asyncio
import threading

import pytest

from posttrain.data.tools import tool_schemas
from posttrain.rollout.tools import assistant_turn, parse_tool_calls, run_tool_call, run_tool_calls, tools_by_name


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


async def shout(text: str) -> str:
    """Say it louder.

    Args:
        text: What to say.
    """
    await asyncio.sleep(0)
    return text.upper()


def broken(x: int) -> str:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError("disk on fire")


RELEASE = threading.Event()


def hang() -> str:
    """Waits until the test releases it."""
    RELEASE.wait(30)
    return "late"


async def slow() -> str:
    """Sleeps longer than any timeout here."""
    await asyncio.sleep(30)
    return "late"


TOOLS = tools_by_name([multiply, shout, broken, hang, slow])


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_schemas_from_sync_and_async_functions():
    schemas = tool_schemas([multiply, shout, {"type": "function", "function": {"name": "given"}}])
    assert schemas[0] == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first factor."},
                                                        "b": {"type": "integer", "description": "The second factor."}},
                       "required": ["a", "b"]},
        "return": {"type": "integer"}}}
    assert schemas[1]["function"]["name"] == "shout"
    assert schemas[1]["function"]["parameters"]["properties"] == {"text": {"type": "string",
                                                                           "description": "What to say."}}
    assert schemas[2] == {"type": "function", "function": {"name": "given"}}


def test_parse_valid_calls():
    text = ('Let me compute.\n<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>\n'
            '<tool_call> {"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"} </tool_call>'
            '<tool_call>{"name": "hang"}</tool_call>')
    calls, errors = parse_tool_calls(text)
    assert errors == []
    assert calls == [call("multiply", {"a": 12, "b": 34}), call("shout", {"text": "hi"}), call("hang", {})]
    assert parse_tool_calls("The answer is 408.") == ([], [])


def test_parse_malformed_calls():
    text = ('<tool_call>{"name": "multiply", "arguments": {"a": 1,}}</tool_call>'  # bad JSON
            '<tool_call>["multiply"]</tool_call>'  # not an object
            '<tool_call>{"arguments": {"a": 1}}</tool_call>'  # no name
            '<tool_call>{"name": "multiply", "arguments": [1, 2]}</tool_call>'  # arguments not an object
            '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'  # fine
            '<tool_call>{"name": "multiply"')  # never closed
    calls, errors = parse_tool_calls(text)
    assert calls == [call("multiply", {"a": 2, "b": 3})]
    assert len(errors) == 5
    assert errors[0].startswith("tool call 0 is not valid JSON")
    assert errors[1].startswith("tool call 1 must be a JSON object")
    assert errors[2].startswith('tool call 2 has no "name"')
    assert errors[3].startswith('tool call 3 (multiply): "arguments" must be a JSON object')
    assert errors[4] == "a <tool_call> block is never closed with </tool_call>"


def test_assistant_turn_splits_text_and_calls():
    turn = assistant_turn('Computing.<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert turn == {"role": "assistant", "content": "Computing.", "tool_calls": [call("multiply", {"a": 2, "b": 3})]}
    assert assistant_turn("6") == {"role": "assistant", "content": "6"}


def test_run_sync_and_async_tools():
    assert run_tool_call(call("multiply", {"a": 12, "b": 34}), TOOLS) == (
        {"role": "tool", "name": "multiply", "content": "408"}, None)
    assert run_tool_call(call("shout", '{"text": "hi"}'), TOOLS) == ({"role": "tool", "name": "shout", "content": "HI"},
                                                                    None)
    assert run_tool_call({"name": "multiply", "arguments": {"a": 2, "b": 5}}, TOOLS)[0]["content"] == "10"


def test_failures_become_error_texts():
    cases = {
        "unknown": (call("divide", {"a": 1}), "Error: unknown tool 'divide'; the tools are: broken, hang, multiply, "
                                              "shout, slow"),
        "bad json": (call("multiply", '{"a": 1'), "Error: the arguments of multiply are not valid JSON"),
        "not an object": (call("multiply", "[1, 2]"), "Error: the arguments of multiply must be a JSON object"),
        "exception": (call("broken", {"x": 1}), "Error: broken failed: RuntimeError: disk on fire"),
        "wrong arguments": (call("multiply", {"a": 1, "c": 2}), "Error: multiply failed: TypeError:"),
        "no name": ({"type": "function", "function": {"arguments": {}}}, "Error: the tool call has no name"),
    }
    for what, (bad, expected) in cases.items():
        message, error = run_tool_call(bad, TOOLS)
        assert error is not None and error.startswith(expected), (what, error)
        assert message["role"] == "tool" and message["content"] == error, what


def test_timeouts_of_sync_and_async_tools():
    RELEASE.clear()
    try:
        message, error = run_tool_call(call("hang", {}), TOOLS, timeout=0.2)
        assert error == "Error: hang did not return within 0.2 s" and message["content"] == error
        _, error = run_tool_call(call("slow", {}), TOOLS, timeout=0.2)
        assert error.startswith("Error: slow")
        assert "within 0.2 s" in error or "timed out" in error
    finally:
        RELEASE.set()


def test_several_calls_keep_their_order():
    results = run_tool_calls([call("shout", {"text": "a"}), call("nope", {}), call("multiply", {"a": 3, "b": 3})],
                             TOOLS)
    assert [m["content"] for m, _ in results] == ["A", "Error: unknown tool 'nope'; the tools are: broken, hang, "
                                                       "multiply, shout, slow", "9"]
    assert [e is None for _, e in results] == [True, False, True]


def test_each_call_can_have_its_own_tools():
    """One environment instance per rollout: each call runs against its own mapping."""
    class Counter:
        def __init__(self, n: int):
            self.n = n

        def bump(self) -> int:
            """Add one."""
            self.n += 1
            return self.n

    a, b = Counter(10), Counter(20)
    results = run_tool_calls([call("bump", {}), call("bump", {})], [tools_by_name([a.bump]), tools_by_name([b.bump])])
    assert [m["content"] for m, _ in results] == ["11", "21"] and (a.n, b.n) == (11, 21)
    with pytest.raises(ValueError, match="one per call"):
        run_tool_calls([call("bump", {})], [])


def test_calls_of_sync_and_async_tools_run_at_the_same_time():
    """Each of the three calls waits for the other two at a barrier: run one after the other, the barrier breaks
    (an error text) instead of every call returning."""
    barrier = threading.Barrier(3, timeout=10)

    def wait_sync(x: int) -> int:
        """Wait for the others.

        Args:
            x: A number.
        """
        barrier.wait()
        return x

    async def wait_async(x: int) -> int:
        """Wait for the others, in the call's own event loop.

        Args:
            x: A number.
        """
        barrier.wait()
        return -x

    tools = tools_by_name([wait_sync, wait_async])
    results = run_tool_calls([call("wait_sync", {"x": 1}), call("wait_async", {"x": 2}), call("wait_sync", {"x": 3})],
                             tools, timeout=20)
    assert [(m["content"], e) for m, e in results] == [("1", None), ("-2", None), ("3", None)]
