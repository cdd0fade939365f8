"""Process reward models (Uesato et al. 2022, "Solving math word problems with process- and outcome-based
feedback"; Lightman et al. 2023, "Let's Verify Step by Step"): a token classifier that labels each
reasoning step, read at the step's last token (the step separator), correct (1) or not (0).

* `step_loss`: cross-entropy of the 2-way step logits at the labelled tokens (label -100 elsewhere),
  a mean over the labelled tokens of the batch.
* `step_accuracy`: how many labelled steps the argmax gets right, and how many there are.
* `STEP_AGGREGATIONS`: how a completion's step probabilities P(correct) become one reward when a
  process reward model scores an online trainer's completions (min: as good as the worst step, the
  usual choice of Lightman et al.; prod: every step correct; last; mean).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE = -100  # label of a token that is not the end of a step


def step_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over the labelled tokens, a scalar (0 with a zero gradient when none is labelled).
    logits: (B, T, C); labels: (B, T) class ids, IGNORE where no step ends."""
    labelled = labels != IGNORE
    if not labelled.any():
        return logits.sum() * 0.0
    picked = logits[labelled]
    return F.cross_entropy(picked.to(torch.promote_types(picked.dtype, torch.float32)), labels[labelled])


@torch.no_grad()
def step_accuracy(logits: Tensor, labels: Tensor) -> tuple[int, int]:
    """(labelled steps the argmax classifies right, labelled steps). logits: (B, T, C); labels: (B, T)."""
    labelled = labels != IGNORE
    return int((logits.argmax(-1)[labelled] == labels[labelled]).sum()), int(labelled.sum())


STEP_AGGREGATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "min": lambda p: p.min(),
    "prod": lambda p: p.prod(),
    "last": lambda p: p[-1],
    "mean": lambda p: p.mean(),
}
