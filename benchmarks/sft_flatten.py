"""SFT step time on unpacked batches: padded rows against one flattened row, and the per-batch choice.

    python benchmarks/sft_flatten.py [--threads 2] [--batches 6] [--repeats 3] [--clock wall|cpu]

The data and shape of vs_trl.py's `sft` workload (SmolLM2-135M-Instruct, fp32, batch 4, documents of
32-384 tokens cut to max_length 256, rows drawn at random). Three SFTTrainers share one model and one
AdamW: padding_free=False (padded rows), padding_free=True (one flat row, always) and the default
padding_free=None (flat where `flat_is_cheaper` says so). Each batch is stepped by all three in one
process, their order rotating from batch to batch; a step is forward, backward and optimizer step.
--clock cpu times each step by the process's CPU time: with --threads 1 it is nearly immune to other
processes competing for the cores (wall time on a shared machine is not).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

LAYOUTS = {"padded": False, "flat": True, "per-batch": None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    from posttrain.models.loading import load_causal_lm, smollm2_path
    from posttrain.trainers.sft import SFTConfig, SFTTrainer, flat_is_cheaper
    from vs_trl import SEED, documents

    torch.set_num_threads(args.threads)
    path = str(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = Dataset.from_list([{"input_ids": d} for d in documents(tokenizer, 256, 32, 384, 256)])
    model = load_causal_lm(path, dtype=torch.float32)
    trainers = {name: SFTTrainer(model, args=SFTConfig(output_dir="/tmp/sft-flatten", max_length=256,
                                                       per_device_train_batch_size=4, learning_rate=1e-5,
                                                       padding_free=free, report_to=[]),
                                 train_dataset=data, processing_class=tokenizer)
                for name, free in LAYOUTS.items()}
    optimizer = trainers["padded"].create_optimizer()
    rng = random.Random(SEED)
    batches = [[data[i] for i in rng.sample(range(len(data)), 4)] for _ in range(args.batches)]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def step(name, rows):
        trainer = trainers[name]
        batch = trainer.data_collator(rows)
        items = (batch["labels"] != -100).sum()
        start = clock()
        trainer.training_step(model, batch, items)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return clock() - start

    for name in LAYOUTS:  # warm-up (and the per-batch trainer's one-time position-id check)
        step(name, batches[0])
    times = {name: [] for name in LAYOUTS}
    names = list(LAYOUTS)
    for repeat in range(args.repeats):
        for k, rows in enumerate(batches):
            lengths = [len(r["input_ids"]) for r in rows]
            order = names[(repeat + k) % 3:] + names[:(repeat + k) % 3]
            took = {name: step(name, rows) for name in order}
            for name in names:
                times[name].append(took[name])
            choice = "flat" if flat_is_cheaper(lengths, max(lengths), model.config.hidden_size) else "padded"
            print(f"repeat {repeat} batch {k}: lengths {lengths} (N={sum(lengths)}), per-batch picks {choice}; "
                  + ", ".join(f"{n} {took[n]:.2f}s" for n in names), flush=True)
    tokens = sum(len(r["input_ids"]) for rows in batches for r in rows) * args.repeats
    print(f"\n{args.clock} seconds per step, {args.threads} thread(s), {args.batches} batches x {args.repeats} repeats")
    for name in names:
        total = sum(times[name])
        print(f"  {name:9s} median {statistics.median(times[name]):.2f}s  mean {total / len(times[name]):.2f}s  "
              f"{tokens / total:.0f} real tokens/s  ({total / sum(times['padded']):.3f} of padded)")
    for name in ("flat", "per-batch"):
        ratios = [t / p for t, p in zip(times[name], times["padded"])]
        print(f"  {name} / padded per step: median {statistics.median(ratios):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
