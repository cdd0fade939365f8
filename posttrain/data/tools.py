"""Tools as data: the JSON schemas a chat template lists (`tool_schemas`) and the tools of an environment
instance (`environment_tools`, TRL's `environment_factory` protocol). Running the calls is
`rollout.tools`; the built-in environments are `tasks.environments`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

_PROTOCOL = ("reset", "get_reward")  # public methods that are not tools


def environment_tools(env) -> list:
    """The tools of an environment instance: its public methods other than `reset` and `get_reward`,
    bound, in definition order (so the schemas and the prompt are the same on every run)."""
    names = [n for klass in reversed(type(env).__mro__) if klass is not object for n in vars(klass)]
    seen = dict.fromkeys(n for n in names if not n.startswith("_") and n not in _PROTOCOL)
    return [getattr(env, n) for n in seen if callable(getattr(env, n, None))]


def tool_schemas(tools: Sequence[Callable | Mapping]) -> list[dict]:
    """The JSON schema of each tool, in order: functions (sync or async, bound methods too) through
    `transformers.utils.get_json_schema`, which needs type hints and a docstring describing every
    argument; schemas (dicts) pass through unchanged."""
    from transformers.utils import get_json_schema

    return [dict(t) if isinstance(t, Mapping) else get_json_schema(t) for t in tools]
