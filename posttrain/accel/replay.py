"""The sampler's linear-layer outputs, reused by the training forward.

When the policy has not moved since it sampled a batch (one pass and one optimizer step per
generation batch: the case in which the trainer also takes the old-policy log-probs as the
detached current ones), the training forward over prompts and completions recomputes, position
by position, every product the sampler already computed: the prompt's in the prefill, each
completion token's in the decoding step that fed it back. The sampler can keep those outputs
(`generate(..., record_linears=True)`: a `LinearRecord`), and the training forward then takes each
linear layer's output from the record instead of multiplying (`replaying`). Everything else in the
forward still runs (norms, rotary embedding, attention, SiLU, residual sums, the output layer):
it is cheap, and autograd keeps what it needs from it. The backward is the ordinary one,
dx = dy W, dW = dy^T x, db = sum dy, with x the input that the training forward recomputed from the
recorded outputs. Values are the sampler's, which equal the forward's up to float rounding (the
decoding kernels sum in another order); the gradients agree to the same precision (tested).

The record holds layers x (sum of the recorded modules' widths) x 4 bytes per prompt and completion
position, one tensor per layer, until the generation batch's last micro-batch has run its forward. That
forward is the record's last use (`replaying(..., last=True)`): each layer's tensor goes as soon as the
forward has gathered that layer's outputs, so the record shrinks while the forward's activations grow,
and none of it sits beside the activations at their peak. What replay saves and costs is measured in
benchmarks/README.md ("Where time goes in the sampler").

The record is filled by the sampler's CPU backend (`cpu_backend.CPUDecoder`): the prefill's outputs through
forward hooks (`recording_prefill`), each decoding step's from the lean step's own buffer (`keep_step`).

Positions the sampler never fed (a completion's last token, where a layout has it, and the tokens
of rows that stopped and were dropped from the decoding batch) read a row of zeros. Nothing that
is scored depends on them: attention is causal, and their own logits are either not kept or
masked out of the loss.
"""

from __future__ import annotations

import contextlib
import functools
import torch
from torch import Tensor

from posttrain.accel import few_rows, products


class LinearRecord:
    """What the sampler's linear layers returned. modules[l][j] is layer l's j-th recorded module (the same
    kinds in every layer, e.g. q, k, v, o, gate, up, down). Each layer l has one tensor, layers[l]
    (positions, sum of widths): its rows are [prompt positions | completion positions | one row of zeros],
    its columns each kind's output side by side (the lean step's own record order). Its views:

    prompt(l, j):     (B, P, width_j) at each prompt position of the B prefilled (left-padded) prompts
    completion(l, j): (N, T, width_j) at completion position t of rollout row n (that token fed back at
                      step t); zeros where the token was never fed
    Rollout row n continues prefilled prompt source[n] (prompt-major groups: n // group; the sampler prefills
    each distinct prompt once, wherever its repeats sit in the batch). A training forward's outputs are one
    row gather from a layer's tensor (`layout`, `output`). A layer whose tensor was let go
    (`release`, after its last use) is None in `layers`.
    """

    def __init__(self, modules: list[list[torch.nn.Linear]], prompts: int, prompt_length: int, rows: int,
                 steps: int, group: int | None = None, source: Tensor | None = None):
        if (group is None) == (source is None):
            raise ValueError("LinearRecord takes group (prompt-major rows) or source (each row's prompt), one of them")
        # (N,) the prefilled prompt of each rollout row
        self.modules = modules
        self.source = torch.arange(prompts).repeat_interleave(group) if source is None else source.cpu()
        if len(self.source) != rows:
            raise ValueError(f"LinearRecord: {len(self.source)} rows' prompts for {rows} rows")
        self.shape = (prompts, prompt_length, rows, steps)  # B, P, N, T
        self.widths = [m.out_features for m in modules[0]]
        self.starts = [sum(self.widths[:j]) for j in range(len(self.widths))]  # each kind's first column
        positions = prompts * prompt_length + rows * steps + 1
        # filled by the sampler, not zeroed first (a pass over the whole record): the zero row now, and the
        # completion positions never fed (`fed`) at the first read of completions (`_settle`)
        self.layers: list[Tensor | None] = [torch.empty(positions, sum(self.widths)) for _ in modules]
        for layer in self.layers:
            layer[-1] = 0.0
        self.fed = torch.zeros(rows, steps, dtype=torch.bool)  # (N, T) completion positions keep_step wrote
        self._settled = False

    def _columns(self, layer: int, kind: int) -> Tensor:
        outputs = self.layers[layer]
        if outputs is None:
            raise RuntimeError(f"layer {layer} of the record was let go after its last use")
        return outputs[:, self.starts[kind]:self.starts[kind] + self.widths[kind]]

    def prompt(self, layer: int, kind: int) -> Tensor:
        B, P, _, _ = self.shape
        return self._columns(layer, kind)[:B * P].view(B, P, -1)

    def completion(self, layer: int, kind: int) -> Tensor:
        B, P, N, T = self.shape
        self._settle()
        return self._columns(layer, kind)[B * P:B * P + N * T].view(N, T, -1)

    def _settle(self) -> None:
        """Zeros at the completion positions the decoding steps never fed (`fed`), once, before the first read of
        completions (the prefill writes every prompt position)."""
        if self._settled:
            return
        B, P, N, T = self.shape
        unfed = B * P + (~self.fed).flatten().nonzero().flatten()
        for layer in self.layers:
            if layer is not None:
                layer.index_fill_(0, unfed, 0.0)
        self._settled = True

    def keep_step(self, step: int, rows: Tensor, outputs: Tensor):
        """Completion position `step` of rollout rows `rows` (A,), from a lean step's (L, A, sum of widths) record."""
        B, P, N, T = self.shape
        if len(rows) == N:  # no row dropped yet: rows is 0..N-1, a strided slice
            where = slice(B * P + step, B * P + N * T, T)
            self.fed[:, step] = True
        else:
            where = B * P + rows * T + step
            self.fed[rows, step] = True
        for layer, part in zip(self.layers, outputs):
            layer[where] = part

    @property
    def group(self) -> int | None:
        """The rows of each prefilled prompt when they are prompt-major groups (row n of prompt n // group), else
        None (the prompts' rows are elsewhere in the batch: `source`)."""
        B, _, N, _ = self.shape
        group = N // B
        return group if torch.equal(self.source, torch.arange(B).repeat_interleave(group)) else None

    @property
    def nbytes(self) -> int:
        """The bytes the record still holds."""
        return sum(t.nbytes for t in self.layers if t is not None)

    def release(self, layer: int) -> None:
        """Let layer `layer`'s outputs go (after their last use); reading them afterwards raises."""
        self.layers[layer] = None

    def layout(self, rows: Tensor, prompt_width: int, completion_width: int) -> Tensor:
        """Where each position of a training forward's sequences is in the record: (S, length) row indices.

        rows (S, blocks): the rollout row whose completion fills each block of each sequence, -1 for an
        empty block (zeros); each sequence's prompt is that of its first filled block (all blocks of a
        sequence share one prompt). The prompt part is the last `prompt_width` columns of the
        prefill (prompts are left-padded, a micro-batch drops all-padding columns on the left), the
        completion part the first `completion_width` positions."""
        B, P, N, T = self.shape
        if prompt_width > P or completion_width > T:
            raise ValueError(f"the record holds {P} prompt and {T} completion positions; asked for "
                             f"{prompt_width} and {completion_width}")
        if rows.numel() and not bool((rows >= 0).any(1).all()):
            raise ValueError(f"sequence {int((rows < 0).all(1).nonzero()[0])} has no filled block")
        S, blocks = rows.shape
        first = torch.where(rows >= 0, rows, N).min(1).values  # a filled block's row; its prompt is the sequence's
        prompt = (self.source[first] * P + P - prompt_width)[:, None] + torch.arange(prompt_width)  # (S, Pw)
        block = torch.where(rows[..., None] >= 0,  # (S, blocks, Cw); empty blocks read the zero row
                            B * P + rows[..., None] * T + torch.arange(completion_width), B * P + N * T)
        return torch.cat([prompt, block.reshape(S, -1)], 1)

    def output(self, kind: int, layer: int, layout: Tensor) -> Tensor:
        """Module `modules[layer][kind]`'s outputs for the sequences of `layout`: (S, length, width), one row
        gather made on demand (so only the outputs that autograd keeps stay alive, as in an ordinary forward)."""
        self._settle()
        return self._columns(layer, kind).index_select(0, layout.flatten()).view(*layout.shape, -1)


@contextlib.contextmanager
def recording_prefill(record: LinearRecord):
    """Within the block, each recorded module's forward writes its output into `record.prompt`: run the
    prefill of the record's B prompts (B, P) inside it. The hooks are removed on leaving."""
    hooks = []
    try:
        for layer, modules in enumerate(record.modules):
            for kind, module in enumerate(modules):
                hooks.append(module.register_forward_hook(functools.partial(_keep_output, record.prompt(layer, kind))))
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _keep_output(destination: Tensor, module, inputs, output):
    destination.copy_(output)


class _KnownLinear(torch.autograd.Function):
    """y = x W^T + b, with y given: the forward multiplies nothing, the backward is the linear layer's."""

    @staticmethod
    def forward(ctx, x, weight, bias, y):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        want_x, want_w, want_b = ctx.needs_input_grad[:3]
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = products.mm(flat, weight.to(grad.dtype)).view(*grad.shape[:-1], -1).to(x.dtype) if want_x else None
        grad_w = products.mm(flat.t(), x.reshape(-1, x.shape[-1]).to(flat.dtype)).to(weight.dtype) if want_w else None
        grad_b = flat.sum(0) if ctx.has_bias and want_b else None
        return grad_x, grad_w, grad_b, None


def _known_forward(record: LinearRecord, kind: int, layer: int, layout: Tensor, module: torch.nn.Linear,
                   left: list[int] | None, x: Tensor) -> Tensor:
    if x.shape[:-1] != layout.shape:
        raise RuntimeError(f"replayed linear layer got input {tuple(x.shape)}, but the record is laid out for "
                           f"{tuple(layout.shape)} positions: the forward does not match the record's layout")
    width, weight, bias = record.widths[kind], module.weight, module.bias
    if not (few_rows.whole(weight, (width, x.shape[-1])) and (bias is None or few_rows.whole(bias, (width,)))):
        # a sharded, non-contiguous or resized weight: its gradient would not be the plain product
        # _KnownLinear computes, so compute the layer as usual
        y = products.linear(x, weight, bias)
    else:
        y = _KnownLinear.apply(x, weight, bias, record.output(kind, layer, layout))
    if left is not None:  # the record's last use: the layer goes once all its modules have been read
        left[layer] -= 1
        if left[layer] == 0:
            record.release(layer)
    return y


@contextlib.contextmanager
def replaying(record: LinearRecord, layout: Tensor, last: bool = False):
    """Within the block, each recorded module returns its recorded outputs laid out as `layout` instead of
    computing; a forward must call each one once, on inputs of that layout.

    last: this forward is the record's last use; each layer's outputs are let go (`LinearRecord.release`)
    once all of that layer's modules have returned theirs, so the record is gone by the forward's end."""
    patched = []
    left = [len(modules) for modules in record.modules] if last else None  # per layer: modules yet to be read
    try:
        for layer, modules in enumerate(record.modules):
            for kind, module in enumerate(modules):
                if "forward" in module.__dict__:
                    raise RuntimeError(f"cannot replay {type(module).__name__}: its forward is already replaced")
                module.forward = functools.partial(_known_forward, record, kind, layer, layout, module, left)
                patched.append(module)
        yield
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)
