"""DPO training-step throughput and memory: posttrain's DPOTrainer vs a straightforward DPO.

    python benchmarks/dpo_bench.py [--model posttrain/smollm2-135m-instruct] [--batch-size 4]
        [--max-length 256] [--steps 2] [--device cpu|cuda]

All rows do the same optimizer step (sigmoid DPO, β = 0.1, AdamW) on the same tokenised pairs,
from the same initial weights, each implementation in its own process (as a user would run it):
  * posttrain: `DPOTrainer.compute_loss`: each pair one sequence [prompt | chosen | rejected] with a
    block attention mask (the prompt computed once), one forward pass of the policy and one of the
    reference, pairs grouped by length on CPU, logits only at the completion positions, the output
    layer fused into a chunked log-softmax; the trainer's process keeps freed memory in the heap
    (`keep_freed_memory`);
  * straightforward: separate chosen and rejected forwards for policy and reference (four in
    all), full-sequence logits, a full log_softmax, then gather; the C allocator as it comes;
  * posttrain with precompute_ref_log_probs=True (extra row): the reference scores the data once
    before training (its time is printed apart), so a step is one policy forward and backward.
Steps are interleaved (one step of each process in turn, round after round) so that a change in
machine load hits all rows alike; the first round is a warm-up (AdamW creates its state); the
best of --steps timed rounds is reported, in wall-clock seconds and in CPU seconds of the
stepping process (with OMP_NUM_THREADS=1, CPU time is what other processes on a shared machine do
not inflate). Memory is the step's working memory: the peak of what is allocated during the step
(activations, logits, log-probs, gradients) above what lives across steps (weights, AdamW
state). On CUDA: max_memory_allocated minus the allocation before the step; on CPU: the peak of
the live tensor storages, tracked op by op with a TorchDispatchMode (exact, unlike the resident
set size, which the C allocator keeps high after frees).
"""

from __future__ import annotations

import argparse
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

    from posttrain.tasks.builtin import zen_lines

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


IMPLEMENTATIONS = {
    "posttrain": "posttrain DPOTrainer (1+1 fwd, completion logits)",
    "straightforward": "straightforward (4 fwd, full log_softmax)",
    "precompute": "posttrain, precompute_ref_log_probs=True",
}


def worker(kind: str, args, conn):
    """Builds one implementation in this process, then runs one timed step per round it is sent."""
    from posttrain.data.collate import pad
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    cuda = args.device == "cuda"
    torch.manual_seed(0)
    pairs = make_pairs(args.batch_size * (args.steps + 1))

    def config(**kw):
        return DPOConfig(output_dir="/tmp/dpo_bench", max_length=args.max_length, disable_tqdm=True,
                         per_device_train_batch_size=args.batch_size, use_cpu=not cuda, report_to="none", **kw)

    start = time.perf_counter()
    # the straightforward loop borrows only the tokenised data and the two models: its process keeps
    # the C allocator as it is (keep_freed_memory=False), as a plain script's would be
    trainer = DPOTrainer(args.model, args=config(precompute_ref_log_probs=kind == "precompute",
                                                 keep_freed_memory=kind != "straightforward"), train_dataset=pairs)
    build_s = time.perf_counter() - start
    data, n, pad_id = trainer.train_dataset, args.batch_size, trainer.processing_class.pad_token_id
    chunks = [[data[i] for i in range(lo, lo + n)] for lo in range(0, len(data), n)]

    def split_batch(rows):  # chosen and rejected padded on their own, loss masks over the completion tokens
        batch = {}
        for col in ("chosen_ids", "rejected_ids"):
            seqs = [r["prompt_ids"] + r[col] for r in rows]
            batch[col[:-4]] = tuple(t.to(args.device) for t in (
                pad(seqs, pad_id), pad([[1] * len(x) for x in seqs], 0),
                pad([[0] * len(r["prompt_ids"]) + [1] * len(r[col]) for r in rows], 0)))
        return batch

    model = trainer.model
    if kind == "straightforward":
        batches = [split_batch(c) for c in chunks]
        loss_fn = lambda b: straightforward_step(model, trainer.ref_model, b)  # noqa: E731
    else:
        batches = [{k: v.to(args.device) for k, v in trainer.data_collator(c).items()} for c in chunks]
        loss_fn = lambda b: trainer.compute_loss(model, b)  # noqa: E731
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    tokens = sum(len(r["prompt_ids"]) * 2 + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in data) / len(chunks)
    conn.send({"build_s": build_s, "pairs": len(data), "tokens": tokens})
    while (round_ := conn.recv()) is not None:
        model.train()
        tracker = None if cuda else LiveTensorBytes()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        start, cpu_start = time.perf_counter(), time.process_time()
        with tracker if tracker is not None else torch.enable_grad():
            loss = loss_fn(batches[round_])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        memory = torch.cuda.max_memory_allocated() - baseline if cuda else tracker.peak
        conn.send({"time": elapsed, "cpu": cpu, "memory": memory, "loss": loss.item()})


def main():
    import multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="posttrain/smollm2-135m-instruct")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    context = mp.get_context("spawn")
    conns, procs, setup = {}, [], {}
    for kind in IMPLEMENTATIONS:
        parent, child = context.Pipe()
        proc = context.Process(target=worker, args=(kind, args, child), daemon=True)
        proc.start()
        conns[kind], setup[kind] = parent, None
        procs.append(proc)
        setup[kind] = parent.recv()  # built one after another, so that loading does not overlap the steps
    results = {kind: {"times": [], "cpu": [], "memory": 0, "losses": []} for kind in IMPLEMENTATIONS}
    for round_ in range(args.steps + 1):
        for kind, conn in conns.items():  # one step each, in turn: a change in machine load hits all alike
            conn.send(round_)
            r = conn.recv()
            results[kind]["losses"].append(r["loss"])
            if round_ > 0:  # round 0 is the warm-up
                results[kind]["times"].append(r["time"])
                results[kind]["cpu"].append(r["cpu"])
                results[kind]["memory"] = max(results[kind]["memory"], r["memory"])
    for conn in conns.values():
        conn.send(None)
    for proc in procs:
        proc.join()

    losses = [r["losses"][0] for r in results.values()]
    assert max(losses) - min(losses) < 1e-3, losses  # the same loss at the shared starting point
    n = args.batch_size
    print(f"DPO step, {args.model} fp32 on {args.device}: {n} pairs/step, max_length {args.max_length}, "
          f"~{setup['posttrain']['tokens']:.0f} tokens/step, best of {args.steps} interleaved steps after 1 warm-up, "
          f"each implementation in its own process")
    print(f"{'implementation':<52}{'s/step':>8}{'pairs/s':>9}{'CPU s/step':>11}{'pairs/CPU-s':>12}"
          f"{'step memory':>14}")
    for kind, r in results.items():
        best, cpu = min(r["times"]), min(r["cpu"])
        print(f"{IMPLEMENTATIONS[kind]:<52}{best:>8.3f}{n / best:>9.2f}{cpu:>11.3f}{n / cpu:>12.3f}"
              f"{r['memory'] / 2**20:>10.0f} MiB")
    plain, ours = results["straightforward"], results["posttrain"]
    print(f"speed-up of posttrain over straightforward: {min(plain['times']) / min(ours['times']):.2f}x wall-clock, "
          f"{min(plain['cpu']) / min(ours['cpu']):.2f}x CPU time; "
          f"step memory {ours['memory'] / plain['memory']:.2f}x")
    print(f"with precomputed reference log-probs: {min(plain['times']) / min(results['precompute']['times']):.2f}x "
          f"(building that trainer, loading included, with its one-off reference pass over the "
          f"{setup['precompute']['pairs']} pairs: {setup['precompute']['build_s']:.1f} s; without the pass: "
          f"{setup['posttrain']['build_s']:.1f} s)")


if __name__ == "__main__":
    main()
