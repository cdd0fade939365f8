"""Detect, validate and convert dataset formats to canonical columns.

A format is recognised from column names alone; the first layout below whose columns are all
present wins, so richer layouts are tried before the ones they contain. Other columns (``id``,
``answer``, ``margin``, ...) are allowed and carried through conversions unchanged, repeated
when one row becomes several. Extra columns with a meaning of their own are checked too: a
``margin`` (the reward model's required score gap) must be a finite number in every row.

=============================  ==============================================================
``ranked``                     ``prompt``, ``responses``, ``ranks`` (lower is better, 0 best)
                               or ``scores`` (higher is better), one number per response
``instruction``                ``instruction``, ``output``, optional ``input``; strings only
``unpaired_preference``        ``prompt``, ``completion``, ``label`` (bool: desirable or not)
``preference``                 ``prompt``, ``chosen``, ``rejected``
``implicit_prompt_preference`` ``chosen``, ``rejected``; the prompt is their shared start
``prompt_completion``          ``prompt``, ``completion``
``language_modeling``          ``messages`` (conversational) or ``text``
``sharegpt``                   ``conversations``: ShareGPT turns ``{"from", "value"}``
``prompt_only``                ``prompt``
=============================  ==============================================================

Every value is either *standard* (a string) or *conversational* (a list of ``{"role",
"content"}`` messages); a dataset is one or the other throughout. Conversations may call tools
in the OpenAI / transformers form: an assistant message with ``tool_calls`` (a list of
``{"type": "function", "function": {"name", "arguments"}}``, arguments a dict or a JSON-object
string; ``content`` then optional), answered by ``tool`` messages (``content``, optional
``name`` / ``tool_call_id``). A ``tools`` column, when present, holds each row's tools for the
chat template: JSON schemas, Python functions, or a JSON string of the schema list (see
`posttrain.data.chat.template_tools`). A standard ``prompt`` may be
the empty string (unconditional generation; the online trainers, which must start generating
from some token, further need the tokenizer to give it one, e.g. a BOS: see
`posttrain.data.tokenize.check_prompts`); completions, ``chosen`` and ``rejected`` may not be
empty.

The canonical formats are ``language_modeling``, ``prompt_only``, ``prompt_completion``,
``preference`` and ``unpaired_preference``: ``to_canonical`` turns ``instruction`` into
``prompt_completion``, ``ranked`` / ``implicit_prompt_preference`` into ``preference`` and
``sharegpt`` into conversational ``language_modeling`` (see `sharegpt_to_messages`).

Works on a ``datasets.Dataset`` (converted with ``Dataset.map``) or on a list of row dicts
(converted to a new list).
"""

from __future__ import annotations

import json
import math
import reprlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any, Union

import numpy as np
from datasets import Dataset

__all__ = [
    "FORMATS",
    "FormatError",
    "FormatInfo",
    "conversational_to_text",
    "detect_format",
    "implicit_to_explicit_preference",
    "instruction_to_prompt_completion",
    "is_conversational",
    "preference_to_unpaired",
    "ranked_to_preference",
    "sharegpt_to_messages",
    "to_canonical",
    "validate",
    "check_encodable",
]

Data = Union[Dataset, list]  # a Dataset or a list of row dicts

FORMATS = (
    "language_modeling",
    "prompt_only",
    "prompt_completion",
    "preference",
    "implicit_prompt_preference",
    "unpaired_preference",
    "ranked",
    "instruction",
    "sharegpt",
)

# (name, required columns, optional columns), tried in order.
_LAYOUTS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("ranked", ("prompt", "responses", "ranks"), ()),
    ("ranked", ("prompt", "responses", "scores"), ()),
    ("instruction", ("instruction", "output"), ("input",)),
    ("unpaired_preference", ("prompt", "completion", "label"), ()),
    ("preference", ("prompt", "chosen", "rejected"), ()),
    ("implicit_prompt_preference", ("chosen", "rejected"), ()),
    ("prompt_completion", ("prompt", "completion"), ()),
    ("language_modeling", ("messages",), ()),
    ("language_modeling", ("text",), ()),
    ("sharegpt", ("conversations",), ()),
    ("prompt_only", ("prompt",), ()),
)


class FormatError(ValueError):
    """A dataset whose columns or rows do not fit a known format, or an impossible conversion."""


@dataclass(frozen=True)
class FormatInfo:
    name: str  # one of FORMATS
    conversational: bool  # values are message lists rather than strings
    columns: tuple[str, ...]  # the columns that make up the format, in layout order; no extras


def is_conversational(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of mappings that each have 'role' and 'content'
    (or, for an assistant calling tools, 'tool_calls')."""
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m and ("content" in m or m.get("tool_calls")) for m in value)
    )


# --------------------------------------------------------------------------- detection


def detect_format(data: Dataset | Iterable) -> FormatInfo:
    """Detect the format of a Dataset, a list of row dicts, one row dict, or a list of column names.

    ``conversational`` is read from the first row; given only column names it is True only for
    ``messages``. Raises FormatError when no layout matches.
    """
    first: Mapping | None = None
    if isinstance(data, Dataset):
        columns = list(data.column_names)
        first = data[0] if len(data) else None
    elif isinstance(data, Mapping):
        columns, first = list(data), data
    else:
        items = [data] if isinstance(data, str) else list(data)
        if items and isinstance(items[0], Mapping):
            columns, first = list(items[0]), items[0]
        else:
            columns = [str(c) for c in items]

    present = set(columns)
    for name, required, optional in _LAYOUTS:
        if present.issuperset(required):
            cols = required + tuple(c for c in optional if c in present)
            kinds = (_kind(first.get(c)) for c in cols) if first is not None else ()
            kind = next((k for k in kinds if k), None)
            return FormatInfo(name, "messages" in cols or kind == "conversational", cols)

    layouts = "; ".join(
        f"{name}: {', '.join(required)}" + "".join(f" [, {c}]" for c in optional)
        for name, required, optional in _LAYOUTS
    )
    raise FormatError(
        f"no dataset format matches the columns {columns}. Accepted layouts, tried in this order "
        f"(extra columns are allowed): {layouts}"
    )


def _kind(value: Any) -> str | None:
    """'standard' for a string, 'conversational' for a non-empty list of mappings, else None."""
    if isinstance(value, str):
        return "standard"
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, Mapping) for m in value):
        return "conversational"
    return None


# --------------------------------------------------------------------------- validation

_MISSING = object()
_TEXT_OR_MESSAGES = "a non-empty string or a list of {'role','content'} messages"
_MESSAGE = "{'role': str, 'content': str}"
_TOOL_CALL = "{'type': 'function', 'function': {'name': str, 'arguments': dict or JSON object string}}"


class _Bad(Exception):
    """A malformed value; `validate` prefixes the row index and the column."""

    def __init__(self, message: str, column: str | None = None):
        super().__init__(message)
        self.column = column


def _describe(value: Any) -> str:
    if value is _MISSING:
        return "nothing (the column is missing from this row)"
    if value is None:
        return "None"
    if isinstance(value, (str, list, tuple)) and len(value) == 0:
        return f"an empty {type(value).__name__}"
    return f"{type(value).__name__} {reprlib.repr(value)}"


def _check_messages(messages: list) -> None:
    for j, m in enumerate(messages):
        if "role" not in m:
            raise _Bad(f"message {j}: 'role' is missing; expected {_MESSAGE}")
        if not isinstance(m["role"], str) or not m["role"]:
            got = _describe(m["role"])
            raise _Bad(f"message {j}: 'role' must be a non-empty string, got {got}")
        # None, not only a missing key: Arrow gives every message of a column the keys any has
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise _Bad(f"message {j}: only assistant messages may hold 'tool_calls', this one is "
                           f"{m['role']!r}")
            _check_tool_calls(j, m["tool_calls"])
            if m.get("content") is not None and not isinstance(m["content"], str):
                got = _describe(m["content"])
                raise _Bad(f"message {j}: 'content' must be a string or None beside 'tool_calls', got {got}")
        elif "content" not in m:
            raise _Bad(f"message {j}: 'content' is missing; expected {_MESSAGE} (or, for an assistant "
                       f"calling tools, 'tool_calls': [{_TOOL_CALL}, ...])")
        elif not isinstance(m["content"], str):
            raise _Bad(f"message {j}: 'content' must be a string, got {_describe(m['content'])}")
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise _Bad(f"message {j}: {key!r} must be a string, got {_describe(m[key])}")


def _check_tool_calls(j: int, calls: Any) -> None:
    if not isinstance(calls, (list, tuple)) or not calls:
        raise _Bad(f"message {j}: 'tool_calls' must be a non-empty list of {_TOOL_CALL}, got {_describe(calls)}")
    for k, call in enumerate(calls):
        where = f"message {j}, tool call {k}"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise _Bad(f"{where}: expected {_TOOL_CALL}, got {_describe(call)}")
        if call.get("type") not in (None, "function"):
            raise _Bad(f"{where}: 'type' must be 'function', got {_describe(call['type'])}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            got = _describe(function["name"]) if "name" in function else "nothing"
            raise _Bad(f"{where}: the function 'name' must be a non-empty string, got {got}")
        if "arguments" not in function:
            raise _Bad(f"{where}: the function 'arguments' are missing; expected a dict or a JSON object string "
                       f"(an empty dict for none)")
        arguments = function["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as err:
                raise _Bad(f"{where}: 'arguments' is a string but not valid JSON ({err}); expected a dict "
                           f"or a JSON object string") from None
        if not isinstance(arguments, Mapping):
            raise _Bad(f"{where}: 'arguments' must be a dict or a JSON object string, got {_describe(arguments)}")


def _tools(value: Any) -> None:
    """A row's ``tools``: None, or a list (or JSON string of a list) of schemas or functions."""
    expected = ("a list of tools, each a JSON schema {'type': 'function', 'function': {'name': ...}} or a "
                "Python function, or a JSON string of such a list")
    if value is None:
        return
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise _Bad(f"is a string but not valid JSON ({err}); expected {expected}") from None
    if not isinstance(value, (list, tuple)):
        raise _Bad(f"expected {expected}, got {_describe(value)}")
    for k, tool in enumerate(value):
        if callable(tool):
            continue
        schema = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(schema, Mapping) or not isinstance(schema.get("name"), str) or not schema["name"]:
            raise _Bad(f"tool {k}: expected a JSON schema with a function 'name' or a Python function, "
                       f"got {_describe(tool)}")


def _text_or_messages(value: Any, allow_empty: bool = False) -> str:
    kind = _kind(value)
    if kind == "conversational":
        _check_messages(value)
        return kind
    if kind == "standard" and (value or allow_empty):
        return kind
    if allow_empty:
        expected = "a string or a list of {'role','content'} messages"
    else:
        expected = _TEXT_OR_MESSAGES
    raise _Bad(f"expected {expected}, got {_describe(value)}")


def _string(value: Any) -> str:
    if isinstance(value, str) and value:
        return "standard"
    raise _Bad(f"expected a non-empty string, got {_describe(value)}")


def _optional_string(value: Any) -> None:
    if value is not None and value is not _MISSING and not isinstance(value, str):
        raise _Bad(f"expected a string or None, got {_describe(value)}")


def _messages(value: Any) -> str:
    if _kind(value) != "conversational":
        got = _describe(value)
        raise _Bad(f"expected a non-empty list of {{'role','content'}} messages, got {got}")
    _check_messages(value)
    return "conversational"


def _label(value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise _Bad(
            f"expected a bool (Python or numpy; 0/1 integers and strings are not accepted), "
            f"got {_describe(value)}"
        )


def _numbers(value: Any) -> None:
    if not isinstance(value, (list, tuple)) or not value:
        raise _Bad(f"expected a non-empty list of numbers, got {_describe(value)}")
    for j, x in enumerate(value):
        is_bool = isinstance(x, (bool, np.bool_))
        is_number = isinstance(x, (int, float, np.integer, np.floating)) and not is_bool
        if not is_number or not math.isfinite(x):
            raise _Bad(f"expected a list of finite numbers, element {j} is {_describe(x)}")


def _encodable(value: Any) -> None:
    """A text (or the texts of messages) that UTF-8 can encode: no lone surrogate (a half of a UTF-16 pair, which
    a bad decode leaves), on which the tokenizer would fail naming no row."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise _Bad(f"holds a lone surrogate character {value[err.start]!r} at position {err.start}, which "
                       "cannot be encoded as UTF-8; clean the text (e.g. text.encode('utf-8', 'replace')"
                       ".decode())") from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _encodable(item.get("content") if isinstance(item, Mapping) else item)


def check_encodable(value: Any) -> None:
    """Raise ValueError for a text, or a list/messages of texts, holding a lone surrogate (see `_encodable`)."""
    try:
        _encodable(value)
    except _Bad as err:
        raise ValueError(str(err)) from None


def _finite_number(value: Any) -> None:
    is_bool = isinstance(value, (bool, np.bool_))
    if is_bool or not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(value):
        raise _Bad(f"expected a finite number, got {_describe(value)}")


def _responses(value: Any) -> str:
    if not isinstance(value, (list, tuple)) or not value:
        got = _describe(value)
        raise _Bad(f"expected a non-empty list of responses, each {_TEXT_OR_MESSAGES}, got {got}")
    kinds = set()
    for j, response in enumerate(value):
        try:
            kinds.add(_text_or_messages(response))
        except _Bad as e:
            raise _Bad(f"response {j}: {e}") from None
    if len(kinds) > 1:
        raise _Bad("mixes string and message-list responses; use one or the other")
    return kinds.pop()


# ShareGPT speaker ("from") -> chat role; a `function_call` turn becomes an assistant tool call.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
_SHAREGPT_TURN = "{'from': 'human' | 'gpt' | 'system' | ..., 'value': str}"


def _sharegpt_message(j: int, turn: Any) -> dict:
    """One ShareGPT turn as a chat message; raises _Bad saying which turn and what was expected."""
    if not isinstance(turn, Mapping) or not isinstance(turn.get("from"), str) or "value" not in turn:
        raise _Bad(f"turn {j}: expected {_SHAREGPT_TURN}, got {_describe(turn)}")
    speaker, value = turn["from"], turn["value"]
    if speaker not in SHAREGPT_ROLES:
        raise _Bad(f"turn {j}: unknown speaker 'from': {speaker!r}; expected one of {sorted(SHAREGPT_ROLES)}")
    if not isinstance(value, str):
        raise _Bad(f"turn {j}: 'value' must be a string, got {_describe(value)}")
    if speaker != "function_call":
        return {"role": SHAREGPT_ROLES[speaker], "content": value}
    try:  # the call is a JSON object {"name": ..., "arguments": {...}}
        call = json.loads(value)
    except ValueError:
        call = None
    if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
        raise _Bad(f"turn {j}: a 'function_call' value must be a JSON object {{\"name\": str, \"arguments\": "
                   f"{{...}}}}, got {_describe(value)}")
    function = {"name": call["name"], "arguments": call.get("arguments", {})}
    return {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": function}]}


def _sharegpt(value: Any) -> str:
    if not isinstance(value, (list, tuple)) or not value:
        raise _Bad(f"expected a non-empty list of ShareGPT turns {_SHAREGPT_TURN}, got {_describe(value)}")
    _check_messages([_sharegpt_message(j, turn) for j, turn in enumerate(value)])
    return "conversational"


# Each check raises _Bad or returns the value's kind ('standard' / 'conversational' / None).
_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "prompt": lambda v: _text_or_messages(v, allow_empty=True),
    "completion": _text_or_messages,
    "chosen": _text_or_messages,
    "rejected": _text_or_messages,
    "text": _string,
    "messages": _messages,
    "label": _label,
    "responses": _responses,
    "ranks": _numbers,
    "scores": _numbers,
    "instruction": _string,
    "output": _string,
    "input": _optional_string,
    "conversations": _sharegpt,
}


# Extra columns that mean something to a trainer, checked wherever they appear.
_EXTRA_CHECKS: dict[str, Callable[[Any], None]] = {
    "margin": _finite_number,  # RewardTrainer: one NaN would make every weight NaN
    "tools": _tools,  # given to the chat template beside the row's messages
}


def _check_row(info: FormatInfo, row: Mapping) -> None:
    """Checks that involve several columns of one row."""
    if info.name == "ranked":
        key = info.columns[2]
        n, m = len(row["responses"]), len(row[key])
        if n != m:
            raise _Bad(f"has {m} values but 'responses' has {n}; expected one per response", key)
    elif info.name == "implicit_prompt_preference":
        _split_implicit(row["chosen"], row["rejected"])


def _iter_rows(data: Data, columns: tuple[str, ...], max_rows: int | None) -> Iterator[Mapping]:
    if not isinstance(data, Dataset):
        yield from islice(data, max_rows)
        return
    if max_rows is not None:
        data = data.select(range(min(max_rows, len(data))))
    data = data.select_columns(list(columns)).with_format(None)
    for batch in data.iter(batch_size=1000):  # whole batches: far faster than row-by-row access
        for values in zip(*(batch[c] for c in columns)):
            yield dict(zip(columns, values))


def validate(data: Data, info: FormatInfo | None = None, max_rows: int | None = None, start: int = 0) -> FormatInfo:
    """Check every row (or the first ``max_rows``) against the format; return its FormatInfo.
    ``start``: the number of the first row in messages (rows of a stream read part by part).

    Raises FormatError naming the row, the column and the expected form of the first malformed
    value, or the first row that is standard where earlier ones are conversational (or the
    reverse). The returned info's ``conversational`` comes from the rows, not from ``info``.
    """
    info = info or detect_format(data)
    available = set(data.column_names) if isinstance(data, Dataset) else set(info.columns)
    if missing := sorted(set(info.columns) - available):
        raise FormatError(f"the dataset has no column(s) {missing} needed by format {info.name!r}")

    if isinstance(data, Dataset):
        extras = tuple(c for c in _EXTRA_CHECKS if c in available and c not in info.columns)
    else:  # rows may differ in their keys: each row's extras are read from the row itself
        extras = tuple(c for c in _EXTRA_CHECKS if c not in info.columns)
    first: tuple[int, str, str] | None = None  # (row, column, kind) that fixed the dataset's kind
    for i, row in enumerate(_iter_rows(data, info.columns + extras, max_rows), start):
        for column in extras:
            if column in row:
                try:
                    _EXTRA_CHECKS[column](row[column])
                except _Bad as e:
                    raise FormatError(f"row {i}, column {column!r}: {e}") from None
        for column in info.columns:
            try:
                kind = _CHECKS[column](row.get(column, _MISSING))
                _encodable(row.get(column))
            except _Bad as e:
                raise FormatError(f"row {i}, column {column!r}: {e}") from None
            if kind is None:
                continue
            if first is None:
                first = (i, column, kind)
            elif kind != first[2]:
                raise FormatError(
                    f"the dataset mixes standard and conversational formats: row {first[0]}, "
                    f"column {first[1]!r} is {first[2]} but row {i}, column {column!r} is {kind}"
                )
        try:
            _check_row(info, row)
        except _Bad as e:
            raise FormatError(f"row {i}, column {e.column!r}: {e}") from None
    return replace(info, conversational=first[2] == "conversational") if first else info


# --------------------------------------------------------------------------- conversion helpers


def _columns(data: Data) -> list[str]:
    if isinstance(data, Dataset):
        return list(data.column_names)
    return list(data[0]) if data else []


def _expect(data: Data, *names: str) -> FormatInfo:
    info = detect_format(data)
    if info.name not in names:
        raise FormatError(
            f"expected a {' or '.join(names)} dataset, got {info.name} (columns {_columns(data)})"
        )
    return info


def _convert(
    data: Data,
    info: FormatInfo,
    new_columns: tuple[str, ...],
    fn: Callable[[int, Mapping], list[dict]],
) -> Data:
    """Replace the format columns by ``fn(index, row)`` -> zero or more rows; keep other columns."""
    extras = [c for c in _columns(data) if c not in info.columns and c not in new_columns]
    out_columns = (*new_columns, *extras)

    def rows(i: int, row: Mapping) -> list[dict]:
        return [{**new, **{c: row.get(c) for c in extras}} for new in fn(i, row)]

    if not isinstance(data, Dataset):
        return [new for i, row in enumerate(data) for new in rows(i, row)]

    def batch_fn(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {c: [] for c in out_columns}
        for k, i in enumerate(indices):
            for new in rows(i, {c: values[k] for c, values in batch.items()}):
                for c in out_columns:
                    out[c].append(new[c])
        return out

    desc = f"{info.name} to {', '.join(new_columns)}"
    out = data.map(
        batch_fn, batched=True, with_indices=True, remove_columns=data.column_names, desc=desc
    )
    # when no row comes out, map never sees our columns and returns the wrong (or no) columns
    return out if len(out) else Dataset.from_dict({c: [] for c in out_columns})


def _common_prefix_len(a: str | list, b: str | list) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search: slice comparison runs in C, a per-item loop would not
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _split_implicit(chosen: str | list, rejected: str | list) -> tuple[Any, Any, Any]:
    """(prompt, chosen continuation, rejected continuation) of an implicit-prompt pair.

    Strings: the longest common prefix, backed off to a word boundary when it ends inside a
    word or covers a whole string, then stripped of trailing whitespace, so both continuations
    start with the separating whitespace (``"Q: 2+2?\\nA: 4"`` / ``"Q: 2+2?\\nA: 5"`` give
    ``"Q: 2+2?\\nA:"``, ``" 4"``, ``" 5"``). That split tokenises like the joined string with
    byte-level BPE, and keeps both continuations non-empty.
    Messages: the common leading messages, minus the trailing assistant turn(s), leaving each
    side at least one message.
    """
    k = _common_prefix_len(chosen, rejected)
    if isinstance(chosen, str):
        inside = k < min(len(chosen), len(rejected))
        if not (inside and chosen[k].isspace() and rejected[k].isspace()):  # not at a word end
            while k > 0 and not chosen[k - 1].isspace():
                k -= 1
        while k > 0 and chosen[k - 1].isspace():
            k -= 1
    else:
        k = min(k, len(chosen) - 1, len(rejected) - 1)
        while k > 0 and chosen[k - 1]["role"] == "assistant":
            k -= 1
    if k == 0:
        raise _Bad(
            "chosen and rejected share no prompt (no common leading words or non-assistant "
            "messages); add an explicit 'prompt' column",
            "chosen",
        )
    return chosen[:k], chosen[k:], rejected[k:]


def _join(prompt: str | list, completion: str | list) -> str | list:
    return prompt + completion if isinstance(prompt, str) else [*prompt, *completion]


# --------------------------------------------------------------------------- conversions


def instruction_to_prompt_completion(data: Data) -> Data:
    """``instruction``/``input``/``output`` -> ``prompt``/``completion``.

    prompt = instruction, plus ``"\\n\\n" + input`` when input is non-empty; completion = output.
    """
    info = _expect(data, "instruction")

    def convert(i: int, row: Mapping) -> list[dict]:
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
        return [{"prompt": prompt, "completion": row["output"]}]

    return _convert(data, info, ("prompt", "completion"), convert)


def _best_first(row: Mapping, key: str) -> tuple[list[int], list[float]]:
    """Response indices best first (stable on ties), and each response's badness (lower: better)."""
    badness = list(row[key]) if key == "ranks" else [-s for s in row[key]]
    return sorted(range(len(badness)), key=badness.__getitem__), badness


def ranked_to_preference(data: Data) -> Data:
    """``prompt``/``responses``/``ranks`` or ``scores`` -> one preference row per ordered pair.

    Pairs are every (better, worse) pair with a strict difference, ties skipped, listed with the
    best response's pairs first: ranks [1, 2, 0] give (2 > 0), (2 > 1), (0 > 1). A row that gives
    no pair (one response, or all tied) raises FormatError naming it, rather than vanish.
    """
    info = _expect(data, "ranked")

    def convert(i: int, row: Mapping) -> list[dict]:
        key = info.columns[2]
        order, badness = _best_first(row, key)
        responses = row["responses"]
        pairs = [
            {"prompt": row["prompt"], "chosen": responses[a], "rejected": responses[b]}
            for n, a in enumerate(order)
            for b in order[n + 1 :]
            if badness[a] < badness[b]
        ]
        if not pairs:
            raise FormatError(
                f"row {i}, column {key!r}: {list(row[key])} gives no (better, worse) pair: "
                f"{'the only response' if len(order) == 1 else 'all responses tie'}; give at least "
                f"two responses with different {key}, or drop the row"
            )
        return pairs

    return _convert(data, info, ("prompt", "chosen", "rejected"), convert)


def implicit_to_explicit_preference(data: Data) -> Data:
    """``chosen``/``rejected`` with a shared start -> ``prompt``/``chosen``/``rejected``.

    See `_split_implicit` for where the prompt ends; a pair with no shared prompt raises.
    """
    info = _expect(data, "implicit_prompt_preference")

    def convert(i: int, row: Mapping) -> list[dict]:
        try:
            prompt, chosen, rejected = _split_implicit(row["chosen"], row["rejected"])
        except _Bad as e:
            raise FormatError(f"row {i}, column {e.column!r}: {e}") from None
        return [{"prompt": prompt, "chosen": chosen, "rejected": rejected}]

    return _convert(data, info, ("prompt", "chosen", "rejected"), convert)


def preference_to_unpaired(data: Data) -> Data:
    """Each pair -> two rows: (prompt, chosen, label=True) and (prompt, rejected, label=False)."""
    info = _expect(data, "preference")

    def convert(i: int, row: Mapping) -> list[dict]:
        return [
            {"prompt": row["prompt"], "completion": row["chosen"], "label": True},
            {"prompt": row["prompt"], "completion": row["rejected"], "label": False},
        ]

    return _convert(data, info, ("prompt", "completion", "label"), convert)


def sharegpt_to_messages(data: Data) -> Data:
    """ShareGPT ``conversations`` (turns ``{"from", "value"}``) -> ``messages``.

    Speakers map to roles by `SHAREGPT_ROLES` (human -> user, gpt -> assistant, observation ->
    tool, ...); a ``function_call`` turn, whose value is a JSON object ``{"name", "arguments"}``,
    becomes an assistant message calling that tool. An unknown speaker raises FormatError
    naming the row and the turn.
    """
    info = _expect(data, "sharegpt")

    def convert(i: int, row: Mapping) -> list[dict]:
        try:
            _sharegpt(row["conversations"])
        except _Bad as e:
            raise FormatError(f"row {i}, column 'conversations': {e}") from None
        return [{"messages": [_sharegpt_message(j, turn) for j, turn in enumerate(row["conversations"])]}]

    return _convert(data, info, ("messages",), convert)


def _chosen_as_completion(data: Data) -> Data:
    info = _expect(data, "preference")

    def convert(i: int, row: Mapping) -> list[dict]:
        return [{"prompt": row["prompt"], "completion": row["chosen"]}]

    return _convert(data, info, ("prompt", "completion"), convert)


def _desirable_as_completion(data: Data) -> Data:
    info = _expect(data, "unpaired_preference")

    def convert(i: int, row: Mapping) -> list[dict]:
        return [{"prompt": row["prompt"], "completion": row["completion"]}] if row["label"] else []

    return _convert(data, info, ("prompt", "completion"), convert)


def _best_as_completion(data: Data) -> Data:
    info = _expect(data, "ranked")

    def convert(i: int, row: Mapping) -> list[dict]:
        best = _best_first(row, info.columns[2])[0][0]
        return [{"prompt": row["prompt"], "completion": row["responses"][best]}]

    return _convert(data, info, ("prompt", "completion"), convert)


def _prompt_completion_to_lm(data: Data) -> Data:
    info = _expect(data, "prompt_completion")
    column = "messages" if info.conversational else "text"

    def convert(i: int, row: Mapping) -> list[dict]:
        return [{column: _join(row["prompt"], row["completion"])}]

    return _convert(data, info, (column,), convert)


def _keep_prompt(data: Data) -> Data:
    info = _expect(data, "prompt_completion", "preference", "unpaired_preference", "ranked")

    def convert(i: int, row: Mapping) -> list[dict]:
        return [{"prompt": row["prompt"]}]

    return _convert(data, info, ("prompt",), convert)


# Every conversion `to_canonical` may chain, keyed (from, to). Several hops go by the shortest
# path, so ranked -> prompt_only / prompt_completion keep one row per prompt (the best response)
# instead of one per pair.
_STEPS: dict[tuple[str, str], Callable[[Data], Data]] = {
    ("instruction", "prompt_completion"): instruction_to_prompt_completion,
    ("ranked", "preference"): ranked_to_preference,
    ("implicit_prompt_preference", "preference"): implicit_to_explicit_preference,
    ("preference", "unpaired_preference"): preference_to_unpaired,
    ("preference", "prompt_completion"): _chosen_as_completion,
    ("unpaired_preference", "prompt_completion"): _desirable_as_completion,
    ("ranked", "prompt_completion"): _best_as_completion,
    ("prompt_completion", "language_modeling"): _prompt_completion_to_lm,
    ("prompt_completion", "prompt_only"): _keep_prompt,
    ("preference", "prompt_only"): _keep_prompt,
    ("unpaired_preference", "prompt_only"): _keep_prompt,
    ("ranked", "prompt_only"): _keep_prompt,
    ("sharegpt", "language_modeling"): sharegpt_to_messages,
}
_CANONICAL = {
    "instruction": "prompt_completion",
    "ranked": "preference",
    "implicit_prompt_preference": "preference",
    "sharegpt": "language_modeling",
}
_OUTPUT_COLUMNS = {
    "prompt_only": ("prompt",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
    "unpaired_preference": ("prompt", "completion", "label"),
}


def _path(source: str, target: str) -> tuple[list[tuple[str, str]] | None, list[str]]:
    """Shortest chain of _STEPS from source to target (None if none), and all reachable formats."""
    previous: dict[str, str | None] = {source: None}
    queue = deque([source])
    while queue:
        node = queue.popleft()
        for a, b in _STEPS:
            if a == node and b not in previous:
                previous[b] = node
                queue.append(b)
    reachable = [name for name in previous if name != source]
    if target not in previous:
        return None, reachable
    path = []
    while target != source:
        path.append((previous[target], target))
        target = previous[target]
    return path[::-1], reachable


def _missing_columns(data: Data, goal: str) -> str:
    """'. A <goal> dataset needs column(s) ...': the columns of `goal`'s layouts the data lacks, with the data's
    columns that look like misspellings of them; '' when no layout of `goal` is one column short."""
    import difflib

    if isinstance(data, Dataset):
        present = list(data.column_names)
    else:
        rows = [data] if isinstance(data, Mapping) else list(data)
        present = list(dict.fromkeys(c for row in rows[:1] if isinstance(row, Mapping) for c in row))
    wanted = [[c for c in required if c not in present] for name, required, _ in _LAYOUTS if name == goal]
    missing = min(wanted, key=len, default=[])
    if not missing:
        return ""
    hints = [f"{c!r} (is {close[0]!r} a misspelling?)" if (close := difflib.get_close_matches(c, present, 1, 0.6))
             else repr(c) for c in missing]
    return f". The {goal} format needs the column(s) {', '.join(hints)}; this one has {present}"


def to_canonical(data: Data, target: str | None = None) -> tuple[Data, FormatInfo]:
    """Validate ``data`` and convert it to its canonical format, or to ``target`` when given.

    Without ``target``: instruction -> prompt_completion; ranked and implicit_prompt_preference
    -> preference; canonical formats are returned unchanged. Targets beyond that:

    * ``unpaired_preference`` from preference: each pair gives a desirable (chosen) row and an
      undesirable (rejected) row.
    * ``prompt_completion`` from preference keeps the chosen response only; from unpaired
      preference, the desirable rows only; from ranked, the best response of each row.
    * ``language_modeling`` from any of those: prompt + completion joined (strings concatenated
      as they are, message lists chained into ``messages``).
    * ``prompt_only`` from anything with a prompt, one row per input row.

    Any other conversion raises FormatError naming the formats that are reachable.
    """
    info = validate(data)
    if target is not None and target not in FORMATS:
        raise FormatError(f"unknown target format {target!r}; expected one of {FORMATS}")
    goal = target or _CANONICAL.get(info.name, info.name)
    path, reachable = _path(info.name, goal)
    if path is None:
        raise FormatError(
            f"cannot convert a {info.name} dataset to {goal}; from {info.name} the possible "
            f"targets are {reachable or 'none'}{_missing_columns(data, goal)}"
        )
    if not path:
        return data, info
    for step in path:
        data = _STEPS[step](data)
    columns = ("messages",) if info.conversational else ("text",)
    return data, FormatInfo(goal, info.conversational, _OUTPUT_COLUMNS.get(goal, columns))


def conversational_to_text(data: Data, tokenizer: Any, **template_kwargs: Any) -> Data:
    """Render every message column to a string with ``tokenizer.apply_chat_template``.

    * ``messages`` -> ``text``: the whole conversation.
    * ``prompt``: rendered with ``add_generation_prompt=True``.
    * ``completion`` / ``chosen`` / ``rejected`` / each of ``responses``, when there is a prompt:
      prompt + completion rendered together, minus the rendered prompt, so that prompt + completion
      strings equal the rendered conversation. Raises FormatError when the template does not
      render the prompt as a prefix of the conversation.
    * ``chosen`` / ``rejected`` without a prompt: each whole conversation.

    A standard dataset is returned unchanged. ``template_kwargs`` go to every template call; a
    ``tools`` column gives each row's tools to its calls (and is kept).
    """
    from posttrain.data.chat import template_inputs

    info = validate(data)
    if not info.conversational:
        return data

    def render(messages: list, tools: Any, generation_prompt: bool = False) -> str:
        messages, tools = template_inputs(messages, tools)
        kwargs = {"tools": tools, **template_kwargs} if tools else template_kwargs
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **kwargs,
        )

    def continuation(i: int, column: str, row: Mapping, rendered_prompt: str, completion: list):
        full = render([*row["prompt"], *completion], row.get("tools"))
        if not full.startswith(rendered_prompt):
            raise FormatError(
                f"row {i}, column {column!r}: the chat template renders prompt + {column} as "
                f"{reprlib.repr(full)}, which does not start with the prompt rendered with "
                f"add_generation_prompt=True ({reprlib.repr(rendered_prompt)}), so the {column} "
                f"cannot be cut out as a continuation; use a template whose generation prompt "
                f"matches the start of an assistant turn"
            )
        return full[len(rendered_prompt) :]

    def convert(i: int, row: Mapping) -> list[dict]:
        tools = row.get("tools")
        if info.name == "language_modeling":
            return [{"text": render(row["messages"], tools)}]
        out = {c: row[c] for c in info.columns}
        if "prompt" not in out:  # implicit prompt: render each whole conversation
            return [{**out, "chosen": render(row["chosen"], tools), "rejected": render(row["rejected"], tools)}]
        out["prompt"] = render(row["prompt"], tools, generation_prompt=True)
        for column in ("completion", "chosen", "rejected"):
            if column in out:
                out[column] = continuation(i, column, row, out["prompt"], row[column])
        if "responses" in out:
            out["responses"] = [continuation(i, "responses", row, out["prompt"], r) for r in row["responses"]]
        return [out]

    new_columns = tuple("text" if c == "messages" else c for c in info.columns)
    return _convert(data, info, new_columns, convert)
