"""The lean one-token decoding step for Llama-style causal LMs (LlamaForCausalLM, Qwen2ForCausalLM), which
the sampler's CPU backend (`rollout.cpu_backend.CPUDecoder`) steps through.

On CPU in float32, a one-token step of a few rows is bound by streaming the weights from memory,
and PyTorch's GEMM does that poorly for a few rows (it repacks each weight on every call); and
transformers' forward serves every use (training, masks of any shape, hooks, caches of any kind),
so for such a step its generality (module calls, mask building, per-layer rotary tables, attention
dispatch) costs about as much as the arithmetic. `CPUDecoder` therefore prefills through the
model's forward, then decodes through `LeanDecoder.step` where the architecture allows, else through
the model's forward with every `nn.Linear` on the few-rows kernel (`few_rows.few_rows_linears`), or,
where the kernels cannot be built, with the output layer computed as (W x^T)^T (`transposed_head`).
The KV cache gets room for the whole completion up front (`rollout.backends.make_room`), so a step writes
its keys and values in place instead of copying the cache. Timings: benchmarks/README.md ("Where
time goes in the sampler").

`LeanDecoder.step` computes the model's function as one call of the compiled `lean_decode_step`
(`decode_kernels.c`, one OpenMP team for the whole step): RMSNorm, q, k and v from one product with
the three weights stacked (once per `generate` call), rotary from tables computed once per
`generate`, keys and values written into the room-made cache, grouped-query attention (AVX2: eight
positions' scores at a time, its own vectorised exp), the SiLU MLP and the output layer, every
product streaming its weight once (as `few_rows.few_rows_linear`). Where the C step cannot run (more
than `few_rows.MAX_ROWS` rows, no compiler or POSTTRAIN_NO_KERNELS=1, a head size that is not a
multiple of 8) the same step runs as about 20 PyTorch ops per layer, still cheaper than the model's
forward. Same values as the model's own forward up to float rounding (tested token for token
against it). Given a `record` buffer, a step also writes every layer's linear outputs into it (q, k,
v before the rotary embedding, o, gate and up before the SiLU, down), for the training forward to
replay (`accel/replay.py`).

`lean_decoder(model)` returns None (and `CPUDecoder` steps through the model's forward) for any other
architecture or configuration: another activation, sliding-window layers, modules with hooks or
adapters (PEFT), non-float32 or non-CPU weights, sharded weights (FSDP, ZeRO-3: the step reads
weights outside any forward, where they are never whole).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import torch
from torch import Tensor

from posttrain.accel import few_rows, products
from posttrain.accel.few_rows import few_rows_linear

SUPPORTED = {"LlamaForCausalLM": "LlamaModel", "Qwen2ForCausalLM": "Qwen2Model"}
_WEIGHTS = ("norm1", "qkv", "qkv_bias", "o", "o_bias", "norm2", "gate", "gate_bias", "up", "up_bias", "down",
            "down_bias")


class _CLayer(ctypes.Structure):  # LeanLayer in decode_kernels.c
    _fields_ = [(name, ctypes.c_void_p) for name in _WEIGHTS + ("keys", "values")]


class _CModel(ctypes.Structure):  # LeanModel in decode_kernels.c
    _fields_ = ([(name, ctypes.c_int) for name in ("A", "D", "Hq", "Hk", "hd", "I", "V", "L", "cap")]
                + [("eps", ctypes.c_float), ("scaling", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in ("embed", "final_norm", "head", "head_bias")])


@functools.cache
def _c_step_function():
    lib = few_rows.kernels()
    if lib is None:
        return None
    fn = lib.lean_decode_step
    fn.argtypes = [ctypes.POINTER(_CModel), ctypes.POINTER(_CLayer), ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    fn.restype = None
    return fn


def _hooked(m) -> bool:
    """Whether a forward hook must run; transformers' own output-capturing hooks do nothing unless a
    forward asks for hidden states or attentions (installed on first use), so they do not count."""
    hooks = [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]
    return any("output_captur" not in getattr(h, "__qualname__", "") for h in hooks)


def lean_decoder(model) -> LeanDecoder | None:
    """A LeanDecoder for `model` when its architecture is supported, else None."""
    inner = getattr(model, "model", None)
    if SUPPORTED.get(type(model).__name__) != type(inner).__name__:
        return None
    config = model.config
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "use_sliding_window", False):
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    linears = [model.lm_head] + [m for layer in layer_linears(model) for m in layer]
    if not all(products.is_linear(m) for m in linears):
        return None
    # the step reads weights outside any forward: sharded ones (FSDP, ZeRO-3) are never whole there
    if not all(few_rows.whole(p) for p in model.parameters()):
        return None
    if any(_hooked(m) for m in model.modules()):
        return None
    if type(inner.embed_tokens) is not torch.nn.Embedding:
        return None
    return LeanDecoder(model)


def layer_linears(model) -> list[list[torch.nn.Linear]]:
    """Per decoder layer of a supported model, its linear modules in the order of a step's record:
    q, k, v, o, gate, up, down."""
    return [[layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
             layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj] for layer in model.model.layers]


class LeanDecoder:
    def __init__(self, model):
        inner, config = model.model, model.config
        self.linears = layer_linears(model)
        self.record_width = sum(m.out_features for m in self.linears[0])  # F of a step's (L, A, F) record
        self.rotary = inner.rotary_emb
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = (inner.norm.weight.detach(), inner.norm.variance_epsilon)
        self.head = (model.lm_head.weight.detach(), _detach(model.lm_head.bias))
        attn0 = inner.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.q_heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = attn0.scaling
        self.layers = []
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv = [a.q_proj, a.k_proj, a.v_proj]
            biases = [p.bias for p in qkv]
            self.layers.append(dict(
                norm1=(layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon),
                qkv=torch.cat([p.weight.detach() for p in qkv]),  # one product instead of three
                qkv_bias=None if all(b is None for b in biases) else torch.cat(
                    [b.detach() if b is not None else p.weight.new_zeros(p.weight.shape[0])
                     for p, b in zip(qkv, biases)]),
                o=(a.o_proj.weight.detach(), _detach(a.o_proj.bias)),
                norm2=(layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon),
                gate=(mlp.gate_proj.weight.detach(), _detach(mlp.gate_proj.bias)),
                up=(mlp.up_proj.weight.detach(), _detach(mlp.up_proj.bias)),
                down=(mlp.down_proj.weight.detach(), _detach(mlp.down_proj.bias))))
        self.cos = self.sin = None
        self._c = None  # (function, model struct, layer structs, work buffer) while the C step is bound

    def set_positions(self, positions: Tensor):
        """Rotary tables for every step at once: positions (A, S) -> cos, sign-folded sin (A, S, head_dim)."""
        dummy = self.embed[:1, None]  # only its dtype and device are read
        cos, sin = self.rotary(dummy, positions)
        half = self.head_dim // 2
        self.cos, self.sin = cos, torch.cat([-sin[..., :half], sin[..., half:]], -1)

    def select(self, index: Tensor, cache):
        self.cos, self.sin = self.cos[index], self.sin[index]
        self.bind(cache)

    def bind(self, cache):
        """Point the compiled step at the cache's buffers (after each change of rows); no-op without it."""
        self._c = None
        fn = _c_step_function()
        eps = {self.final_norm[1]} | {layer[k][1] for layer in self.layers for k in ("norm1", "norm2")}
        buffers = [(layer.key_buffer, layer.value_buffer) for layer in cache.layers]
        A, cap = buffers[0][0].shape[0], buffers[0][0].shape[-2]
        if fn is None or len(eps) != 1 or self.head_dim > 256 or self.head_dim % 8 or A > few_rows.MAX_ROWS:
            return
        if self.embed.dim() != 2 or self.embed.shape[0] < self.head[0].shape[0]:  # a sampled id must have its row
            return
        cache_shape = (A, self.kv_heads, cap, self.head_dim)
        if not all(few_rows.whole(k, cache_shape) and few_rows.whole(v, cache_shape) for k, v in buffers):
            return
        tensors = [self.embed, self.final_norm[0], *self.head] + [
            w for layer in self.layers for w in (layer["norm1"][0], layer["qkv"], layer["qkv_bias"], *layer["o"],
                                                 layer["norm2"][0], *layer["gate"], *layer["up"], *layer["down"])]
        if not all(w is None or few_rows.whole(w, shape) for w, shape in zip(tensors, self._shapes())):
            return
        ptr = lambda w: None if w is None else w.data_ptr()  # noqa: E731
        layers = (_CLayer * len(self.layers))()
        for c, layer, (keys, values) in zip(layers, self.layers, buffers):
            c.norm1, c.norm2 = ptr(layer["norm1"][0]), ptr(layer["norm2"][0])
            c.qkv, c.qkv_bias = ptr(layer["qkv"]), ptr(layer["qkv_bias"])
            for name in ("o", "gate", "up", "down"):
                setattr(c, name, ptr(layer[name][0]))
                setattr(c, name + "_bias", ptr(layer[name][1]))
            c.keys, c.values = ptr(keys), ptr(values)
        D, I = self.embed.shape[1], self.layers[0]["gate"][0].shape[0]
        Hq, Hk, hd = self.q_heads, self.kv_heads, self.head_dim
        model = _CModel(A=A, D=D, Hq=Hq, Hk=Hk, hd=hd, I=I, V=self.head[0].shape[0], L=len(self.layers), cap=cap,
                        eps=eps.pop(), scaling=self.scaling, embed=ptr(self.embed), final_norm=ptr(self.final_norm[0]),
                        head=ptr(self.head[0]), head_bias=ptr(self.head[1]))
        work = torch.empty(A * (3 * D + (Hq + 2 * Hk) * hd + Hq * hd + 2 * I) + A * Hq * cap)
        self._c = (fn, model, layers, work)

    def _shapes(self) -> list[tuple[int, ...]]:
        """The shape `lean_decode_step` reads behind each pointer of `bind`'s tensor list (same order)."""
        D, V = self.embed.shape[1], self.head[0].shape[0]
        I, Hq, Hk, hd = self.layers[0]["gate"][0].shape[0], self.q_heads, self.kv_heads, self.head_dim
        qkv = (Hq + 2 * Hk) * hd
        per_layer = [(D,), (qkv, D), (qkv,), (D, Hq * hd), (D,), (D,), (I, D), (I,), (I, D), (I,), (D, I), (D,)]
        return [tuple(self.embed.shape), (D,), (V, D), (V,)] + per_layer * len(self.layers)

    @staticmethod
    def _rms_norm(x: Tensor, weight_eps) -> Tensor:  # the ops of LlamaRMSNorm in float32
        weight, eps = weight_eps
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # x cos + rotate_half(x) sin, with rotate_half(x) sin = roll(x, half) * [-sin_1, sin_2]
        return x * cos + x.roll(self.head_dim // 2, -1) * sin

    def step(self, tokens: Tensor, t: int, attention: Tensor, cache, record: Tensor | None = None) -> Tensor:
        """Feed one token per row at step t (rows in the cache's order); returns the next-token logits (A, V).

        attention: (A, T) 1 on the cache positions each row may see, T = cache length after this token.
        record: None, or a contiguous float32 (L, A, record_width) buffer that receives every layer's linear
        outputs for these rows, as the modules of `layer_linears` would return them, side by side."""
        mask = torch.zeros(attention.shape, dtype=self.embed.dtype).masked_fill_(attention == 0, float("-inf"))
        if record is not None and not (record.is_contiguous() and record.dtype == torch.float32 and record.shape == (
                len(self.layers), tokens.shape[0], self.record_width)):
            raise ValueError(f"record must be a contiguous float32 tensor of shape "
                             f"{(len(self.layers), tokens.shape[0], self.record_width)}")
        if self._c is not None:
            fn, model, layers, work = self._c
            A, T = attention.shape
            tokens, cos, sin = tokens.contiguous(), self.cos[:, t].contiguous(), self.sin[:, t].contiguous()
            logits = torch.empty(A, model.V)
            fn(ctypes.byref(model), layers, tokens.data_ptr(), T, cos.data_ptr(), sin.data_ptr(), mask.data_ptr(),
               logits.data_ptr(), work.data_ptr(), None if record is None else record.data_ptr(),
               torch.get_num_threads())
            for layer in cache.layers:  # the kernel wrote position T - 1 of every layer
                layer.advance(1)
            return logits
        A, hd = tokens.shape[0], self.head_dim
        Hq, Hk = self.q_heads, self.kv_heads
        cos, sin = self.cos[:, t, None], self.sin[:, t, None]  # (A, 1, hd): broadcast over heads
        mask = mask[:, None, None, :]  # (A, 1, 1, T) added to every head's scores
        h = torch.nn.functional.embedding(tokens, self.embed)  # (A, D)
        for i, (layer, kv) in enumerate(zip(self.layers, cache.layers)):
            x = self._rms_norm(h, layer["norm1"])
            qkv = few_rows_linear(x, layer["qkv"], layer["qkv_bias"])
            per_head = qkv.view(A, Hq + 2 * Hk, hd)
            qk = self._rope(per_head[:, : Hq + Hk], cos, sin)
            keys, values = kv.update(qk[:, Hq:, None], per_head[:, Hq + Hk:, None])  # (A, Hk, T, hd) each
            q = qk[:, :Hq].reshape(A, Hk, Hq // Hk, hd)  # the query heads that share each key head
            scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(self.scaling).add_(mask)
            heads = torch.matmul(scores.softmax(-1), values).reshape(A, Hq * hd)
            o = few_rows_linear(heads, *layer["o"])
            h = h + o
            x = self._rms_norm(h, layer["norm2"])
            gate, up = few_rows_linear(x, *layer["gate"]), few_rows_linear(x, *layer["up"])
            down = few_rows_linear(torch.nn.functional.silu(gate) * up, *layer["down"])
            h = h + down
            if record is not None:
                torch.cat([qkv, o, gate, up, down], 1, out=record[i])
        return few_rows_linear(self._rms_norm(h, self.final_norm), *self.head)


def _detach(t):
    return None if t is None else t.detach()


def _head_forward(head: torch.nn.Linear, x: Tensor) -> Tensor:
    weight, bias = head.weight, head.bias  # looked up per call: FSDP gathers the weight only within a forward
    if not few_rows.whole(weight, (weight.shape[0], x.shape[-1])):
        return products.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    out = products.mm(weight, flat.t()).t().contiguous()  # (W x^T)^T: MKL splits the vocabulary rows over threads
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def transposed_head(model):
    """Within the block, a CPU float32 `nn.Linear` output layer computes (W x^T)^T instead of x W^T.
    For the few rows of a decoding step over a large vocabulary this streams the weight faster (within
    a transformer layer's small matrices x W^T stays the faster order; figures in benchmarks/README.md).
    Same values up to float rounding. No-grad decoding only; any other head is left alone."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not (products.is_linear(head) and head.weight.device.type == "cpu" and head.weight.dtype == torch.float32
            and "forward" not in head.__dict__ and not torch.is_autocast_enabled("cpu")):
        yield False
        return
    try:
        head.forward = functools.partial(_head_forward, head)
        yield True
    finally:
        head.__dict__.pop("forward", None)
