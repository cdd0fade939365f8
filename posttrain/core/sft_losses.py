"""Per-token losses of supervised fine-tuning, from the target tokens' log-probs.

Each maps log π(y_t | y_<t) of the target tokens, shape (N,), to a loss per token, shape (N,); the
trainer sums them and divides by the global number of target tokens (a token mean that does not
depend on how a batch is split).

- ``nll``: cross-entropy, -log π.
- ``dft``: Dynamic Fine-Tuning (Wu et al. 2025, arXiv 2508.05629): the NLL scaled by the token's
  probability, detached, -sg(π) log π.
"""

from __future__ import annotations

from posttrain.core.registry import Registry

SFT_LOSSES = Registry("SFT loss", entries={  # fn(token log-probs) -> per-token loss
    "nll": lambda logps: -logps,
    "dft": lambda logps: -logps * logps.detach().exp(),
})
