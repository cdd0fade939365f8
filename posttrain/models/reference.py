"""`create_reference_model` (TRL's name and signature): a frozen copy of a model to serve as the reference
policy, optionally sharing its first layers with the model to save memory.

Shared layers are the same Parameter objects in both models, frozen in both (a reference that moved
with training would be no reference), so only the layers after them are trained.
"""

from __future__ import annotations

import copy
import re

import torch

__all__ = ["LAYER_PATTERNS", "create_reference_model"]

# where decoder layers live in common architectures; "{layer}" is the layer index
LAYER_PATTERNS = ("transformer.h.{layer}", "model.decoder.layers.{layer}", "gpt_neox.layers.{layer}",
                  "model.layers.{layer}")


def _layer_prefix(names: list[str], pattern: str | None) -> str:
    for candidate in ([pattern] if pattern else LAYER_PATTERNS):
        if any(n.startswith(candidate.format(layer=0) + ".") or f".{candidate.format(layer=0)}." in f".{n}"
               for n in names):
            return candidate
    raise ValueError(f"no parameter name matches the layer pattern(s) {[pattern] if pattern else LAYER_PATTERNS}; "
                     f"pass pattern= (e.g. 'model.layers.{{layer}}') naming where the model's layers are")


def create_reference_model(model: torch.nn.Module, num_shared_layers: int | None = None,
                           pattern: str | None = None) -> torch.nn.Module:
    """A copy of `model` in eval mode with every parameter frozen.

    num_shared_layers: the first this many layers (and whatever comes before them, e.g. the embeddings) are
    not copied but shared with `model`, and frozen there too. pattern: where the layers are, as
    "prefix.{layer}" (default: the first of LAYER_PATTERNS that the model's parameter names use).
    """
    ref = copy.deepcopy(model)
    if num_shared_layers is not None:
        names = [n for n, _ in model.named_parameters()]
        prefix = _layer_prefix(names, pattern)
        layer_of = re.compile(r"(?:^|\.)" + re.escape(prefix).replace(r"\{layer\}", r"(\d+)") + r"\.")
        first_unshared = next((i for i, n in enumerate(names)
                               if (m := layer_of.search(n)) and int(m.group(1)) >= num_shared_layers), len(names))
        params = dict(model.named_parameters())
        for name in names[:first_unshared]:  # the same Parameter object in both models
            module_name, _, attr = name.rpartition(".")
            setattr(ref.get_submodule(module_name), attr, params[name])
            params[name].requires_grad_(False)
    for param in ref.parameters():
        param.requires_grad_(False)
    return ref.eval()
