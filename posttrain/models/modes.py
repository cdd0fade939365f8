"""A model's train/eval behaviour: evaluation mode for a block of code, dropout switched off for good, and the
module under a data-parallel wrapper."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """`model.eval()` inside the block; the model's own mode (train or eval) comes back after it, error or not."""
    training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(training)


def disable_dropout(model: torch.nn.Module) -> None:
    """p = 0 in every dropout layer of `model`: RL and preference losses compare log-probs of the same
    tokens from several forwards (sampler, reference, policy), which dropout would make disagree."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def unwrap(model):
    # DDP's forward may broadcast buffers (a collective): ranks that stop decoding at different
    # steps would hang, so sample with the wrapped module. PEFT and FSDP wrappers are kept.
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return model.module
    return model
