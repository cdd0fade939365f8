"""Tool calls in sampled text: schemas from Python functions, parsing, and running the calls.

Pure functions for multi-turn rollouts, no trainer state. A tool is a Python function (sync or
async) with type hints and a Google-style docstring, as transformers' `get_json_schema` reads
it; the model calls it by writing, inside its turn, Hermes/Qwen-style blocks

    <tool_call>{"name": "calculate", "arguments": {"expression": "12 * 34"}}</tool_call>

which is what the built-in chat template renders for an assistant message's `tool_calls`. A call
never raises: a malformed block (JSON nested past Python's recursion limit included, as a collapsing
policy's degenerate repetition writes), a block longer than `max_call_chars`, an unknown tool,
arguments the function refuses, an exception inside it or a timeout become an error text that goes
back to the model as the `tool` message. A result longer than `max_result_chars` is cut, with a
note saying how much was cut (`was_truncated` tells), so one tool returning megabytes cannot make a
step slow and large.

A result that is or holds an image (a PIL image, `{"type": "image", "image": ...}`, a list of such parts with
text parts) becomes, for a vision-language model's rollout (`images=True`), a `tool` message whose content is
those parts, each image part holding its RGB image (`image_content`; the rollout renders its placeholder and
feeds its features, `rollout/multiturn.py`); an image that cannot be opened is an error text for the model. For
a text-only model it raises `ToolImageError` naming the tool: its pixels could never reach the model.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.data.chat import TOOL_CALL_END, TOOL_CALL_START
from posttrain.data.tools import tool_schemas  # noqa: F401  (its home is data.tools; public here as before)

__all__ = ["ToolImageError", "assistant_turn", "image_content", "parse_tool_calls", "run_tool_call", "run_tool_calls", "still_running", "tool_schemas",
           "tools_by_name", "was_truncated"]

_TRUNCATED = re.compile(r"\n\[truncated: \d+ more characters\]\Z")  # the note `cap` ends a cut text with
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def tools_by_name(tools: Sequence[Callable]) -> dict[str, Callable]:
    """{function name: function}; two tools with one name are an error (a call could not choose)."""
    out: dict[str, Callable] = {}
    for tool in tools:
        name = getattr(tool, "__name__", None)
        if not callable(tool) or not name:
            raise TypeError(f"a tool must be a named Python function, got {tool!r}")
        if name in out:
            raise ValueError(f"two tools are named {name!r}; tool names must be unique")
        out[name] = tool
    return out


def _decode(text: str):
    """json.loads, with nesting past Python's recursion limit reported as ValueError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to decode") from None


def cap(text: str, limit: int | None) -> str:
    """`text`, or its first `limit` characters and a note of how many more there were."""
    if limit is None or len(text) <= limit:
        return text
    return f"{text[:limit]}\n[truncated: {len(text) - limit} more characters]"


def was_truncated(message: Mapping) -> bool:
    """Whether a `tool` message's content (a text, or content parts) was cut by `cap` (max_result_chars)."""
    content = message.get("content") or ""
    texts = [content] if isinstance(content, str) else [p.get("text") or "" for p in content if isinstance(p, Mapping)]
    return any(_TRUNCATED.search(text) for text in texts)


def parse_tool_calls(text: str, max_call_chars: int | None = None) -> tuple[list[dict], list[str]]:
    """(calls, errors) of the `<tool_call>{json}</tool_call>` blocks in `text`, in order.

    calls: `{"type": "function", "function": {"name": str, "arguments": dict}}`, the form of an
    assistant message's `tool_calls`; a JSON-string "arguments" is decoded, a missing one is {}.
    errors: one text per malformed block (not JSON, nested too deeply, not an object, no name,
    arguments not an object, longer than `max_call_chars`, a block never closed), written for the
    model to read; a quoted block is cut to 200 characters.
    """
    calls, errors = [], []
    for k, match in enumerate(_BLOCK.finditer(text)):
        body = match.group(1).strip()
        if max_call_chars is not None and len(body) > max_call_chars:
            errors.append(f"tool call {k} is {len(body)} characters long, over the limit of {max_call_chars} "
                          f"(max_tool_call_chars); it was not run: {body[:200]!r}...")
            continue
        try:
            value = _decode(body)
        except ValueError as err:
            errors.append(f"tool call {k} is not valid JSON ({err}): {cap(body, 200)!r}")
            continue
        if not isinstance(value, dict):
            errors.append(f"tool call {k} must be a JSON object {{\"name\": ..., \"arguments\": {{...}}}}, "
                          f"got {cap(body, 200)!r}")
            continue
        name, arguments = value.get("name"), value.get("arguments", {})
        if not isinstance(name, str) or not name:
            errors.append(f"tool call {k} has no \"name\" (a non-empty string): {cap(body, 200)!r}")
            continue
        if isinstance(arguments, str):
            try:
                arguments = _decode(arguments)
            except ValueError:
                pass  # reported below as not an object
        if not isinstance(arguments, dict):
            errors.append(f"tool call {k} ({name}): \"arguments\" must be a JSON object, got {cap(body, 200)!r}")
            continue
        calls.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    tail = text[text.rfind(TOOL_CALL_END) + len(TOOL_CALL_END):] if TOOL_CALL_END in text else text
    if TOOL_CALL_START in tail:
        errors.append(f"a {TOOL_CALL_START} block is never closed with {TOOL_CALL_END}")
    return calls, errors


def assistant_turn(text: str, max_call_chars: int | None = None) -> dict:
    """The assistant message of a sampled turn: its text outside the tool-call blocks as `content`,
    and its well-formed calls (of at most `max_call_chars`) as `tool_calls` (absent when there are none)."""
    calls, _ = parse_tool_calls(text, max_call_chars)
    message: dict[str, Any] = {"role": "assistant", "content": _BLOCK.sub("", text).strip()}
    if calls:
        message["tool_calls"] = calls
    return message


class ToolImageError(ValueError):
    """A tool returned an image that this rollout cannot show to the model (a text-only model, or an engine
    that feeds tool turns as token ids only)."""


def _holds_image(value: Any, depth: int = 0) -> bool:
    """Whether a tool's result is or holds an image: a PIL image, or a content part / dict `{"type": "image"}`
    (or with an "image" key) at the top or inside a list of parts."""
    if type(value).__module__.startswith("PIL."):
        return True
    if isinstance(value, Mapping):
        return value.get("type") == "image" or "image" in value
    if isinstance(value, (list, tuple)) and depth == 0:
        return any(_holds_image(v, 1) for v in value)
    return False


def _part(name: str, value: Any, limit: int | None) -> dict:
    """One content part of an image result: an image part holding its RGB PIL image, or a text part."""
    from posttrain.data.multimodal import load_image

    if isinstance(value, str):
        return {"type": "text", "text": cap(value, limit)}
    if isinstance(value, Mapping) and value.get("type") == "text":
        return {"type": "text", "text": cap(_as_text(value.get("text", "")), limit)}
    if not _holds_image(value, 1):
        return {"type": "text", "text": cap(_as_text(value), limit)}
    image = value.get("image") if isinstance(value, Mapping) else value
    if image is None:
        raise ValueError(f"{name} returned an image part without an image ({{'type': 'image'}} needs an 'image': a "
                         "PIL image, a file path or bytes)")
    return {"type": "image", "image": load_image(image, f"the image {name} returned")}


def image_content(name: str, value: Any, max_result_chars: int | None = None) -> tuple[list[dict], str | None]:
    """(content parts, error text or None) of a tool result that holds images (`_holds_image`): a PIL image, an
    image part `{"type": "image", "image": ...}` (a PIL image, a path or bytes), or a list of such parts, text
    parts and strings; text parts are cut at `max_result_chars`. An image that cannot be opened makes the result
    an error text for the model, as any failed call."""
    from posttrain.data.multimodal import VisionDataError

    values = value if isinstance(value, (list, tuple)) else [value]
    try:
        return [_part(name, v, max_result_chars) for v in values], None
    except (VisionDataError, ValueError) as err:
        error = cap(f"Error: {err}", max_result_chars)
        return [{"type": "text", "text": error}], error


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        try:
            return str(value)
        except Exception as err:  # noqa: BLE001 -- a result that cannot be printed is reported, never raised
            return f"Error: the result ({type(value).__name__}) cannot be shown as text: {type(err).__name__}"


def _start(fn: Callable, arguments: dict, timeout: float) -> tuple[threading.Thread, dict]:
    """Run `fn(**arguments)` in a daemon thread; the returned dict gets "value" or "error"."""
    box: dict[str, Any] = {}

    def target():
        try:
            value = fn(**arguments)
            if inspect.isawaitable(value):  # async tool: its own event loop, cancelled at the timeout
                value = asyncio.run(asyncio.wait_for(_awaited(value), timeout))
            box["value"] = value
        except BaseException as err:  # noqa: BLE001 -- every failure is reported to the model
            box["error"] = err

    # A daemon thread: a sync tool that hangs cannot be killed, but it must not keep the process alive.
    thread = threading.Thread(target=target, daemon=True, name=f"tool-{getattr(fn, '__name__', 'call')}")
    thread.start()
    return thread, box


async def _awaited(awaitable):
    return await awaitable


def _prepare(call: Mapping, tools: Mapping[str, Callable]) -> tuple[str, Callable | None, dict | None, str | None]:
    """(name, function, arguments, error) of a call in `parse_tool_calls` form (or flat {"name", "arguments"})."""
    function = call.get("function", call) if isinstance(call, Mapping) else {}
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        return "", None, None, f"Error: the tool call has no name: {call!r}"
    if name not in tools:
        available = ", ".join(sorted(tools)) or "none"
        return name, None, None, f"Error: unknown tool {name!r}; the tools are: {available}"
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _decode(arguments)
        except ValueError as err:
            return name, None, None, f"Error: the arguments of {name} are not valid JSON ({err})"
    if not isinstance(arguments, Mapping):
        return name, None, None, f"Error: the arguments of {name} must be a JSON object, got {arguments!r}"
    return name, tools[name], dict(arguments), None


def _finish(name: str, thread: threading.Thread, box: dict, timeout: float,
            max_result_chars: int | None = None, images: bool = False) -> tuple[dict, str | None]:
    if thread.is_alive():
        error = f"Error: {name} did not return within {timeout:g} s"
    elif "error" in box:
        err = box["error"]
        kind = "timed out" if isinstance(err, (asyncio.TimeoutError, TimeoutError)) else "failed"
        error = cap(f"Error: {name} {kind}: {type(err).__name__}: {_as_text(err)}", max_result_chars)
    elif _holds_image(box.get("value")):
        if not images:
            raise ToolImageError(
                f"tool {name!r} returned an image ({type(box['value']).__name__}), but this model reads text only: "
                "its tool results are fed as the chat template's text tokens, so the pixels would never reach it; "
                "return text from the tool (e.g. a description of the image), or train a vision-language model "
                "with its processor, whose rollouts feed tool images (docs/vision.md)")
        content, error = image_content(name, box["value"], max_result_chars)
        return {"role": "tool", "name": name, "content": content}, error
    else:
        error = None
    content = error if error is not None else cap(_as_text(box.get("value")), max_result_chars)
    return {"role": "tool", "name": name, "content": content}, error


def run_tool_call(call: Mapping, tools: Mapping[str, Callable], timeout: float = 10.0,
                  max_result_chars: int | None = None, images: bool = False) -> tuple[dict, str | None]:
    """Run one call; return (the `tool` message, the error text or None).

    call: a `parse_tool_calls` call (or a flat {"name", "arguments"}); arguments a dict or a JSON
    string. tools: `tools_by_name(...)`. The message is `{"role": "tool", "name", "content"}`:
    the function's result (a string as it is, anything else as JSON, else `str`), or, when the
    call fails, the same error text that is returned beside it (for failure counts). A sync
    function still running at the timeout is left to finish in its daemon thread (Python cannot stop
    a thread: a tool that loops forever keeps a CPU busy until the process ends, even after
    `train()` returns; give such tools their own time limit, or make them async, which is cancelled).
    A content longer than `max_result_chars` is cut (`cap`). A result that is or holds an image (a PIL image,
    an image part, a list of parts) raises ToolImageError naming the tool unless `images` (a vision-language
    model's rollout): the content is then a list of parts (`image_content`), each image part holding its image.
    """
    return run_tool_calls([call], tools, timeout, max_result_chars, images)[0]


def run_tool_calls(calls: Sequence[Mapping], tools: Mapping[str, Callable] | Sequence[Mapping[str, Callable]],
                   timeout: float = 10.0, max_result_chars: int | None = None,
                   images: bool = False) -> list[tuple[dict, str | None]]:
    """`run_tool_call` for several calls at once (e.g. every row of a rollout step): each runs in
    its own thread from the same start, so slow or async tools overlap; results in call order.

    tools: one `tools_by_name` mapping for every call, or one per call (each rollout's own
    environment instance).
    """
    per_call = [tools] * len(calls) if isinstance(tools, Mapping) else list(tools)
    if len(per_call) != len(calls):
        raise ValueError(f"got {len(per_call)} tool mappings for {len(calls)} calls; give one per call or one for all")
    started = []
    for call, available in zip(calls, per_call):
        name, fn, arguments, error = _prepare(call, available)
        started.append((name, error if fn is None else _start(fn, arguments, timeout)))
    deadline = time.monotonic() + timeout
    results = []
    for name, job in started:
        if isinstance(job, str):  # refused before running: the error text
            results.append(({"role": "tool", "name": name, "content": job}, job))
            continue
        thread, box = job
        thread.join(max(0.0, deadline - time.monotonic()))
        results.append(_finish(name, thread, box, timeout, max_result_chars, images))
    return results


def still_running() -> list[str]:
    """Names of the tool and reward-function threads given up on at their timeout that are still running
    (`tool-<name>`, `reward-<name>`): Python cannot stop them; they end with the process."""
    return sorted(t.name for t in threading.enumerate()
                  if t.daemon and t.is_alive() and t.name.startswith(("tool-", "reward-")))
