"""Where a CPU decoding step's time goes, and the decoding kernels of two versions side by side.

    python benchmarks/decode_bench.py [--model posttrain/smollm2-135m-instruct] [--old main] [--rows 1,4,8,16]
        [--repeats 30] [--threads 0] [--steps 32]

Builds `posttrain/accel/decode_kernels.c` as it is at the git ref --old into a temporary library (with
`few_rows.BASE_FLAGS`: the AVX2 build) and loads it beside the working tree's build (`few_rows.variant()`;
POSTTRAIN_KERNELS_ISA=avx2 for the AVX2 one), then times, interleaved (old, new, old, new, ...) and taking
the minimum of --repeats:

1. `few_rows_linear` on every weight shape of the model (per layer kind and the output layer), at each row
   count of --rows: milliseconds and the weight streaming rate (weight bytes / time, GB/s); and one small
   weight read again and again from L2 (the kernel's arithmetic ceiling, free of memory and of the load);
2. the whole lean decoding step (`LeanDecoder.step`, 8 rows, the KV cache at prompt + 16 positions) through
   each library, and its parts: the products alone (the sum of 1.'s rows for one step), the rest (attention,
   norms, rotary, Python around the call);
3. the per-step sampling ops of `rollout.generate` (`_sample_step` at temperature 1, no filters) on the
   step's (8, V) logits;
4. a whole `generate` call (2 prompts x 4 samples x --steps tokens) with each library, and whether both give the
   same samples.

Also checks that both libraries give the same products up to float rounding (the largest difference is
printed). CPU seconds (process time) are printed beside wall seconds: on a loaded machine they are the
steadier figure.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from posttrain.accel import decode, few_rows

ROOT = Path(__file__).resolve().parents[1]


def old_library(ref: str, tmp: Path):
    """The kernels as the git ref had them, compiled into tmp (the flags the old source was built with)."""
    source = subprocess.run(["git", "show", f"{ref}:posttrain/accel/decode_kernels.c"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    src, lib = tmp / "old.c", tmp / "old.so"
    src.write_text(source)
    subprocess.run(["cc", *few_rows.BASE_FLAGS, "-o", str(lib), str(src), *few_rows.LIBS], check=True)
    return ctypes.CDLL(str(lib))


def linear_fn(lib):
    fn = lib.few_rows_linear
    fn.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_ssize_t, ctypes.c_int, ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.c_int]
    fn.restype = None
    return fn


def interleaved(fns, repeats: int) -> list[tuple[float, float]]:
    """(best wall s, best process CPU s) of each function, runs interleaved."""
    for fn in fns:
        fn()
    best = [[float("inf"), float("inf")] for _ in fns]
    for _ in range(repeats):
        for fn, b in zip(fns, best):
            w, c = time.perf_counter(), time.process_time()
            fn()
            b[0], b[1] = min(b[0], time.perf_counter() - w), min(b[1], time.process_time() - c)
    return [tuple(b) for b in best]


def products(model, fns, rows: list[int], repeats: int) -> dict[int, list[float]]:
    """Table 1, each layer kind over every layer's weight in turn (as a step streams them: a weight read again at
    once would come from the cache); returns per row count the per-step product time of each library."""
    layers = model.model.layers
    kinds = [("qkv", [torch.cat([l.self_attn.q_proj.weight, l.self_attn.k_proj.weight, l.self_attn.v_proj.weight])
                      for l in layers]),
             ("o", [l.self_attn.o_proj.weight for l in layers]),
             ("gate+up", [w for l in layers for w in (l.mlp.gate_proj.weight, l.mlp.up_proj.weight)]),
             ("down", [l.mlp.down_proj.weight for l in layers]), ("output layer", [model.lm_head.weight]),
             # one 256-row slice read 30 times: it stays in L2, so this row is the kernel's arithmetic ceiling
             ("L2-resident", [model.lm_head.weight[:256]] * len(layers))]
    threads = torch.get_num_threads()
    print(f"\n1. few_rows_linear, {threads} threads, every layer's weight in turn: wall ms (GB/s of weight; CPU ms) "
          f"old -> new, max |new - old|")
    totals = {}
    for M in rows:
        totals[M] = [0.0, 0.0]
        for name, weights in kinds:
            weights = [w.detach().contiguous() for w in weights]
            N, K = weights[0].shape
            x = torch.randn(M, K)
            outs = [torch.empty(M, N) for _ in fns]

            def call(fn, y):
                for w in weights:
                    fn(x.data_ptr(), K, w.data_ptr(), None, y.data_ptr(), N, M, N, K, threads)
            (old, old_cpu), (new, new_cpu) = interleaved([lambda fn=fn, y=y: call(fn, y) for fn, y in zip(fns, outs)],
                                                         repeats)
            gb = sum(w.numel() for w in weights) * 4 / 1e9
            diff = (outs[1] - outs[0]).abs().max().item()
            print(f"  rows {M:2d} {name:<13}{len(weights):>3} x {N:>5}x{K:<5} {old * 1e3:7.2f} ({gb / old:5.1f}; "
                  f"{old_cpu * 1e3:6.2f}) -> {new * 1e3:7.2f} ({gb / new:5.1f}; {new_cpu * 1e3:6.2f})  max diff {diff:.1e}")
            if name != "L2-resident":
                totals[M][0] += old
                totals[M][1] += new
        print(f"  rows {M:2d} all products of one step: {totals[M][0] * 1e3:.2f} -> {totals[M][1] * 1e3:.2f} ms")
    return totals


def lean_step(model, libs, totals, repeats: int, prompt: int = 40, extra: int = 16, A: int = 8):
    """Table 2: the whole lean step through each library at A rows."""
    from posttrain.rollout.cpu_backend import cpu_backend

    backend = cpu_backend(model)
    ids = torch.randint(0, 1000, (1, prompt))
    with backend:
        backend.prefill(ids, torch.ones_like(ids), torch.arange(prompt)[None])
        backend.expand(A, prompt + extra + 4)
        for t in range(extra):
            backend.step(torch.randint(0, 1000, (A,)), t, torch.ones(A, prompt + t + 1), torch.full((A,), prompt + t))
        lean = backend.lean
        assert lean._c is not None, "the lean C step is not bound"
        _, model_struct, layers, work = lean._c
        steppers = []
        for lib in libs:
            fn = lib.lean_decode_step
            fn.argtypes = decode._c_step_function().argtypes
            fn.restype = None
            steppers.append(fn)
        cache, T = backend.cache, prompt + extra + 1
        tokens, attention = torch.randint(0, 1000, (A,)), torch.ones(A, T)
        outs = []

        def run(fn):
            lean._c = (fn, model_struct, layers, work)
            outs.append(lean.step(tokens, extra, attention, cache))
            for layer in cache.layers:  # the next run writes the same position again
                layer.advance(-1)

        times = interleaved([lambda fn=fn: run(fn) for fn in steppers], repeats)
        diff = (outs[-1] - outs[-2]).abs().max().item()
        print(f"\n2. lean decoding step, {A} rows, cache {T} positions: wall ms (CPU ms), old -> new")
        (ow, oc), (nw, nc) = times
        print(f"  whole step      {ow * 1e3:7.2f} ({oc * 1e3:6.2f}) -> {nw * 1e3:7.2f} ({nc * 1e3:6.2f})   "
              f"max |logit diff| {diff:.1e}")
        print(f"  products alone  {totals[0] * 1e3:7.2f} -> {totals[1] * 1e3:7.2f}")
        print(f"  the rest        {(ow - totals[0]) * 1e3:7.2f} -> {(nw - totals[1]) * 1e3:7.2f}")
        return outs[-1]


def sampling_ops(logits, repeats: int):
    from posttrain.rollout.generate import SamplingConfig, _Feeds, _sample_step

    A = logits.shape[0]
    sampling = SamplingConfig(max_new_tokens=4, num_generations=A)
    rows, alive, u = torch.arange(A), torch.ones(A, dtype=torch.bool), torch.rand(A)
    feeds = _Feeds(A, None, 4)
    ((w, c),) = interleaved([lambda: _sample_step(logits, sampling, None, u, rows, alive, 0, feeds)], repeats)
    print(f"\n3. sampling ops per step on ({A}, {logits.shape[1]}) logits: {w * 1e3:.2f} ms wall ({c * 1e3:.2f} CPU)")


def whole_generate(model, libs, repeats: int, steps: int):
    """A whole `generate` call (prefill included) with each library's kernels, interleaved; the same samples."""
    from posttrain.rollout.generate import SamplingConfig, generate

    prompts = [list(range(100, 140)), list(range(200, 230))]
    sampling = SamplingConfig(max_new_tokens=steps, num_generations=4)
    saved = decode._c_step_function, few_rows.few_rows_kernel
    rollouts = []

    def run(lib):
        step = lib.lean_decode_step
        step.argtypes, step.restype = saved[0]().argtypes, None
        decode._c_step_function, few_rows.few_rows_kernel = (lambda: step), (lambda: linear_fn(lib))
        try:
            rollouts.append(generate(model, prompts, sampling, pad_token_id=0, eos_token_id=None,
                                     generator=torch.Generator().manual_seed(0)))
        finally:
            decode._c_step_function, few_rows.few_rows_kernel = saved
    (ow, oc), (nw, nc) = interleaved([lambda lib=lib: run(lib) for lib in libs], repeats)
    old, new = rollouts[-2:]
    same = torch.equal(old.completion_ids, new.completion_ids)
    print(f"\n4. generate, 2 prompts x 4 samples x {steps} tokens: wall s (CPU s) {ow:.3f} ({oc:.3f}) -> {nw:.3f} "
          f"({nc:.3f}); {ow / steps * 1e3:.1f} -> {nw / steps * 1e3:.1f} ms per token with the prefill; same samples: "
          f"{same}, max |log-prob diff| {(old.logprobs - new.logprobs).abs().max().item():.1e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="posttrain/smollm2-135m-instruct")
    parser.add_argument("--old", default="main", help="git ref of the kernels to compare against")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch/OpenMP threads (0: as torch has it); on a "
                        "loaded machine 1 thread gives the steadier per-core figures")
    parser.add_argument("--steps", type=int, default=32, help="new tokens of the whole generate call (0: skip)")
    args = parser.parse_args()
    from posttrain.models.loading import load_causal_lm

    if args.threads:
        torch.set_num_threads(args.threads)

    model = load_causal_lm(args.model, dtype=torch.float32).eval()
    new = few_rows.kernels()
    assert new is not None, "the kernels cannot be built here"
    print(f"model {args.model} fp32; kernels: old = {args.old}, new = working tree ({few_rows.variant()})")
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        old = old_library(args.old, Path(tmp))
        totals = products(model, [linear_fn(old), linear_fn(new)], [int(r) for r in args.rows.split(",")],
                          args.repeats)
        logits = lean_step(model, [old, new], totals.get(8, totals[max(totals)]), args.repeats)
        sampling_ops(logits, args.repeats)
        if args.steps:
            whole_generate(model, [old, new], max(3, args.repeats // 5), args.steps)


if __name__ == "__main__":
    main()
