"""What flows between the online engine's phases: `Experience`, the rows of one generation batch (and each of
its micro-batches), every tensor field with its shape.

build_experience fills one `Experience` for the whole generation batch (N rows); `select` and `trimmed` cut
it into the micro-batches that `compute_loss` receives. It holds only what the loss needs: the sampler's record of
linear outputs (`accel/replay.py`) is kept by the CPU sampler backend (`rollout.cpu_backend.keep_record`), which
a micro-batch's `rollout_row` indexes.

Departures: a trainer's `compute_loss` reads a micro-batch as a mapping too (`mb["advantages"]`,
`"ref_logp" in mb`, `mb.get(...)`): a field that is None is absent, and a preset's own per-row tensors
(distillation's, ...) live in `extra` under their names. It is deliberately not a `collections.abc.Mapping`:
transformers' `_prepare_inputs` would rebuild a Mapping as `type(data)(dict)`; the tensors are on the
training device already when the engine builds them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor

# the fields that are not per-row tensors (kept as they are by `select` and `trimmed`)
_SCALARS = ("denominator", "token_denominator", "old_is_current")


@dataclass
class Experience:
    """B rows (prompt-major, `num_generations` completions per prompt) of sampled completions and everything the
    loss needs of them. Optional fields are None where the configuration does not use them."""

    prompt_ids: Tensor                      # (B, P) long, left-padded prompts
    prompt_mask: Tensor                     # (B, P) 1 on prompt tokens
    completion_ids: Tensor                  # (B, C) long, right-padded completions
    completion_mask: Tensor                 # (B, C) 1 up to and including the stop token (attention)
    old_logp: Tensor | None = None          # (B, C) log pi_old(a_t|s_t), the behaviour policy's (the sampler's)
    loss_mask: Tensor | None = None         # (B, C) completion_mask, 0 on fed tool results and masked truncated rows
    advantages: Tensor | None = None        # (B, C) float32, 0 on padding
    returns: Tensor | None = None           # (B, C) value targets, only with a critic
    old_values: Tensor | None = None        # (B, C) the critic's values at sampling, only with a critic
    ref_logp: Tensor | None = None          # (B, C) log pi_ref, only with beta > 0 and the KL in the loss
    vllm_logp: Tensor | None = None         # (B, C) vLLM's log-probs of the sampled tokens (use_vllm)
    rollout_row: Tensor | None = None       # (B,) each row's index in its rollout (its row of the sampler's record)
    denominator: Tensor | None = None       # () this optimizer step's global loss-mode count / processes
    token_denominator: Tensor | None = None  # () this optimizer step's global token count / processes
    old_is_current: bool = False            # the policy has not moved since sampling: old_logp = logp.detach()
    extra: dict[str, Any] = field(default_factory=dict)  # a preset's own per-row tensors, by name

    # ------------------------------------------------------------------ the mapping view
    def _names(self) -> list[str]:
        names = [f.name for f in dataclasses.fields(self) if f.name != "extra"]
        return [n for n in names if getattr(self, n) is not None] + list(self.extra)

    def __getitem__(self, key: str):
        if key in self.extra:
            return self.extra[key]
        if key in self:
            return getattr(self, key)
        raise KeyError(key)

    def __setitem__(self, key: str, value) -> None:
        if key in _FIELDS and key != "extra":
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.extra or (key in _FIELDS and key != "extra" and getattr(self, key) is not None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def keys(self) -> list[str]:
        return self._names()

    def items(self) -> list[tuple[str, Any]]:
        return [(name, self[name]) for name in self._names()]

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def pop(self, key: str, default=None):
        if key not in self:
            return default
        value = self[key]
        if key in self.extra:
            del self.extra[key]
        else:
            setattr(self, key, None)
        return value

    # ------------------------------------------------------------------ building
    @classmethod
    def of(cls, batch) -> Experience:
        """An `Experience` from a dict of the same names (unknown names go to `extra`); an Experience as it is."""
        if isinstance(batch, Experience):
            return batch
        known = {k: v for k, v in batch.items() if k in _FIELDS and k != "extra"}
        return cls(**known, extra={k: v for k, v in batch.items() if k not in known})

    def _map_rows(self, fn) -> Experience:
        """A copy with `fn(name, tensor)` applied to each per-row tensor (not the scalars, not the record)."""
        changes = {f.name: fn(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                   if f.name not in _SCALARS and f.name != "extra" and getattr(self, f.name) is not None}
        extra = {k: fn(k, v) if isinstance(v, Tensor) else v for k, v in self.extra.items()}
        return dataclasses.replace(self, **changes, extra=extra)

    def select(self, rows: Tensor) -> Experience:
        """The rows `rows` (a (b,) index tensor) of every per-row tensor."""
        return self._map_rows(lambda _, v: v[rows])

    def trimmed(self, multiple: int | None = None) -> Experience:
        """Without prompt columns that are padding in every row (left) and completion columns past the longest
        completion (right), rounded up to a multiple of `multiple` (pad_to_multiple_of) where there are columns."""
        keep_p = self.prompt_mask.any(0).nonzero()
        start = int(keep_p[0]) if len(keep_p) else self.prompt_mask.shape[1] - 1
        width = max(int(self.completion_mask.sum(1).max()), 1)
        if multiple:
            width = min(-(-width // multiple) * multiple, self.completion_mask.shape[1])

        def cut(name: str, value: Tensor) -> Tensor:
            if name.startswith("prompt"):
                return value[:, start:]
            if name.startswith("teacher_prompt"):  # a teacher's own prompt (self-distillation): its own padding
                return value
            return value[:, :width] if value.dim() == 2 else value
        return self._map_rows(cut)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """Plain tensors and numbers (what `torch.load(weights_only=True)` reads back)."""
        out = {name: getattr(self, name) for name in _FIELDS if name != "extra"}
        return {k: v for k, v in out.items() if v is not None} | {"extra": dict(self.extra)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Experience:
        """The inverse of `state` (also reads the plain dicts that checkpoints held before this class, and drops
        `last_of_generation`, which they held before the replay record moved to the sampler backend)."""
        if "extra" not in state:
            return cls.of({k: v for k, v in state.items() if k != "last_of_generation"})
        return cls(**{k: v for k, v in state.items() if k not in ("extra", "last_of_generation")},
                   extra=dict(state["extra"]))

    @property
    def num_rows(self) -> int:
        return self.completion_ids.shape[0]

    def to(self, device: torch.device | str) -> Experience:
        return self._map_rows(lambda _, v: v.to(device))


_FIELDS = frozenset(f.name for f in dataclasses.fields(Experience))
