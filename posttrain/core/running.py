"""Running statistics and reference-model syncing.

* `RunningMean`: a mean over every value seen so far, merged across processes (BCO's reward
  shift delta); its state is a plain dict so it can be saved with checkpoints.
* `mix_into_`: ref <- alpha * policy + (1 - alpha) * ref, the reference update of TR-DPO
  (Gorbatovski et al. 2024); alpha = 1 copies the policy.
"""

from __future__ import annotations

import torch


class RunningMean:
    def __init__(self):
        self.mean, self.count = 0.0, 0

    def update(self, values: torch.Tensor, accelerator=None) -> float:
        """Fold in a batch of values (gathered from every process when an accelerator is given)."""
        values = values.detach().float().reshape(-1)
        if accelerator is not None:
            values = accelerator.gather(values)
        n = values.numel()
        if n:
            total = self.count + n
            self.mean += (values.mean().item() - self.mean) * n / total
            self.count = total
        return self.mean

    def state_dict(self) -> dict:
        return {"mean": self.mean, "count": self.count}

    def load_state_dict(self, state: dict):
        self.mean, self.count = float(state["mean"]), int(state["count"])


@torch.no_grad()
def mix_into_(ref_model, model, alpha: float):
    """In place: every reference parameter becomes alpha * policy + (1 - alpha) * reference."""
    policy = dict(model.named_parameters())
    for name, ref_param in ref_model.named_parameters():
        source = policy.get(name)
        if source is None:  # wrapped models prefix their names ("module.", "base_model.model.")
            source = next((p for n, p in policy.items() if n.endswith("." + name) or name.endswith("." + n)), None)
        if source is None:
            raise KeyError(f"reference parameter {name!r} has no counterpart in the policy")
        ref_param.mul_(1 - alpha).add_(source.detach().to(ref_param.dtype), alpha=alpha)
