"""A module's deep copy and its torch.save / torch.load round trip, for tests that a patched module survives both."""

from __future__ import annotations

import copy
import io

import torch


def copied_and_reloaded(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(copy.deepcopy(module), torch.load(torch.save(module)))."""
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return copy.deepcopy(module), torch.load(buffer, weights_only=False)
