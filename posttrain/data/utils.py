"""TRL's data helpers (`trl.data_utils`), with TRL's names, signatures and documented behaviour.

Scripts written for TRL call these on single examples (`dataset.map(maybe_apply_chat_template, ...)`)
or on whole datasets (`pack_dataset`, `truncate_dataset`, `unpair_preference_dataset`). They are
thin layers over posttrain's own data code: chat templates render through
`posttrain.data.chat.template_inputs` (tool calls and `tools` columns as the trainers read them),
the shared prompt of an implicit pair is TRL's character-level rule, and packing bins with
`posttrain.data.packing.best_fit_decreasing`.

Departures from TRL (also in docs/migrating.md):
* `pack_dataset` works row by row in Python rather than on Arrow buffers: the same rows and
  `seq_lengths`, slower on millions of rows. Among bins with the same free room, the most
  recently opened one is filled first (TRL takes the oldest), so ties may place a sequence in
  another bin.
* `apply_chat_template` names the row's keys in its KeyError and the role in its ValueError.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import takewhile
from typing import Any, TypeVar

from datasets import Dataset, DatasetDict

from posttrain.data.chat import template_inputs
from posttrain.data.packing import best_fit_decreasing

DatasetType = TypeVar("DatasetType", Dataset, DatasetDict)

__all__ = ["apply_chat_template", "extract_prompt", "is_conversational", "is_conversational_from_value",
           "maybe_apply_chat_template", "maybe_convert_to_chatml", "maybe_extract_prompt",
           "maybe_unpair_preference_dataset", "pack_dataset", "truncate_dataset", "unpair_preference_dataset"]

MESSAGE_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")
# the key sets apply_chat_template accepts (among MESSAGE_KEYS and "label"), as TRL lists them
_LAYOUTS = ({"messages"}, {"prompt"}, {"prompt", "completion"}, {"prompt", "chosen", "rejected"},
            {"chosen", "rejected"}, {"prompt", "completion", "label"})
PACKING_STRATEGIES = ("bfd", "bfd-requeue", "wrapped")


def is_conversational(example: Mapping[str, Any]) -> bool:
    """Whether `example` is conversational: its first key among prompt / chosen / rejected / completion /
    messages holds a list whose first element is a dict with a "role"."""
    key = next((k for k in example if k in MESSAGE_KEYS), None)
    value = example[key] if key is not None else None
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping) and "role" in value[0]


def is_conversational_from_value(example: Mapping[str, Any]) -> bool:
    """Whether `example["conversations"]` is a ShareGPT-style list of {"from", "value"} turns."""
    value = example.get("conversations")
    return (isinstance(value, list) and bool(value) and isinstance(value[0], Mapping)
            and "from" in value[0] and "value" in value[0])


def maybe_convert_to_chatml(example: dict[str, Any]) -> dict[str, Any]:
    """`example` with "from"/"value" message keys renamed to "role"/"content" (in prompt, completion, chosen,
    rejected, messages and conversations) and "conversations" renamed to "messages"; changed in place and
    returned. Speaker names are kept as they are (TRL does not map "human" to "user"; for that, posttrain's
    `formats.sharegpt_to_messages` does)."""
    for key in (*MESSAGE_KEYS, "conversations"):
        if isinstance(example.get(key), list):
            for message in example[key]:
                if isinstance(message, dict):
                    if "from" in message:
                        message["role"] = message.pop("from")
                    if "value" in message:
                        message["content"] = message.pop("value")
    if "conversations" in example:
        example["messages"] = example.pop("conversations")
    return example


# --------------------------------------------------------------------------- chat templates

def apply_chat_template(example: Mapping[str, Any], tokenizer, tools: list[dict | Callable] | None = None,
                        **template_kwargs) -> dict[str, Any]:
    """A conversational example rendered to strings with `tokenizer`'s chat template.

    messages -> text (the whole conversation); prompt -> the prompt with the generation prompt (or, when
    its last message is the assistant's, with that message left open); completion / chosen / rejected ->
    what prompt + it renders to beyond the rendered prompt (the prompt is cut back to the common start of
    both renderings, for templates whose generation prompt differs from the start of an assistant turn);
    chosen / rejected without a prompt -> each whole conversation; label is kept. A row's
    "chat_template_kwargs" dict and `template_kwargs` reach the template. Raises KeyError for key sets that
    are no known format, ValueError for a prompt ending in another role.
    """
    keys = {k for k in example if k in (*MESSAGE_KEYS, "label")}
    if keys not in _LAYOUTS:
        raise KeyError(f"Invalid keys in the example: {sorted(keys)}; expected one of "
                       f"{[sorted(layout) for layout in _LAYOUTS]}")
    kwargs = {**(example.get("chat_template_kwargs") or {}), **template_kwargs}

    def render(messages, **extra) -> str:
        messages, schemas = template_inputs(messages, tools)
        return tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, **extra, **kwargs)

    out: dict[str, Any] = {}
    if "messages" in example:
        out["text"] = render(example["messages"])
    if "prompt" in example:
        role = example["prompt"][-1]["role"]
        if role not in ("user", "tool", "assistant"):
            raise ValueError(f"Invalid role in the last message of the prompt: {role!r}; expected 'user', 'tool' "
                             f"or 'assistant'")
        open_turn = role == "assistant"
        prompt = render(example["prompt"], add_generation_prompt=not open_turn, continue_final_message=open_turn)
        joined = {k: render([*example["prompt"], *example[k]]) for k in ("chosen", "rejected", "completion")
                  if k in example}
        for full in joined.values():  # e.g. DeepSeek-R1 writes more after the generation prompt than in a turn
            prompt = "".join(a for a, _ in takewhile(lambda ab: ab[0] == ab[1], zip(prompt, full)))
        out["prompt"] = prompt
        out.update({k: full[len(prompt):] for k, full in joined.items()})
    else:
        out.update({k: render(example[k]) for k in ("chosen", "rejected") if k in example})
    if "label" in example:
        out["label"] = example["label"]
    return {k: out[k] for k in ("text", "prompt", "chosen", "rejected", "completion", "label") if k in out}


def maybe_apply_chat_template(example: Mapping[str, Any], tokenizer, tools: list[dict | Callable] | None = None,
                              **template_kwargs) -> dict[str, Any]:
    """`apply_chat_template(example, ...)` when `example` is conversational, else `example` unchanged."""
    if is_conversational(example):
        return apply_chat_template(example, tokenizer, tools, **template_kwargs)
    return example


# --------------------------------------------------------------------------- implicit prompts

def extract_prompt(example: Mapping[str, Sequence]) -> dict[str, Sequence]:
    """Split the shared start of `chosen` and `rejected` off as the prompt.

    The prompt is their common prefix (messages, or characters of a string), minus one space when the
    first difference follows one, so both continuations start with it: "The sky is blue." / "The sky is
    green." give "The sky is", " blue.", " green.".
    """
    chosen, rejected = example["chosen"], example["rejected"]
    idx = min(len(chosen), len(rejected))
    for i in range(idx):
        if chosen[i] != rejected[i]:
            idx = i - 1 if i > 0 and chosen[i - 1] == " " else i
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def maybe_extract_prompt(example: Mapping[str, Any]) -> Mapping[str, Any]:
    """`extract_prompt(example)` for a preference example whose prompt is implicit; other examples unchanged.

    A "prompt" column counts as explicit only when it is of the same kind (conversational or not) as
    "chosen": some datasets carry a string prompt beside conversations that already hold it.
    """
    if "chosen" not in example or "rejected" not in example:
        return example
    if "prompt" in example and (is_conversational({"chosen": example["chosen"]})
                                == is_conversational({"prompt": example["prompt"]})):
        return example
    return extract_prompt({"chosen": example["chosen"], "rejected": example["rejected"]})


# --------------------------------------------------------------------------- unpairing

def _unpair_rows(batch: dict[str, list]) -> dict[str, list]:
    n = len(batch["chosen"])
    out = {"completion": batch["chosen"] + batch["rejected"], "label": [True] * n + [False] * n}
    for key, values in batch.items():  # other columns (prompt, ids, ...) follow both halves
        if key not in ("chosen", "rejected"):
            out[key] = values + values
    return out


def unpair_preference_dataset(dataset: DatasetType, num_proc: int | None = None,
                              desc: str | None = None) -> DatasetType:
    """A chosen/rejected (and optionally prompt) dataset as prompt/completion/label rows: each batch's chosen
    completions (label True) followed by its rejected ones (label False)."""
    return dataset.map(_unpair_rows, batched=True, remove_columns=["chosen", "rejected"], num_proc=num_proc,
                       desc=desc)


def maybe_unpair_preference_dataset(dataset: DatasetType, num_proc: int | None = None,
                                    desc: str | None = None) -> DatasetType:
    """`unpair_preference_dataset(dataset)` when it has chosen and rejected columns, else `dataset`."""
    first = dataset[next(iter(dataset))] if isinstance(dataset, DatasetDict) else dataset
    if {"chosen", "rejected"} <= set(first.column_names):
        return unpair_preference_dataset(dataset, num_proc=num_proc, desc=desc)
    return dataset


# --------------------------------------------------------------------------- packing and truncation

def _list_columns(batch: dict[str, list], what: str) -> list[str]:
    bad = [k for k, v in batch.items() if v and not isinstance(v[0], (list, tuple))]
    if bad:
        raise TypeError(f"{what} needs every column to hold token lists; {bad} do not (drop them first, e.g. "
                        f"dataset.select_columns(['input_ids', ...]))")
    return list(batch)


def _pieces(batch: dict[str, list], seq_length: int, requeue: bool) -> list[tuple[int, int, int]]:
    """(row, start, length) of each piece to pack: a row's first `seq_length` tokens, and with `requeue` the
    rest as further pieces of at most `seq_length` tokens. Aligned columns must be as long as the first."""
    first, pieces = next(iter(batch)), []
    for row, ids in enumerate(batch[first]):
        for key, values in batch.items():
            if len(values[row]) != len(ids):
                raise ValueError(f"row {row}: column {key!r} has {len(values[row])} values but {first!r} has "
                                 f"{len(ids)}; list columns must be aligned to pack them")
        starts = range(0, len(ids), seq_length) if requeue else range(min(len(ids), 1))
        pieces += [(row, s, min(seq_length, len(ids) - s)) for s in starts]
    return pieces


def _pack_bfd(batch: dict[str, list], seq_length: int, requeue: bool) -> dict[str, list]:
    columns = _list_columns(batch, "pack_dataset")
    pieces = _pieces(batch, seq_length, requeue)
    bins = best_fit_decreasing([n for _, _, n in pieces], seq_length)
    out = {c: [[t for i in b for t in batch[c][pieces[i][0]][pieces[i][1]:pieces[i][1] + pieces[i][2]]]
               for b in bins] for c in columns}
    out["seq_lengths"] = [[pieces[i][2] for i in b] for b in bins]
    return out


def _pack_wrapped(batch: dict[str, list], seq_length: int) -> dict[str, list]:
    out = {}
    for c in _list_columns(batch, "pack_dataset"):
        stream = [t for seq in batch[c] for t in seq]
        out[c] = [stream[i:i + seq_length] for i in range(0, len(stream), seq_length)]
    return out


def pack_dataset(dataset: DatasetType, seq_length: int, strategy: str = "bfd",
                 map_kwargs: dict[str, Any] | None = None) -> DatasetType:
    """Pack the token-list columns of `dataset` into rows of at most `seq_length` tokens.

    strategy: "bfd" (best-fit decreasing: whole sequences, cut to `seq_length`, the overflow dropped), "bfd-requeue"
    (the same, but the overflow is packed as further sequences) or "wrapped" (everything concatenated and cut every
    `seq_length` tokens). The bfd strategies add "seq_lengths" (the lengths of the sequences each row holds) for
    `DataCollatorForLanguageModeling` to restart position ids. Packing happens within each `map` batch
    (`map_kwargs`, e.g. {"batch_size": 1000}). Every column must hold token lists.
    """
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(f"Invalid packing strategy: {strategy!r}. Use one of {PACKING_STRATEGIES}.")
    if seq_length < 1:
        raise ValueError(f"seq_length must be >= 1, got {seq_length}")
    if strategy == "wrapped":
        fn, fn_kwargs = _pack_wrapped, {"seq_length": seq_length}
    else:
        fn, fn_kwargs = _pack_bfd, {"seq_length": seq_length, "requeue": strategy == "bfd-requeue"}
    return dataset.map(fn, batched=True, fn_kwargs=fn_kwargs, **(map_kwargs or {}))


def _truncate(batch: dict[str, list], max_length: int) -> dict[str, list]:
    return {k: [v[:max_length] for v in values] if values and isinstance(values[0], (list, tuple)) else values
            for k, values in batch.items()}


def truncate_dataset(dataset: DatasetType, max_length: int, map_kwargs: dict[str, Any] | None = None) -> DatasetType:
    """`dataset` with every list column (input_ids, masks, ...) cut to its first `max_length` elements; other
    columns unchanged."""
    return dataset.map(_truncate, batched=True, fn_kwargs={"max_length": max_length}, **(map_kwargs or {}))
