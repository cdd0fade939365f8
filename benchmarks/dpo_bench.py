"""DPO training-step throughput and peak memory: posttrain's DPOTrainer vs a straightforward DPO, same run.

    python benchmarks/dpo_bench.py [--model posttrain/smollm2-135m-instruct] [--batch-size 4]
        [--max-length 256] [--steps 3] [--device cpu|cuda]

Both do the same optimizer step (sigmoid DPO, β = 0.1, AdamW) on the same tokenised pairs:
  * posttrain: `DPOTrainer.compute_loss`: chosen and rejected stacked into one forward pass of
    the policy and one of the reference, logits only for the completion columns, chunked
    selective log-softmax;
  * straightforward: separate chosen and rejected forwards for policy and reference (four in
    all), full-sequence logits, a full log_softmax, then gather.
Each implementation runs in its own child process (so peak memory is its own): one warm-up step,
then --steps timed steps; the best step time is reported. Peak memory is
torch.cuda.max_memory_allocated on CUDA and the peak resident set size on CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def make_pairs(n: int, seed: int = 0):
    """Chat preference pairs of Zen-of-Python lines: a prompt of several lines, completions of a few."""
    from datasets import Dataset

    from posttrain.data.builtin import zen_lines

    lines, rng = zen_lines(), random.Random(seed)

    def text(k):
        return " ".join(rng.choice(lines) for _ in range(k))

    rows = [{"prompt": [{"role": "user", "content": "Explain, one aphorism at a time: " + text(rng.randint(4, 7))}],
             "chosen": [{"role": "assistant", "content": text(rng.randint(2, 4))}],
             "rejected": [{"role": "assistant", "content": text(rng.randint(2, 4))}]} for _ in range(n)]
    return Dataset.from_list(rows)


def straightforward_step(model, ref_model, batch, beta=0.1):
    """Sigmoid DPO the plain way: four forwards, full logits, full log_softmax."""
    def logps(m, ids, mask, loss_mask):
        logits = m(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
        all_logps = logits[:, :-1].log_softmax(-1)  # (B, T-1, V)
        per_token = all_logps.gather(-1, ids[:, 1:, None]).squeeze(-1)
        return (per_token * loss_mask[:, 1:]).sum(-1)

    chosen = logps(model, *batch["chosen"])
    rejected = logps(model, *batch["rejected"])
    with torch.no_grad():
        ref_chosen = logps(ref_model, *batch["chosen"])
        ref_rejected = logps(ref_model, *batch["rejected"])
    return -F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()


def child(args):
    from posttrain.data.collate import pad
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    config = DPOConfig(output_dir="/tmp/dpo_bench", max_length=args.max_length, per_device_train_batch_size=args.batch_size,
                       use_cpu=args.device == "cpu", disable_tqdm=True, report_to="none")
    trainer = DPOTrainer(args.model, args=config, train_dataset=make_pairs(args.batch_size * (args.steps + 1)))
    model, ref_model, data = trainer.model, trainer.ref_model, trainer.train_dataset
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    pad_id = trainer.processing_class.pad_token_id
    batches = []
    for start in range(0, len(data), args.batch_size):
        rows = [data[i] for i in range(start, start + args.batch_size)]
        if args.impl == "posttrain":
            batch = {k: v.to(args.device) for k, v in trainer.data_collator(rows).items()}
        else:  # chosen and rejected padded on their own, loss masks over the completion tokens
            batch = {}
            for col in ("chosen_ids", "rejected_ids"):
                seqs = [r["prompt_ids"] + r[col] for r in rows]
                batch[col[:-4]] = (pad(seqs, pad_id).to(args.device), pad([[1] * len(s) for s in seqs], 0).to(args.device),
                                   pad([[0] * len(r["prompt_ids"]) + [1] * len(r[col]) for r in rows], 0).to(args.device))
        batches.append(batch)
    tokens = sum(len(r["prompt_ids"]) * 2 + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in data) / len(batches)

    def step(batch):
        if args.impl == "posttrain":
            loss = trainer.compute_loss(model, batch)
        else:
            loss = straightforward_step(model, ref_model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    cuda = args.device == "cuda"
    times, losses = [], []
    for i, batch in enumerate(batches):
        if cuda:
            torch.cuda.synchronize()
            if i == 1:
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        losses.append(step(batch))
        if cuda:
            torch.cuda.synchronize()
        if i > 0:  # the first step is the warm-up
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"best_s": min(times), "mean_s": sum(times) / len(times), "peak_bytes": peak,
                      "tokens_per_step": tokens, "first_loss": losses[0]}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="posttrain/smollm2-135m-instruct")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--impl", choices=["posttrain", "straightforward"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.impl:
        return child(args)

    results = {}
    for impl in ("posttrain", "straightforward"):
        out = subprocess.run([sys.executable, __file__, "--impl", impl, "--model", args.model, "--batch-size",
                              str(args.batch_size), "--max-length", str(args.max_length), "--steps", str(args.steps),
                              "--device", args.device], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{impl} failed:\n{out.stderr[-4000:]}")
        results[impl] = json.loads(out.stdout.strip().splitlines()[-1])
    ours, plain = results["posttrain"], results["straightforward"]
    assert abs(ours["first_loss"] - plain["first_loss"]) < 1e-3, (ours["first_loss"], plain["first_loss"])
    memory = "peak GPU memory allocated" if args.device == "cuda" else "peak RSS"
    print(f"DPO step, {args.model} fp32 on {args.device}: {args.batch_size} pairs/step, max_length {args.max_length}, "
          f"~{ours['tokens_per_step']:.0f} tokens/step, best of {args.steps} steps after 1 warm-up")
    print(f"{'implementation':<44}{'s/step':>8}{'pairs/s':>9}{memory:>28}")
    for name, r in [("posttrain DPOTrainer (1+1 fwd, completion logits)", ours),
                    ("straightforward (4 fwd, full log_softmax)", plain)]:
        print(f"{name:<44}{r['best_s']:>8.3f}{args.batch_size / r['best_s']:>9.2f}{r['peak_bytes'] / 2**20:>24.0f} MiB")
    print(f"speed-up: {plain['best_s'] / ours['best_s']:.2f}x; memory: {ours['peak_bytes'] / plain['peak_bytes']:.2f}x "
          f"of the straightforward implementation")


if __name__ == "__main__":
    main()
