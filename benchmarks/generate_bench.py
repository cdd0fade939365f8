"""Sampler throughput: posttrain's `generate` vs transformers' `model.generate`, same run.

    python benchmarks/generate_bench.py [--model posttrain/smollm2-135m-instruct] [--prompts 2]
        [--generations 4] [--new-tokens 32] [--repeats 3] [--device cpu|cuda]

Both sample plain softmax at temperature 1 (no top-k/top-p) with EOS switched off, so every
sample has exactly --new-tokens tokens and both do the same work. Prints the best of
--repeats interleaved runs (after one warm-up each) as samples/s and new tokens/s. On CPU, ours
decodes through the compiled lean step (`posttrain.accel.decode`, built on first use, before the
timing) for Llama/Qwen2-style models, and the few-rows product kernel for others.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.rollout.generate import SamplingConfig, generate

QUESTIONS = ["What is the capital of France?", "Write a haiku about gradient descent and patience."]


def best_times(fns, repeats: int, device: str) -> list[float]:
    """Best wall time of each function; runs are interleaved so a load change hits both alike."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, record in zip(fns, times):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            record.append(time.perf_counter() - start)
    return [min(t) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="posttrain/smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    model = load_causal_lm(args.model, dtype=torch.float32).to(args.device).eval()
    tok = load_tokenizer(None, model=args.model)
    questions = [QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS)) for i in range(args.prompts)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in questions]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    G, T = args.generations, args.new_tokens
    samples = args.prompts * G

    sampling = SamplingConfig(max_new_tokens=T, num_generations=G)
    def ours():
        return generate(model, prompts, sampling, pad_token_id=tok.pad_token_id, eos_token_id=None,
                        generator=torch.Generator().manual_seed(0))

    tok.padding_side = "left"
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt").to(args.device)
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # same work as ours: always T new tokens
    config.update(do_sample=True, temperature=1.0, top_k=None, top_p=None, max_new_tokens=T, min_new_tokens=None,
                  num_return_sequences=G, pad_token_id=tok.pad_token_id)
    ours, hf = best_times([ours, lambda: model.generate(**enc, generation_config=config)], args.repeats, args.device)

    print(f"model {args.model} fp32 on {args.device}: {args.prompts} prompts x {G} generations x {T} new tokens "
          f"(prompt lengths {[len(p) for p in prompts]}), best of {args.repeats}")
    print(f"{'sampler':<34}{'seconds':>9}{'samples/s':>11}{'tokens/s':>10}")
    for name, sec in [("posttrain generate (shared prefill)", ours), ("transformers model.generate", hf)]:
        print(f"{name:<34}{sec:>9.3f}{samples / sec:>11.1f}{samples * T / sec:>10.0f}")
    print(f"speed-up: {hf / ours:.2f}x")


if __name__ == "__main__":
    main()
