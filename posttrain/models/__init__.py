"""Model loading, tiny built-in models and value heads. The classic value-head classes are importable from
here, as classic TRL code imports them from `trl.models` (lazily: importing posttrain.models stays light)."""

_VALUE_HEAD = ("AutoModelForCausalLMWithValueHead", "AutoModelForSeq2SeqLMWithValueHead")


def __getattr__(name: str):
    if name in _VALUE_HEAD:
        from posttrain.models import value_head

        return getattr(value_head, name)
    raise AttributeError(f"module 'posttrain.models' has no attribute {name!r}")
