"""The sampler's top-p cut, the kernels' partial cut (`few_rows.top_p_filter`) against the whole-row sort it replaces,
in one process, alternating: `generate` of the distillation workload's shape (SmolLM2-135M, 2 prompts x 4 samples x
32 new tokens, top_p 0.95, the replay record kept), CPU seconds per call, and whether the rollouts are the same.

    python benchmarks/top_p_bench.py [--rounds 3] [--seeds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.loading import smollm2_path
    from posttrain.rollout import generate as g

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = json.load(open(Path.home() / ".cache" / "posttrain" / "vs-trl" / "prompts.json"))
    prompts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
               for r in rows[:2]]
    sampling = g.SamplingConfig(max_new_tokens=32, top_p=0.95)
    kernel_cut = g.top_p_filter

    def run(seed: int):
        return g.generate(model, prompts * 4, sampling, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          generator=torch.Generator().manual_seed(seed), record_linears=True)

    modes = {"whole sort": lambda logits, top_p: None, "kernel cut": kernel_cut}
    seconds = {name: [] for name in modes}
    outs = {name: {} for name in modes}
    run(0)  # warm-up
    for _ in range(args.rounds):
        for name, cut in modes.items():
            g.top_p_filter = cut
            for seed in range(args.seeds):
                start = time.process_time()
                outs[name][seed] = run(seed)
                seconds[name].append(time.process_time() - start)
    g.top_p_filter = kernel_cut
    same = all(torch.equal(outs["whole sort"][s].completion_ids, outs["kernel cut"][s].completion_ids)
               and torch.equal(outs["whole sort"][s].logprobs, outs["kernel cut"][s].logprobs)
               for s in range(args.seeds))
    for name, values in seconds.items():
        print(f"{name:10s} CPU s per generate: " + " ".join(f"{v:.3f}" for v in values)
              + f"  (median {sorted(values)[len(values) // 2]:.3f})")
    print("rollouts the same (tokens, log-probs):", same)


if __name__ == "__main__":
    main()
