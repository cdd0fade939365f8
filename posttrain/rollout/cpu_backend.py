"""The sampler's CPU backend, `CPUDecoder`: the sampler interface (`backends.ModelForward`) over the CPU
speed code in `posttrain.accel` (the lean decoding step, the few-rows kernels, the record of linear outputs
for replay). `generate.default_backend` picks it on CPU; nothing else in the sampler knows of `accel`.

The record a generation batch's sampling filled is kept here, by the backend, for that batch's training
forwards (`keep_record`, `replay_rows`, `holds_record`): the trainer and its `Experience` never hold it. It is
kept per policy module (weakly: it goes with the model), serves each rollout row once, and is let go layer by
layer by the forward that reads its last rows (`accel.replay.replaying(..., last=True)`).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import Tensor

from posttrain.accel import few_rows
from posttrain.accel.decode import LeanDecoder, lean_decoder, transposed_head
from posttrain.accel.few_rows import stable_sort_descending
from posttrain.accel.replay import LinearRecord, recording_prefill
from posttrain.rollout.backends import ModelForward, decodes_in_lockstep, roomy_layer_class


class CPUDecoder(ModelForward):
    """The sampler's backend on CPU: the prefill and the KV cache of `ModelForward`, then each step through
    the lean decoder where one is given and every cache layer could be given room, else through the model's
    forward with every linear layer on the few-rows kernel (without the kernels: the transposed head).

    lean: `lean_decoder(model)`, or None to step through the model's forward; always None under lock-step
    (the lean step calls no forward, so it cannot keep pace with processes whose forwards gather weights).
    record: a `LinearRecord` for the prefill and the lean steps to fill, or None; it is dropped with the
    lean step when that cannot run (`linear_outputs` is then None)."""

    def __init__(self, model, lean: LeanDecoder | None = None, record: LinearRecord | None = None):
        super().__init__(model)
        self.lean = lean
        self.linear_outputs = record if lean is not None else None
        self._patched = contextlib.ExitStack()  # the model's linear layers, while steps run through its forward

    def __exit__(self, *exc) -> None:
        self._patched.close()
        super().__exit__(*exc)

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, positions: Tensor,
                vision: dict[str, Tensor] | None = None) -> Tensor:
        self._lengths, self._width = prompt_mask.sum(1), prompt_mask.shape[1]
        recording = contextlib.nullcontext() if self.linear_outputs is None else recording_prefill(self.linear_outputs)
        with recording:
            return super().prefill(prompt_ids, prompt_mask, positions, vision)

    def expand(self, group: int, capacity: int) -> None:
        super().expand(group, capacity)
        self._bind(self._lengths.repeat_interleave(group)[:, None], capacity)

    def expand_rows(self, source: Tensor, capacity: int) -> None:
        super().expand_rows(source, capacity)
        self._bind(self._lengths[source.to(self._lengths.device)][:, None], capacity)

    def _bind(self, first: Tensor, capacity: int) -> None:
        """After phase 2: the lean step bound to the expanded cache, the rows' first new positions first (N, 1); or,
        where it cannot run, the model's forward with the few-rows kernels."""
        layers = getattr(self.cache, "layers", None)
        # the lean step is float32 throughout: a cache the prefill filled in bfloat16 (bf16=True's autocast)
        # steps on through the model's own forward, autocast as the prefill was
        if self.lean is not None and isinstance(layers, list) and all(
                type(layer) is roomy_layer_class() and layer.key_buffer.dtype == torch.float32
                and layer.value_buffer.dtype == torch.float32 for layer in layers):
            self.lean.set_positions(first + torch.arange(capacity - self._width, device=self.device))
            self.lean.bind(self.cache)
            self._rows = torch.arange(len(first), device=self.device)  # rollout row of each decoded row (record)
            return
        self.lean = self.linear_outputs = None
        self._patched.enter_context(few_rows.few_rows_linears(self.net) if few_rows.available()
                                    else transposed_head(self.net))

    def step(self, tokens: Tensor, t: int, attention: Tensor, positions: Tensor,
             embeds: tuple[Tensor, Tensor] | None = None) -> Tensor:
        if self.lean is None:
            return super().step(tokens, t, attention, positions, embeds)
        if embeds is not None:  # the lean step serves text-only Llama/Qwen2-style models: never a tool image
            raise ValueError("the lean decoding step feeds token ids only, not a tool image's features")
        record = self.linear_outputs
        outputs = None if record is None else torch.empty(len(self.lean.linears), len(tokens), self.lean.record_width)
        logits = self.lean.step(tokens, t, attention, self.cache, record=outputs)
        if record is not None:
            record.keep_step(t, self._rows, outputs)
        return logits

    def select(self, keep: Tensor) -> None:
        super().select(keep)
        if self.lean is not None:
            self._rows = self._rows[keep]
            self.lean.select(keep, self.cache)


def cpu_backend(net, record: tuple[int, int, Tensor, int] | None = None) -> CPUDecoder:
    """`CPUDecoder` for the (unwrapped) model `net`, with the lean step where `lean_decoder` allows it and the
    processes need not decode in lock-step (the lean step calls no forward, so it cannot keep pace with
    processes whose forwards gather weights); record as `generate.default_backend` takes it."""
    lean = None if decodes_in_lockstep(net) else lean_decoder(net)
    if lean is None or record is None:
        return CPUDecoder(net, lean)
    B, P, source, T = record
    return CPUDecoder(net, lean, LinearRecord(lean.linears, B, P, len(source), T, source=source))


def sort_descending(logits: Tensor) -> tuple[Tensor, Tensor, bool]:
    """(values, indices, by_radix) of `logits` (..., V) sorted in descending order along the last dimension: the
    values `torch.sort(logits, dim=-1, descending=True)` gives. On CPU by the kernels' radix sort (by_radix True:
    `few_rows.stable_sort_descending`, equal values in the order of their indices, where torch's comparison sort
    may order them otherwise); elsewhere, or without the kernels, by torch.sort itself (by_radix False)."""
    got = stable_sort_descending(logits)
    if got is not None:
        return *got, True
    return *torch.sort(logits, dim=-1, descending=True), False



def top_p_filter(logits: Tensor, top_p: float) -> tuple[Tensor, Tensor] | None:
    """(filtered, undecided) by the kernels' top-p cut (`few_rows.top_p_filter`: the cut of a whole sort, from the
    largest logits alone; the rows it leaves undecided are for the caller to sort), or None without the kernels."""
    return few_rows.top_p_filter(logits, top_p)

# ------------------------------------------------------------------ the record kept for the training forwards
class _Kept:
    """A generation batch's record and how many of its rollout rows the training forwards have read."""

    def __init__(self, record: LinearRecord):
        self.record, self.read = record, 0


_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # policy module -> _Kept


def keep_record(model: torch.nn.Module, record: LinearRecord | None) -> None:
    """Keep `record` (a rollout's `linear_outputs`) for the training forwards of `model`, the policy that sampled
    it, in place of any record kept before; None lets the kept one go (a new generation batch, a restored one)."""
    if record is None:
        _KEPT.pop(model, None)
    else:
        _KEPT[model] = _Kept(record)


def replay_rows(model: torch.nn.Module, rows: Tensor) -> tuple[LinearRecord, Tensor, bool] | None:
    """`completion_logprobs`'s `replay` argument for the rollout rows `rows` (R,) of `model`'s kept record, or None
    when none is kept. When these rows complete the record's (each row is read once), it is the last use: the
    forward lets the record go layer by layer and it is no longer kept here."""
    kept = _KEPT.get(model)
    if kept is None:
        return None
    kept.read += len(rows)
    last = kept.read >= kept.record.shape[2]  # N rollout rows
    if last:
        del _KEPT[model]
    return kept.record, rows, last


def holds_record(model: torch.nn.Module) -> bool:
    """Whether a record with outputs not yet let go is kept for `model`."""
    kept = _KEPT.get(model)
    return kept is not None and any(t is not None for t in kept.record.layers)
