"""Activation offloading (SFTConfig.activation_offloading, as TRL offers it): the tensors autograd saves for
the backward pass are moved to CPU memory during the forward pass and brought back when the backward pass
needs them, trading transfer time for accelerator memory.

Built on torch's saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`): `pack` runs when
autograd saves a tensor, `unpack` when backward reads it. Parameters and small tensors stay where they
are (moving a weight saves nothing: the model keeps it anyway). On an accelerator the copy goes to
pinned CPU memory without blocking; the copy back is queued on the same stream, so the kernels that
use it run after it. A model on the CPU has its activations in CPU memory already: nothing moves.

Departure from TRL: TRL's version also overlaps the copies with compute on a second CUDA stream;
this one uses the current stream only.
"""

from __future__ import annotations

import torch

__all__ = ["OffloadActivations"]


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: inside it, saved activations of at least `min_bytes` bytes on a device other than the
    CPU are kept in CPU memory until backward. `offloaded` counts the tensors moved. offload_cpu=True treats
    CPU tensors like device ones (a real round trip through a copy; for testing the hooks on a CPU machine)."""

    def __init__(self, min_bytes: int = 1024, offload_cpu: bool = False):
        self.min_bytes, self.offload_cpu, self.offloaded = min_bytes, offload_cpu, 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        on_cpu = tensor.device.type == "cpu"
        if isinstance(tensor, torch.nn.Parameter) or (on_cpu and not self.offload_cpu) \
                or tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        pinned = not on_cpu and torch.cuda.is_available()
        copy = torch.empty_like(tensor, device="cpu", pin_memory=pinned)  # same strides: same backward kernels
        copy.copy_(tensor, non_blocking=pinned)
        self.offloaded += 1
        return tensor.device, copy

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, tuple):
            device, copy = packed
            return copy.to(device, non_blocking=True)
        return packed
