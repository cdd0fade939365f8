"""DPO training-step throughput and peak memory: posttrain's DPOTrainer vs a straightforward DPO, same run.

    python benchmarks/dpo_bench.py [--model posttrain/smollm2-135m-instruct] [--batch-size 4]
        [--max-length 256] [--steps 2] [--device cpu|cuda]

Both do the same optimizer step (sigmoid DPO, β = 0.1, AdamW) on the same tokenised pairs:
  * posttrain: `DPOTrainer.compute_loss`: chosen and rejected stacked into one forward pass of
    the policy and one of the reference, logits only for the completion columns, chunked
    selective log-softmax;
  * straightforward: separate chosen and rejected forwards for policy and reference (four in
    all), full-sequence logits, a full log_softmax, then gather.
Each implementation runs in its own child process: one warm-up step (AdamW creates its state),
then --steps timed steps; the best step time is reported. Memory is the step's working memory:
the peak of everything allocated during the timed steps (activations, logits, log-probs,
gradients) above what lives across steps (weights of policy and reference, AdamW state). On
CUDA it is max_memory_allocated minus the allocation before the steps; on CPU it is the peak of
the live tensor storages, tracked op by op with a TorchDispatchMode (exact, unlike the resident
set size, which the C allocator keeps high after frees).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import weakref

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the CPU tensor storages created inside the mode and still alive."""

    def __init__(self):
        super().__init__()
        self.live, self.current, self.peak = {}, 0, 0

    def _free(self, key):
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out


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
    times, losses = [], [step(batches[0])]  # warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    tracker = LiveTensorBytes() if not cuda else None
    for batch in batches[1:]:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        if tracker is not None:
            with tracker:
                losses.append(step(batch))
        else:
            losses.append(step(batch))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - baseline if cuda else tracker.peak
    print(json.dumps({"best_s": min(times), "mean_s": sum(times) / len(times), "peak_bytes": peak,
                      "tokens_per_step": tokens, "first_loss": losses[0]}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="posttrain/smollm2-135m-instruct")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
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
    memory = "step working memory"
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
