"""What computes next-token logits for the sampler: `SamplerBackend`, and the generic one, `ModelForward`.

`rollout.generate` owns everything about sampling: the prompt batch, the uniforms drawn from the
seed, filtering, stop tokens and strings, tool turns, which rows are still decoded, the output.
A backend owns the model's state (its KV cache, compiled-step bindings, patched layers) and
turns fed tokens into logits. The loop calls it in this order (docs/sampler.md):

    with backend:                                   set-up and tear-down (eval mode, patched layers)
        backend.prefill(prompt_ids, mask, positions)    1. once per prompt, whatever the group size
        backend.expand(group, capacity)                 2. each prompt's state becomes `group` rows
          or backend.expand_rows(source, capacity)         (row n continues prefilled prompt source[n])
        backend.step(tokens, t, attention, positions)   3. one token per decoded row -> next logits
        backend.select(keep)                            6. rows that finished leave the batch

Built in: `ModelForward` (here), the model's own forward over a transformers KV cache: the
generic path, the only one off the CPU; `cpu_backend.CPUDecoder`, the same on CPU with the few-rows
kernels, the lean compiled step and its optional record of linear outputs (`accel/replay.py`).
A third backend (an inference server, vLLM) subclasses `SamplerBackend`; the loop does not change.
"""

from __future__ import annotations

import abc
import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from posttrain.models import compat
from posttrain.models.modes import unwrap
from posttrain.models.vision import grid_positions
from posttrain.rollout.tools import ToolImageError

if TYPE_CHECKING:
    from posttrain.accel.replay import LinearRecord


class SamplerBackend(abc.ABC):
    """The interface `generate` decodes through. Rows are prompt-major: after `expand(group, ...)`, row n
    continues prompt n // group. Logits may be of any float dtype on `device`; the loop reads them in
    float32. One object serves one `generate` call (it holds that call's cache)."""

    device: torch.device = torch.device("cpu")  # where the loop keeps its ids, masks and the logits it reads
    lockstep: bool = False  # every process must call `step` as often as the others (sharded weights)
    input_vocab_size: int | None = None  # ids `step` can take (padding is written with one); None: any
    linear_outputs: LinearRecord | None = None  # what the backend recorded for `accel/replay.py`; read after the loop
    # `expand_rows` takes any row -> prompt map: `generate` then prefills each distinct prompt once, wherever its
    # repeats sit in the batch (else it prefills every prompt and expands prompt-major groups)
    gathers_rows: bool = False

    def __enter__(self) -> SamplerBackend:
        return self

    def __exit__(self, *exc) -> None:
        return None

    @abc.abstractmethod
    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, positions: Tensor) -> Tensor:
        """Phase 1. prompt_ids, prompt_mask, positions (B, P), left-padded (mask 1 on real tokens, positions
        count real tokens from 0) -> the logits (B, V) that follow each prompt's last token. A backend that
        takes images has a keyword `vision`: the prompts' images (`forward.vision.prompt_inputs`), given only
        for image prompts, so the vision tower runs once per prompt and the cache holds the image tokens."""

    @abc.abstractmethod
    def expand(self, group: int, capacity: int) -> None:
        """Phase 2. Repeat each prompt's state `group` times (prompt-major), with room for `capacity`
        positions per row (the prompt width P plus the most new tokens)."""

    def expand_rows(self, source: Tensor, capacity: int) -> None:
        """Phase 2 for a backend with `gathers_rows`: row n of the decoding batch continues prefilled prompt
        source[n] (N,) (its state copied), with room for `capacity` positions per row."""
        raise NotImplementedError(f"{type(self).__name__} expands prompt-major groups only (gathers_rows=False)")

    @abc.abstractmethod
    def step(self, tokens: Tensor, t: int, attention: Tensor, positions: Tensor) -> Tensor:
        """Phase 3. Feed one token per decoded row, in the rows' current order -> the next logits (A, V).

        tokens (A,): completion token t of each row (0 = the first new one), at cache position P + t.
        attention (A, P + t + 1): 1 on the positions each row may see (its prompt's real tokens, then all).
        positions (A, 1): the fed token's position id."""

    @abc.abstractmethod
    def select(self, keep: Tensor) -> None:
        """Phase 6. Keep only the decoded rows `keep` (A',) of the current A, in that order."""

    def image_embeddings(self, ids: list[int], vision: dict[str, Tensor]) -> list[Tensor | None]:
        """For a tool turn with images (a vision-language model): per id of `ids`, the input embedding to feed in
        its place (its image's feature, for an image token) or None. A backend that feeds images also takes
        `step(..., embeds=(which, values))`: the decoded rows `which` (A,) bool take `values` (k, H) as their
        input embedding instead of their token's."""
        raise ValueError(f"the sampler backend {type(self).__name__} cannot feed a tool's images to the model; "
                         "posttrain's own sampler does (a vision-language model, use_vllm=False)")


class ModelForward(SamplerBackend):
    """The model's own forward (`logits_to_keep=1`) over a transformers KV cache: any causal LM, any device,
    sharded weights included (each step is one forward, so lock-step processes stay in step)."""

    gathers_rows = True

    def __init__(self, model):
        self.net = unwrap(model)
        self.device = model_device(self.net)
        self.lockstep = decodes_in_lockstep(self.net)
        embeddings = self.net.get_input_embeddings() if hasattr(self.net, "get_input_embeddings") else None
        self.input_vocab_size = getattr(embeddings, "num_embeddings", None)
        self.cache = None

    def __enter__(self) -> ModelForward:
        self._modes = [m.training for m in self.net.modules()]  # restored one by one: a submodule may be kept in eval on purpose
        self.net.eval()
        return self

    def __exit__(self, *exc) -> None:
        for m, mode in zip(self.net.modules(), self._modes):
            m.training = mode

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, positions: Tensor,
                vision: dict[str, Tensor] | None = None) -> Tensor:
        out = self.net(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                       logits_to_keep=1, **{k: v.to(self.device) for k, v in (vision or {}).items()})
        self.cache = compat.output_cache(self.net, out)
        return out.logits[:, -1, :]

    def expand(self, group: int, capacity: int) -> None:
        self.cache = make_room(expand_cache(self.cache, group), capacity)

    def expand_rows(self, source: Tensor, capacity: int) -> None:
        self.cache = make_room(select_cache(self.cache, source.to(self.device)), capacity)

    def step(self, tokens: Tensor, t: int, attention: Tensor, positions: Tensor,
             embeds: tuple[Tensor, Tensor] | None = None) -> Tensor:
        if embeds is None:
            inputs = {"input_ids": tokens[:, None]}
        else:  # tool image tokens: their image features in place of the token embeddings, as the forward places them
            x = self.net.get_input_embeddings()(tokens[:, None])
            which, values = embeds
            x[which.to(x.device), 0] = values.to(x.device, x.dtype)
            inputs = {"inputs_embeds": x}
        out = self.net(**inputs, attention_mask=attention, position_ids=positions,
                       **compat.cache_kwargs(self.net, self.cache), use_cache=True, logits_to_keep=1)
        self.cache = compat.output_cache(self.net, out)
        return out.logits[:, -1, :]

    def image_embeddings(self, ids: list[int], vision: dict[str, Tensor]) -> list[Tensor | None]:
        return image_embeddings(self.net, ids, {k: v.to(self.device) for k, v in vision.items()})

    def select(self, keep: Tensor) -> None:
        self.cache = select_cache(self.cache, keep)


def image_token_id(net) -> int | None:
    """The id of a vision-language model's image placeholder token (its config's `image_token_id`, or the older
    `image_token_index`), or None for a model without one."""
    config = getattr(net, "config", None)
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def image_embeddings(net, ids: list[int], vision: dict[str, Tensor]) -> list[Tensor | None]:
    """`SamplerBackend.image_embeddings` through the model's `get_image_features` (the vision tower and projector
    its forward runs): the images' features, one per image token of `ids` in order (each image's features in
    its tokens' order, the images in the order of `vision`), None for the other ids. Raises ValueError when the
    model has no image features or their number differs from the image tokens'."""
    image_id, features = image_token_id(net), getattr(net, "get_image_features", None)
    if grid_positions(net):
        raise ToolImageError(
            f"a tool returned an image, which this sampler cannot feed to a {net.config.model_type!r} model "
            f"({type(net).__name__}): its multimodal rotary positions (mrope) lay each image's tokens out on the "
            "image's grid (image_grid_thw), while a tool turn is fed one position per token; return text from "
            "the tool, or use a model whose positions count tokens (LLaVA, Idefics3 / SmolVLM)")
    if image_id is None or not callable(features):
        raise ValueError(f"{type(net).__name__} has no image token or get_image_features: a tool turn with images "
                         "needs a vision-language model")
    out = features(**vision)
    feats = getattr(out, "pooler_output", out)  # transformers 5: the projected features; older: the tensor(s)
    if isinstance(feats, (list, tuple)):
        feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
    feats = feats.reshape(-1, feats.shape[-1])
    where = [k for k, x in enumerate(ids) if x == image_id]
    if len(where) != len(feats):
        raise ValueError(f"a tool turn has {len(where)} image tokens but its images have {len(feats)} features: the "
                         "processor's expansion of the image placeholders does not match the model")
    embeds: list[Tensor | None] = [None] * len(ids)
    for k, f in zip(where, feats):
        embeds[k] = f
    return embeds


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def decodes_in_lockstep(model) -> bool:
    """Whether the processes must decode in lock-step: under torch.distributed with sharded parameters
    (FSDP, FSDP2, ZeRO-3, tensor parallel), every forward is a collective that gathers weights from all
    processes, so each must run as many forwards as the others. Lock-step rather than gathering the whole
    policy for generation: the weights stay sharded (a model that needs sharding to train may not fit
    whole on one device), at the cost of one all-reduce of a flag per step and of the discarded forwards
    of a process whose rows have all stopped (`generate._keep_pace`)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())
            or any(type(p) not in (torch.Tensor, torch.nn.Parameter) or hasattr(p, "ds_id")
                   for p in model.parameters()))


def expand_cache(cache, repeats: int):
    """Repeat every layer's keys/values `repeats` times along the batch (prompt-major)."""
    if repeats == 1:
        return cache
    if hasattr(cache, "batch_repeat_interleave"):  # transformers Cache objects (DynamicCache, ...)
        cache.batch_repeat_interleave(repeats)
        return cache
    if isinstance(cache, (tuple, list)):  # legacy tuple-of-tuples caches of older remote-code models
        return type(cache)(tuple(t.repeat_interleave(repeats, dim=0) for t in layer) for layer in cache)
    raise TypeError(f"cannot expand a KV cache of type {type(cache).__name__} for num_generations > 1")


@functools.cache
def roomy_layer_class():
    from transformers.cache_utils import DynamicLayer

    class RoomyLayer(DynamicLayer):
        """A DynamicLayer whose keys and values live in buffers with room for `capacity` positions: a
        decoding step writes its new position in place instead of copying the whole cache (torch.cat)."""

        def __init__(self, keys: Tensor, values: Tensor, capacity: int):
            super().__init__()
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
            self.length = keys.shape[-2]
            self.key_buffer = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])
            self.value_buffer = values.new_empty(*values.shape[:-2], capacity, values.shape[-1])
            self.key_buffer[..., : self.length, :], self.value_buffer[..., : self.length, :] = keys, values
            self._views()

        def _views(self):
            self.keys, self.values = self.key_buffer[..., : self.length, :], self.value_buffer[..., : self.length, :]

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
            end = self.length + key_states.shape[-2]
            if end > self.key_buffer.shape[-2]:  # out of room: grow like a DynamicLayer
                self.key_buffer = torch.cat([self.keys, key_states], dim=-2)
                self.value_buffer = torch.cat([self.values, value_states], dim=-2)
            else:
                self.key_buffer[..., self.length: end, :] = key_states
                self.value_buffer[..., self.length: end, :] = value_states
            self.length = end
            self._views()
            return self.keys, self.values

        def advance(self, steps: int) -> None:  # positions written into the buffers by someone else
            self.length += steps
            self._views()

        def batch_select_indices(self, indices: Tensor) -> None:
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self._views()

        def batch_repeat_interleave(self, repeats: int) -> None:
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._views()

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)
            self.length = self.keys.shape[-2]
            self.key_buffer, self.value_buffer = self.keys, self.values

    return RoomyLayer


def make_room(cache, capacity: int):
    """Give each plain DynamicLayer of a transformers cache room for `capacity` positions (other
    layer types, e.g. sliding-window ones, and legacy tuple caches are left as they are)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return cache
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4:
            layers[i] = roomy_layer_class()(layer.keys, layer.values, capacity)
    return cache


def select_cache(cache, index: Tensor):
    """Keep only the batch rows `index` of the KV cache (rows that finished are dropped), or repeat them (an index
    may occur more than once: `ModelForward.expand_rows`)."""
    if hasattr(cache, "batch_select_indices"):
        cache.batch_select_indices(index)
        return cache
    return type(cache)(tuple(t[index] for t in layer) for layer in cache)


class GeometricMixture(SamplerBackend):
    """Decode from the geometric mixture of two models, π_mix ∝ π^(1-c) π_ref^c (Nash-MD's sampler): both
    backends decode the same rows, and each step's logits are (1 - c) log_softmax(policy) + c log_softmax(ref),
    a normalised log-distribution. `ref_context()` is entered around every call of the reference backend (a
    PEFT policy serves as its own reference with the adapter disabled)."""

    def __init__(self, policy: SamplerBackend, ref: SamplerBackend, mixture_coef: float, ref_context=None):
        if not 0.0 <= mixture_coef <= 1.0:
            raise ValueError(f"mixture_coef must be in [0, 1] (the reference's share of the mixture), got {mixture_coef}")
        import contextlib

        self.policy, self.ref, self.coef = policy, ref, float(mixture_coef)
        self.ref_context = ref_context or contextlib.nullcontext
        self.device, self.input_vocab_size = policy.device, policy.input_vocab_size
        self.lockstep = policy.lockstep or ref.lockstep
        self.gathers_rows = policy.gathers_rows and ref.gathers_rows

    def __enter__(self) -> GeometricMixture:
        self.policy.__enter__()
        self.ref.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.ref.__exit__(*exc)
        self.policy.__exit__(*exc)

    def _mix(self, policy_logits: Tensor, ref_call) -> Tensor:
        with self.ref_context():
            ref_logits = ref_call()
        return ((1.0 - self.coef) * torch.log_softmax(policy_logits.float(), -1)
                + self.coef * torch.log_softmax(ref_logits.float(), -1))

    def prefill(self, prompt_ids: Tensor, prompt_mask: Tensor, positions: Tensor, **vision) -> Tensor:
        return self._mix(self.policy.prefill(prompt_ids, prompt_mask, positions, **vision),
                         lambda: self.ref.prefill(prompt_ids, prompt_mask, positions, **vision))

    def expand(self, group: int, capacity: int) -> None:
        self.policy.expand(group, capacity)
        self.ref.expand(group, capacity)

    def expand_rows(self, source: Tensor, capacity: int) -> None:
        self.policy.expand_rows(source, capacity)
        self.ref.expand_rows(source, capacity)

    def step(self, tokens: Tensor, t: int, attention: Tensor, positions: Tensor) -> Tensor:
        return self._mix(self.policy.step(tokens, t, attention, positions),
                         lambda: self.ref.step(tokens, t, attention, positions))

    def select(self, keep: Tensor) -> None:
        self.policy.select(keep)
        self.ref.select(keep)
