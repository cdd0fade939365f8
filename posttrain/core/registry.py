"""What the registries of core/ share: reading a registered function's options off its signature.

An advantage estimator or a policy loss takes its tensors positionally and its options as
keyword-only parameters; the online engine passes each option from the config field of the
same name. A parameter that is neither would never be set from the config and silently keep
its default, so registration refuses it.
"""

from __future__ import annotations

import inspect
from typing import Callable


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
