"""The prompts' images on the online engine's path: from the processor's output to the model's forward.

A vision-language prompt comes with its processor outputs besides the token ids: `pixel_values` and what
goes with them (`image_sizes`, `image_grid_thw`, ...), one dict per prompt, whose tensors hold that prompt's
images (or image patches) along dim 0. Three places need them:

* the sampler's prefill (`rollout.generate`): the batch's prompts once each, their images concatenated in
  prompt order (`prompt_inputs`), so the vision tower encodes each prompt's images once per group, and the
  KV cache the group's samples decode from already holds the image tokens;
* the micro-batches of the online trainers: one row per completion, so each image tensor is kept per row
  (its prompt's images, then the images its tools returned, in the order the sampler fed them),
  padded along its image dim to the longest row and given a trailing dim of 1 (never 2-D, so never taken
  for completion columns when a micro-batch is trimmed), with each row's count (`row_inputs`); rows are
  indexed, shuffled and checkpointed like the other per-row tensors. `IMAGE_GROUP` numbers the prompt of each row:
  two prompts with the same text but different images have the same token ids, so it is what tells the
  training forward which rows share a prompt;
* the training forward (`forward.completions.completion_logprobs`): the images of the rows it computes, in
  their order (`forward_inputs`): once per distinct prompt where the completions of a group are packed into
  one sequence, once per row otherwise.

Departures from TRL: TRL repeats each prompt's pixels for every completion and runs the vision tower once
per completion, in generation and in every training forward; here it runs once per prompt in both.
"""

from __future__ import annotations

import torch
from torch import Tensor

PIXELS = "pixels."  # micro-batch keys of the per-row image tensors: PIXELS + name, and PIXELS + name + COUNT
COUNT = ".count"
IMAGE_GROUP = "image_group"  # (N,) the row's prompt, numbered within its generation batch


def prompt_inputs(per_prompt: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One forward's vision inputs for `per_prompt` (one dict per prompt, in the batch's order): each key's
    tensors concatenated along dim 0, the order in which the model fills its image placeholder tokens."""
    return _joined(per_prompt)


def row_inputs(per_prompt: list[dict[str, Tensor]], group: int, first_group: int = 0,
               tool_images: list[list[dict[str, Tensor]]] | None = None) -> dict[str, Tensor]:
    """The per-row tensors of `group` rows per prompt (prompt-major): for each key, (N, n_max, ..., 1) padded with
    zeros along the image dim and its counts (N,); and `IMAGE_GROUP` (N,): first_group + the prompt's index.

    tool_images: per row, the processor outputs of the images its tools returned, in the order fed; a row's
    images are then its prompt's followed by those. A row with tool images shares its prompt's computation with
    no other row (their completions hold different images): its `IMAGE_GROUP` is its own,
    first_group + len(per_prompt) + the row's index."""
    N = len(per_prompt) * group
    tool_images = tool_images or [[] for _ in range(N)]
    if not any(tool_images):  # each prompt's tensors once, repeated for its rows
        rows = {k: v.repeat_interleave(group, dim=0) for k, v in _padded(per_prompt).items()}
    else:
        rows = _padded([_joined([per_prompt[n // group], *tool_images[n]]) for n in range(N)])
    group_of = torch.arange(first_group, first_group + len(per_prompt)).repeat_interleave(group)
    own = torch.tensor([bool(t) for t in tool_images])
    rows[IMAGE_GROUP] = torch.where(own, first_group + len(per_prompt) + torch.arange(N), group_of)
    return rows


def _joined(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One row's images from several processor outputs (its prompt's, then each tool turn's): each key's
    tensors concatenated along the image dim, in order (`_cat`)."""
    return {name: _cat([p[name] for p in parts if name in p]) for name in _names(parts)}


def _cat(tensors: list[Tensor]) -> Tensor:
    """`tensors` concatenated along dim 0, each first padded with zeros at the end of every other dim to the
    largest size: where the processor batches images of several calls, e.g. Idefics3 / SmolVLM's pixel_values
    (1, crops, 3, H, W) per call, whose number of crops follows the image's size; their models drop all-zero
    padding images, as for the processor's own padding."""
    return torch.cat([_pad_to(t, _largest(tensors)) for t in tensors])


def _largest(tensors: list[Tensor]) -> tuple[int, ...]:
    """The largest size of each dim but the first over `tensors` (which have the same number of dims)."""
    return tuple(max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim()))


def _pad_to(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """`t` padded with zeros at the end of its dims 1.. to `shape` (itself when already that shape)."""
    if tuple(t.shape[1:]) == shape:
        return t
    out = t.new_zeros(len(t), *shape)
    out[(slice(None), *(slice(0, n) for n in t.shape[1:]))] = t
    return out


def _padded(per_row: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """For each key of the rows' image tensors: (R, n_max, ..., 1) padded with zeros along the image dim, and
    its counts (R,)."""
    rows: dict[str, Tensor] = {}
    for name in _names(per_row):
        parts = [p.get(name) for p in per_row]
        real = [t for t in parts if t is not None]
        longest, shape = max(len(t) for t in real), _largest(real)
        padded = torch.zeros(len(parts), longest, *shape, dtype=real[0].dtype)
        counts = torch.zeros(len(parts), dtype=torch.long)
        for i, t in enumerate(parts):
            if t is not None:
                padded[i, :len(t)], counts[i] = _pad_to(t, shape), len(t)
        rows[PIXELS + name], rows[PIXELS + name + COUNT] = padded[..., None], counts
    return rows


def has_images(batch: dict) -> bool:
    """Whether a micro-batch (or a Rollout's row tensors) carries prompt images."""
    return IMAGE_GROUP in batch


def row_part(batch: dict) -> dict[str, Tensor] | None:
    """The vision keys of a micro-batch (what `forward_inputs` reads), or None for a text batch."""
    if not has_images(batch):
        return None
    return {k: v for k, v in batch.items() if k == IMAGE_GROUP or k.startswith(PIXELS)}


def forward_inputs(rows: dict[str, Tensor], which: Tensor) -> dict[str, Tensor]:
    """The model's vision inputs for a forward over the rows `which` (indices into `rows`, in the forward's
    order): each key's real images of those rows, concatenated along dim 0; a key none of those rows has an
    image of is left out (rows without images have no image tokens)."""
    which = which.to(rows[IMAGE_GROUP].device)
    out = {}
    for key, padded in rows.items():
        if not key.startswith(PIXELS) or key.endswith(COUNT):
            continue
        counts = rows[key + COUNT][which]
        picked = padded[which]  # (R, n_max, ...)
        keep = torch.arange(picked.shape[1], device=picked.device)[None] < counts.to(picked.device)[:, None]
        if bool(keep.any()):
            out[key[len(PIXELS):]] = picked[keep][..., 0]
    return out


def _names(per_prompt: list[dict[str, Tensor]]) -> list[str]:
    names = []
    for p in per_prompt:
        names += [n for n in p if n not in names]
    return names
