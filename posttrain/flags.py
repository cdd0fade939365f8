"""Command-line flags from dataclass fields, and the type checks of values that arrive typed (YAML).

One `_Flag` per field: a converter from one command-line word (bool: true/false/yes/no/1/0, a Literal's
choices, an Enum, a JSON dict, a list's elements, a dataclass as a JSON object or a bare path, None for an
Optional) and the annotation that a YAML value is checked against. `_add_flags` adds them to an argparse
parser as transformers' HfArgumentParser shapes them (`--flag [true|false]`, `--no_flag` for a bool that
defaults to True, several words for a list). `posttrain <command>` (cli.py) and `TrlParser` (scripts.py)
both make their flags here, so a flag and a YAML value read the same way in each.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TRUE, _FALSE, _NONE = ("true", "yes", "1", "on"), ("false", "no", "0", "off"), ("none", "null")


def _parse_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def _members(tp) -> list:
    """The alternatives of a Union (X | Y | None) or [tp]."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return list(typing.get_args(tp))
    return [tp]


def _scalar(tp) -> Callable[[str], Any] | None:
    """A str -> value converter for one non-union, non-list type; None when it cannot be given as text."""
    origin = typing.get_origin(tp)
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):
        return tp
    if tp is dict or origin is dict:
        def as_dict(text):
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError(text)
            return value
        return as_dict
    if origin is typing.Literal:
        choices = typing.get_args(tp)

        def literal(text):
            for choice in choices:
                if str(choice).lower() == text.lower():
                    return choice
            raise ValueError(text)
        return literal
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp  # the config accepts the member or its string value
    if dataclasses.is_dataclass(tp):  # e.g. one dataset of --datasets: a JSON object of its fields, or a bare path
        def as_fields(text):
            value = json.loads(text) if text.lstrip().startswith("{") else {"path": text}
            if not isinstance(value, dict):
                raise ValueError(text)
            return value
        return as_fields
    if tp is Any:
        def anything(text):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return text
        return anything
    return None


@dataclass
class _Flag:
    name: str
    convert: Callable[[str], Any]  # one command-line word -> value (raises ValueError)
    type_name: str
    type: Any  # the field's annotation, to check values that arrive already typed (YAML)
    is_bool: bool = False
    is_list: bool = False


def _flag(name: str, tp) -> _Flag | None:
    members = _members(tp)
    nullable = type(None) in members
    members = [m for m in members if m is not type(None)]
    list_member = next((m for m in members if typing.get_origin(m) is list or m is list), None)
    element = (typing.get_args(list_member) or (str,))[0] if list_member is not None else None
    ordered = sorted((m for m in members if m is not list_member), key=lambda m: m is str)  # str last
    converters = [c for c in map(_scalar, ordered) if c is not None]
    if list_member is not None:
        element_convert = next((c for c in map(_scalar, _members(element)) if c is not None), str)
    if not converters and list_member is None:
        return None

    def convert(text: str):
        if nullable and text.lower() in _NONE:
            return None
        if list_member is not None and text.startswith("["):
            return [element_convert(str(v)) if not isinstance(v, str) else element_convert(v)
                    for v in json.loads(text)]
        for c in converters:
            try:
                return c(text)
            except (ValueError, json.JSONDecodeError):
                continue
        if list_member is not None:
            return element_convert(text)  # one word given for a list field
        raise ValueError(text)

    names = [getattr(m, "__name__", str(m)) for m in members] + (["None"] if nullable else [])
    convert.__name__ = " | ".join(names)  # argparse names the type in "invalid ... value" errors
    return _Flag(name, convert, convert.__name__, tp, is_bool=members == [bool], is_list=list_member is not None)


def _flags(cls) -> dict[str, _Flag]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that cannot be resolved: fall back to the raw ones
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
    flags = {}
    for f in dataclasses.fields(cls):
        if f.init and not f.name.startswith("_"):
            flag = _flag(f.name, hints.get(f.name, f.type))
            if flag is not None:
                flags[f.name] = flag
    return flags


# the flags `posttrain <command> --help` lists (those the command has); --help-all lists every one
COMMON_FLAGS = ("model_name_or_path", "dataset_name", "output_dir", "max_steps", "num_train_epochs",
                "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "max_length",
                "logging_steps", "save_strategy", "save_steps", "eval_strategy", "seed", "report_to",
                "resume_from_checkpoint", "use_peft", "dtype", "beta", "loss_type", "reward_funcs",
                "reward_model_path", "sft_model_path", "num_generations", "max_completion_length", "temperature")


def _add_flags(parser: argparse.ArgumentParser, cls, flags: dict[str, _Flag], title: str, show_all: bool = True):
    """One flag per field of `cls` that `flags` holds; with show_all False, --help lists only COMMON_FLAGS."""
    shown = [f for f in dataclasses.fields(cls) if f.name in flags and (show_all or f.name in COMMON_FLAGS)]
    group = parser.add_argument_group(title) if shown else parser
    for f in dataclasses.fields(cls):
        flag = flags.get(f.name)
        if flag is None:
            continue
        names = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        help_text = f.metadata.get("help", "")
        if f.default is not dataclasses.MISSING:
            help_text += f" (default: {f.default!r})"
        help_text = help_text.replace("%", "%%") if f in shown else argparse.SUPPRESS
        kwargs = dict(dest=f.name, type=flag.convert, default=argparse.SUPPRESS, help=help_text)
        if flag.is_bool:
            kwargs.update(nargs="?", const=True, metavar="true|false")
        elif flag.is_list:
            kwargs.update(nargs="+")
        group.add_argument(*names, **kwargs)
        if flag.is_bool and f.default is True:  # as transformers' HfArgumentParser: --no_<field> turns it off
            group.add_argument(f"--no_{f.name}", dest=f.name, action="store_false", default=argparse.SUPPRESS,
                               help=f"Set {f.name} to False." if f in shown else argparse.SUPPRESS)


def _matches(value, tp) -> bool:
    """Whether a YAML value (already a Python object) fits annotation `tp`; types we cannot check pass
    and are left to the config's own `__post_init__`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, member) for member in args)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:  # YAML `true` is a bool, which Python counts as an int
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is list or origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value if args)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    if origin is typing.Literal:
        return value in args
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return isinstance(value, tp) or value in [member.value for member in tp]
    return True


def _yaml_value(flag: _Flag, value):
    """A YAML value for `flag`'s field, or ValueError. YAML values arrive typed; strings for non-string
    fields (e.g. `1e-5`) go through the flag's converter, and one value for a list field becomes a list."""
    if isinstance(value, str):
        value = flag.convert(value)
    elif isinstance(value, list) and flag.is_list:
        value = [flag.convert(v) if isinstance(v, str) else v for v in value]
    if _matches(value, flag.type):
        return value
    if flag.is_list and _matches([value], flag.type):
        return [value]
    raise ValueError(value)
