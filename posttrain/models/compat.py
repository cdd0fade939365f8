"""The transformers APIs that changed within the range pyproject allows (transformers>=5.0,<6), one place.

* The KV cache: transformers 5.x renamed the models' `past_key_values` argument and output field to
  `cache` (the old names warn "will be removed in 5.40.0"); earlier 5.x releases know only
  `past_key_values`. `cache_kwargs` and `output_cache` use whichever name the model's forward takes.
* Activation checkpointing: `PreTrainedModel.is_gradient_checkpointing` and `gradient_checkpointing_enable`
  became `is_activation_checkpointing` and `activation_checkpointing_enable` (the old names warn, to be
  removed in v6).
* Checkpoint rotation: later 5.x releases have a function `trainer_utils.rotate_checkpoints`; 5.0 has the
  Trainer method `_rotate_checkpoints` only. `rotate_checkpoints` calls whichever exists.
* `logits_to_keep` as a boolean mask over (batch, positions): later 5.x models slice with
  `modeling_utils.slice_logits_to_keep`, which takes one; 5.0's index the positions only (an int or a 1-D
  index). `logits_to_keep_takes_mask` says which.

README.md ("Two commands on a fresh machine") gives the command that runs the tests against the oldest
and the newest transformers in range.
"""

from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=64)
def _cache_name(forward_owner: type) -> str:
    try:
        params = inspect.signature(forward_owner.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def cache_name(model) -> str:
    """The name under which `model`'s forward takes its KV cache: "cache" (newer transformers) or
    "past_key_values" (transformers 5.0 to the rename, and remote-code models written for it)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper passes **kwargs on
    return _cache_name(type(base))


def cache_kwargs(model, cache) -> dict:
    """{name: cache} to pass to `model(...)` (see cache_name)."""
    return {cache_name(model): cache}


def output_cache(model, output):
    """The KV cache a forward of `model` returned, under its field's name."""
    return getattr(output, cache_name(model))


def activation_checkpointing(model) -> bool:
    """Whether activation (gradient) checkpointing is on for `model`, without the deprecated property."""
    if isinstance(getattr(type(model), "is_activation_checkpointing", None), property):
        return model.is_activation_checkpointing
    if isinstance(getattr(type(model), "is_gradient_checkpointing", None), property):
        return model.is_gradient_checkpointing
    return any(getattr(m, "gradient_checkpointing", False) for m in getattr(model, "modules", lambda: [])())


def enable_activation_checkpointing(model, checkpoint_kwargs: dict | None = None, **kwargs):
    """Turn on activation checkpointing through the method the installed transformers supports. The arguments
    for torch.utils.checkpoint come as `checkpoint_kwargs` or under either API's name; `kwargs` (every_n_layers,
    offload) exist only in the newer API."""
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        checkpoint_kwargs = checkpoint_kwargs or kwargs.pop(name, None)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs, **kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def rotate_checkpoints(trainer, run_dir: str) -> None:
    """Delete `run_dir`'s older checkpoints beyond `save_total_limit`, keeping the newest and the best (by
    modification time: posttrain renames each checkpoint into place when it is whole)."""
    from transformers import trainer_utils

    if hasattr(trainer_utils, "rotate_checkpoints"):
        trainer_utils.rotate_checkpoints(run_dir, trainer.args.save_total_limit, trainer.state.best_model_checkpoint,
                                         use_mtime=True)
    else:  # transformers 5.0
        trainer._rotate_checkpoints(use_mtime=True, output_dir=run_dir)


def logits_to_keep_takes_mask() -> bool:
    """Whether the installed transformers' models take `logits_to_keep` as a (B, T) boolean mask."""
    from transformers import modeling_utils

    return hasattr(modeling_utils, "slice_logits_to_keep")
