"""One `Registry` type for every table of named functions in posttrain (advantage estimators, policy losses,
loss aggregations, KL estimators, preference losses, f-divergences, SFT losses, built-in rewards, ...).

An entry is a function, the facts its callers read (per token or per sequence, needs a critic, the smallest
group, its aggregation, reference-free, ...) and its options. A registry made with an `entry` class and the
names of the inputs its functions take first (`positional`) reads each function's options off its signature:
they are keyword-only parameters, and the online engine passes each from the config field of the same name. A
parameter that is neither would never be set from the config and silently keep its default, so registration
refuses it. Each option's default, bound and help is declared once with `Registry.option`, which gives the
config field (`dataclasses.field` with its help) and the check of its value (`check_options`).

So a new estimator, loss, divergence or aggregation is one function and its registration in one file, plus
`option(...)` lines for options no entry had before (and the config field that line gives).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable


def keyword_options(fn: Callable, what: str, positional: tuple[str, ...]) -> tuple[str, ...]:
    """The names of `fn`'s keyword-only parameters. `positional` names the inputs `fn` takes first
    (e.g. ("inp",)); any other parameter that is not keyword-only is a TypeError naming `what`."""
    params = list(inspect.signature(fn).parameters.values())
    head, rest = params[:len(positional)], params[len(positional):]
    if (len(head) < len(positional) or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in head)
            or any(p.kind is not p.KEYWORD_ONLY for p in rest)):
        raise TypeError(f"{what}: its signature {inspect.signature(fn)} does not fit `{fn.__name__}("
                        f"{', '.join(positional)}, *, option=default, ...)`: options must be keyword-only (after "
                        "`*`), as each is read from the config field of the same name")
    return tuple(p.name for p in rest)


@dataclasses.dataclass(frozen=True)
class Option:
    """An option of registered functions: its default, the closed interval [low, high] its value must lie in
    (None: unbounded on that side; a None value is not checked), what it does, and what it is in a word or
    two for the error message (`what`, optional)."""

    default: Any
    help: str
    bound: tuple[float | None, float | None] = (None, None)
    what: str = ""

    def check(self, name: str, value) -> None:
        low, high = self.bound
        if value is None or (low is None and high is None):
            return
        if (low is not None and not value >= low) or (high is not None and not value <= high):  # NaN fails too
            want = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
            raise ValueError(f"{name}{f' ({self.what})' if self.what else ''} must be {want}, got {value}")

    def field(self) -> dataclasses.Field:
        """The config field of this option: its default and its help."""
        return dataclasses.field(default=self.default, metadata={"help": self.help})


class Registry(dict):
    """name -> entry, for one kind of function (`what`, e.g. "policy loss"; errors name it).

    entry: the class an entry is made of, `entry(fn, **facts)` (plus `options=` with `positional`), or None for a
    table of plain functions. positional: the inputs each function takes first; given, the function's keyword-only
    parameters are its options (`keyword_options`). `entries` fills a table of plain functions at once.
    """

    def __init__(self, what: str, entry: type | None = None, positional: tuple[str, ...] | None = None,
                 entries: dict[str, Any] | None = None):
        super().__init__()
        self.what, self.entry, self.positional = what, entry, positional
        self.options: dict[str, Option] = {}  # option name -> its default, bound and help
        for name, fn in (entries or {}).items():
            self.add(name, fn)

    def copy(self) -> Registry:
        """A registry of the same kind with the same entries and options (a test's scratch copy)."""
        out = Registry(self.what, self.entry, self.positional)
        out.update(self)
        out.options.update(self.options)
        return out

    def register(self, name: str, **facts) -> Callable[[Callable], Callable]:
        """Decorator: `add(name, fn, **facts)`, returning `fn`."""
        def decorate(fn: Callable) -> Callable:
            self.add(name, fn, **facts)
            return fn

        return decorate

    def add(self, name: str, fn: Callable, **facts) -> None:
        if name in self:
            raise ValueError(f"{self.what} {name!r} is already registered")
        if self.entry is None:
            if facts:
                raise TypeError(f"{self.what} {name!r}: this registry keeps plain functions, no facts ({sorted(facts)})")
            self[name] = fn
            return
        if self.positional is not None:
            facts["options"] = keyword_options(fn, f"{self.what} {name!r}", self.positional)
        self[name] = self.entry(fn, **facts)

    def option(self, name: str, default, help: str, bound: tuple[float | None, float | None] = (None, None),
               what: str = "") -> Option:
        """Declare option `name`: a keyword-only parameter of registered functions, read from the config field of
        that name, which `field(name)` gives."""
        self.options[name] = Option(default, help, bound, what)
        return self.options[name]

    def field(self, name: str) -> dataclasses.Field:
        """The config field of option `name`: `vespo_k_pos: float = POLICY_LOSSES.field("vespo_k_pos")`."""
        return self.options[name].field()

    def check_options(self, config) -> None:
        """ValueError for any declared option whose config value is out of its bound."""
        for name, option in self.options.items():
            if hasattr(config, name):
                option.check(name, getattr(config, name))

    def choose(self, name: str, field: str | None = None):
        """The entry `name`, or a ValueError that lists the registered names (`field`: the config field named)."""
        if name not in self:
            where = f"{field}={name!r} is unknown" if field else f"unknown {self.what} {name!r}"
            raise ValueError(f"{where}; choose one of {sorted(self)}")
        return self[name]
