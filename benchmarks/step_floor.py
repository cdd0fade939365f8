"""A lower bound on one fp32 training step of SmolLM2-135M on this machine: its matrix products and its
optimizer update, each timed alone at its real shape.

    python benchmarks/step_floor.py --tokens 693 [--no-head] [--threads 2] [--peer-rate 81.5]

A training step over N tokens multiplies, in each of the 30 decoder layers, the tokens by the q, k, v, o,
gate, up and down weights (forward), and in the backward multiplies each output gradient by the weight
(input gradient) and by the input (weight gradient); the output layer does the same with the 49152 x 576
embedding (`--no-head` leaves it out: a reward model scores with a 576 x 1 head). Each product is timed
alone, best of `--repeats` and in the faster of PyTorch's two float32 matmul libraries (its sgemm,
oneDNN), with q/k/v and gate/up also timed as one product of the stacked weights and the faster
arrangement taken; AdamW's update of the 134.5 M parameters (the faster of torch's foreach and
fused implementations; both libraries default to the fused one) is timed the same way. Attention, norms, activations, the loss and the data
are left out, so the sum is a floor: no fp32 implementation that does these products and this update can
take less time per step, whatever its kernels. `--peer-rate` (tokens/s of the peer, e.g. TRL's steady
rate from `vs_trl.py` in the same session) prints the largest ratio against it that the floor allows.
"""

from __future__ import annotations

import argparse
import time

import torch

# SmolLM2-135M: hidden 576, MLP 1536, 30 layers, 9 query heads and 3 key/value heads of 64, vocabulary 49152
HIDDEN, MLP, LAYERS, KV, VOCAB = 576, 1536, 30, 192, 49152


def best_time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def product_time(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    """Seconds of a @ b.T: the faster of PyTorch's sgemm (torch.mm) and oneDNN's matmul (where the build has it)."""
    best = best_time(lambda: torch.mm(a, b.t()), repeats)
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        best = min(best, best_time(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""), repeats))
    return best


def linear_step(tokens: int, inputs: int, outputs: int, repeats: int) -> float:
    """Seconds of y = x W^T, dx = dy W and dW = dy^T x for `tokens` rows, each timed alone."""
    x, w, dy = torch.randn(tokens, inputs), torch.randn(outputs, inputs), torch.randn(tokens, outputs)
    forward = product_time(x, w, repeats)
    grad_input = product_time(dy, w.t(), repeats)
    grad_weight = product_time(dy.t(), x.t(), repeats)
    return forward + grad_input + grad_weight


def layer_seconds(tokens: int, repeats: int) -> dict[str, float]:
    """One decoder layer's products; q/k/v and gate/up in the faster of separate or stacked."""
    qkv = min(linear_step(tokens, HIDDEN, HIDDEN, repeats) + 2 * linear_step(tokens, HIDDEN, KV, repeats),
              linear_step(tokens, HIDDEN, HIDDEN + 2 * KV, repeats))
    gate_up = min(2 * linear_step(tokens, HIDDEN, MLP, repeats), linear_step(tokens, HIDDEN, 2 * MLP, repeats))
    return {"qkv": qkv, "o": linear_step(tokens, HIDDEN, HIDDEN, repeats), "gate_up": gate_up,
            "down": linear_step(tokens, MLP, HIDDEN, repeats)}


def adamw_seconds(repeats: int) -> float:
    """One AdamW update of SmolLM2-135M's parameter shapes (moments already made): the faster of torch's
    foreach and fused implementations (transformers' default optimizer is the fused one)."""
    shapes = [(VOCAB, HIDDEN)] + LAYERS * [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
                                           (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP), (HIDDEN,), (HIDDEN,)]
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes + [(HIDDEN,)]]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    best = float("inf")
    for kind in ({"foreach": True}, {"fused": True}):
        opt = torch.optim.AdamW(params, lr=1e-5, **kind)
        opt.step()  # makes the moments
        best = min(best, best_time(opt.step, max(2, repeats // 2)))
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, required=True, help="tokens through the model per step")
    parser.add_argument("--no-head", action="store_true", help="no output layer (a reward model's step)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--peer-rate", type=float, help="the peer's steady tokens/s, to print the largest ratio")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    per_layer = layer_seconds(args.tokens, args.repeats)
    parts = {name: LAYERS * s for name, s in per_layer.items()}
    if not args.no_head:
        parts["output layer"] = linear_step(args.tokens, HIDDEN, VOCAB, args.repeats)
    parts["AdamW update"] = adamw_seconds(args.repeats)
    products = sum(s for name, s in parts.items() if name != "AdamW update")
    weights = LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + 3 * HIDDEN * MLP) + (0 if args.no_head else VOCAB * HIDDEN)
    flops = 6 * weights * args.tokens
    total = sum(parts.values())
    print(f"{args.tokens} tokens per step, {args.threads} threads; {flops / 1e9:.1f} GFLOP of products")
    for name, s in parts.items():
        print(f"  {name:14s} {s:7.3f} s")
    print(f"  products at {flops / products / 1e9:.0f} GFLOP/s; floor {total:.3f} s per step = "
          f"{args.tokens / total:.1f} tokens/s")
    if args.peer_rate:
        print(f"  against a peer at {args.peer_rate:.1f} tokens/s: at most {args.tokens / total / args.peer_rate:.2f}x")


if __name__ == "__main__":
    main()
