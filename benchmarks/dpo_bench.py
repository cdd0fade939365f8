"""DPO training-step throughput and memory: posttrain's DPOTrainer vs a straightforward DPO, same run.

    python benchmarks/dpo_bench.py [--model posttrain/smollm2-135m-instruct] [--batch-size 4]
        [--max-length 256] [--steps 2] [--device cpu|cuda]

All rows do the same optimizer step (sigmoid DPO, β = 0.1, AdamW) on the same tokenised pairs,
each with its own copy of the policy (same initial weights) and optimizer:
  * posttrain: `DPOTrainer.compute_loss`: chosen and rejected stacked into one forward pass of
    the policy and one of the reference, logits only for the completion columns, chunked
    selective log-softmax;
  * straightforward: separate chosen and rejected forwards for policy and reference (four in
    all), full-sequence logits, a full log_softmax, then gather;
  * posttrain with precompute_ref_log_probs=True (extra row): the reference scores the data once
    before training (its time is printed apart), so a step is one policy forward and backward.
Steps are interleaved (one of each, round after round) so that a change in machine load hits
all rows alike; the first round is a warm-up (AdamW creates its state); the best of --steps
timed rounds is reported, in wall-clock seconds and in CPU seconds of this process (with
OMP_NUM_THREADS=1, CPU time is what other processes on a shared machine do not inflate). Memory is the step's working memory: the peak of what is allocated
during the step (activations, logits, log-probs, gradients) above what lives across steps
(weights, AdamW state). On CUDA: max_memory_allocated minus the allocation before the step; on
CPU: the peak of the live tensor storages, tracked op by op with a TorchDispatchMode (exact,
unlike the resident set size, which the C allocator keeps high after frees).
"""

from __future__ import annotations

import argparse
import copy
import random
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


def main():
    from posttrain.data.collate import pad
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="posttrain/smollm2-135m-instruct")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    cuda = args.device == "cuda"

    torch.manual_seed(0)
    pairs = make_pairs(args.batch_size * (args.steps + 1))

    def config(**kw):
        return DPOConfig(output_dir="/tmp/dpo_bench", max_length=args.max_length, disable_tqdm=True,
                         per_device_train_batch_size=args.batch_size, use_cpu=not cuda, report_to="none", **kw)

    ours = DPOTrainer(args.model, args=config(), train_dataset=pairs)
    start = time.perf_counter()
    pre = DPOTrainer(copy.deepcopy(ours.model), args=config(precompute_ref_log_probs=True), train_dataset=pairs,
                     processing_class=ours.processing_class)
    precompute_s = time.perf_counter() - start
    plain_model, ref_model, data = copy.deepcopy(ours.model), ours.ref_model, ours.train_dataset
    pad_id = ours.processing_class.pad_token_id

    def split_batch(rows):  # chosen and rejected padded on their own, loss masks over the completion tokens
        batch = {}
        for col in ("chosen_ids", "rejected_ids"):
            seqs = [r["prompt_ids"] + r[col] for r in rows]
            batch[col[:-4]] = tuple(t.to(args.device) for t in (
                pad(seqs, pad_id), pad([[1] * len(x) for x in seqs], 0),
                pad([[0] * len(r["prompt_ids"]) + [1] * len(r[col]) for r in rows], 0)))
        return batch

    def to_device(batch):
        return {k: v.to(args.device) for k, v in batch.items()}

    n = args.batch_size
    chunks = [list(range(i, i + n)) for i in range(0, len(data), n)]
    runs = {  # name -> (model, loss function, batches)
        "posttrain DPOTrainer (1+1 fwd, completion logits)": (
            ours.model, lambda m, b: ours.compute_loss(m, b),
            [to_device(ours.data_collator([data[i] for i in c])) for c in chunks]),
        "straightforward (4 fwd, full log_softmax)": (
            plain_model, lambda m, b: straightforward_step(m, ref_model, b),
            [split_batch([data[i] for i in c]) for c in chunks]),
        "posttrain, precompute_ref_log_probs=True": (
            pre.model, lambda m, b: pre.compute_loss(m, b),
            [to_device(pre.data_collator([pre.train_dataset[i] for i in c])) for c in chunks]),
    }
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-7) for name, (model, _, _) in runs.items()}
    results = {name: {"times": [], "cpu": [], "memory": 0, "losses": []} for name in runs}
    for round_ in range(args.steps + 1):
        for name, (model, loss_fn, batches) in runs.items():
            model.train()
            tracker = None if cuda else LiveTensorBytes()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                baseline = torch.cuda.memory_allocated()
            start, cpu_start = time.perf_counter(), time.process_time()
            with tracker if tracker is not None else torch.enable_grad():
                loss = loss_fn(model, batches[round_])
                loss.backward()
                optimizers[name].step()
                optimizers[name].zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            memory = torch.cuda.max_memory_allocated() - baseline if cuda else tracker.peak
            results[name]["losses"].append(loss.item())
            if round_ > 0:  # round 0 is the warm-up
                results[name]["times"].append(elapsed)
                results[name]["cpu"].append(cpu)
                results[name]["memory"] = max(results[name]["memory"], memory)

    losses = [r["losses"][0] for r in results.values()]
    assert max(losses) - min(losses) < 1e-3, losses  # the same loss at the shared starting point
    tokens = sum(len(r["prompt_ids"]) * 2 + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in data) / len(chunks)
    print(f"DPO step, {args.model} fp32 on {args.device}: {n} pairs/step, max_length {args.max_length}, "
          f"~{tokens:.0f} tokens/step, best of {args.steps} interleaved steps after 1 warm-up")
    print(f"{'implementation':<52}{'s/step':>8}{'pairs/s':>9}{'CPU s/step':>11}{'pairs/CPU-s':>12}"
          f"{'step memory':>14}")
    for name, r in results.items():
        best, cpu = min(r["times"]), min(r["cpu"])
        print(f"{name:<52}{best:>8.3f}{n / best:>9.2f}{cpu:>11.3f}{n / cpu:>12.3f}{r['memory'] / 2**20:>10.0f} MiB")
    names = list(results)
    plain, ours_r = results[names[1]], results[names[0]]
    print(f"speed-up of posttrain over straightforward: {min(plain['times']) / min(ours_r['times']):.2f}x wall-clock, "
          f"{min(plain['cpu']) / min(ours_r['cpu']):.2f}x CPU time; "
          f"step memory {ours_r['memory'] / plain['memory']:.2f}x")
    print(f"with precomputed reference log-probs: {min(plain['times']) / min(results[names[2]]['times']):.2f}x "
          f"(the one-off reference pass over the {len(data)} pairs, plus building that trainer: {precompute_s:.1f} s)")


if __name__ == "__main__":
    main()
