"""SFT throughput and memory: a straightforward transformers Trainer against SFTTrainer.

    python benchmarks/sft_bench.py [--model posttrain/smollm2-135m-instruct] [--steps 3] [--warmup 1]
                                   [--threads 1] [--repeat 2] [--only baseline,packed,...] [--profile]

Workload: language-modeling SFT at max_length 256, batch 4, on documents of uniformly random
length between 32 and 384 tokens (deterministic slices of the Python docs that ship with
Python, cut to 256), so a padded batch wastes what real chat data wastes. Every variant trains
on the same token ids, with AdamW (transformers' default, fused) at lr 1e-5.

Variants (each in a fresh child process, so its peak memory is its own):
  baseline      plain `transformers.Trainer`, `labels`, every row padded to max_length, full logits
  unpacked      SFTTrainer without packing: rows padded to the longest in the batch, logits only
                where there is a target
  packed        SFTTrainer, packing=True (best-fit decreasing), the default layout for sdpa/eager:
                one bin per row, position ids restarting per sequence, no attention mask
  packed-flat   the same bins flattened into one row (padding_free=True): attention costs
                (4 * 256)^2 instead of 4 * 256^2
with a precision suffix: none = fp32; -bf16 = bf16 autocast; -mm16 = fp32 weights and
activations with `torch.set_float32_matmul_precision("medium")` (oneDNN matmuls on bf16 inputs,
fp32 accumulation; no autocast copies). -bf16/-mm16 run only where the CPU supports bf16.

tokens/s counts real (non-padding) tokens trained on per second of step time (forward,
backward, optimizer step; the batch is fetched before the clock starts), median over the
measured steps (and over --repeat runs). tok/CPU-s divides by this process's CPU time instead of wall time: with
--threads 1 it is immune to other processes competing for the cores, so use it on a shared
machine. Peak memory is the process's peak resident set size, VmHWM in /proc/self/status (weights,
gradients, AdamW state, activations; not ru_maxrss, which a child inherits from its parent over exec);
"train +" is that peak minus the resident size just before training.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

SEQ_LEN, BATCH = 256, 4
VARIANTS = {
    "baseline": dict(trainer="plain"),
    "unpacked": dict(trainer="sft"),
    "packed": dict(trainer="sft", packing=True),  # default layout: one bin per row
    "packed-flat": dict(trainer="sft", packing=True, padding_free=True),  # the whole batch as one row
}
PRECISIONS = {
    "": "fp32",
    "-bf16": "bf16 autocast (TrainingArguments bf16=True)",
    "-mm16": "fp32 weights, torch.set_float32_matmul_precision('medium'): matmuls take bf16 inputs",
}
DEFAULT = ["baseline", "unpacked", "packed", "packed-flat", "baseline-bf16", "packed-bf16", "baseline-mm16",
           "packed-mm16"]


def documents(tokenizer, n: int = 256, seed: int = 0) -> list[list[int]]:
    """`n` token-id documents, lengths uniform in [32, 384], cut to SEQ_LEN."""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text[:2_000_000], add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        length = rng.randint(32, 384)
        start = rng.randrange(0, len(ids) - length)
        docs.append(ids[start:start + length][: SEQ_LEN - 1] + [tokenizer.eos_token_id])
    return docs


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(spec: dict) -> dict:
    """Train one variant for warmup + steps steps; return its timings and memory."""
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from posttrain.models.loading import load_causal_lm, load_tokenizer
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    if spec["precision"] == "-mm16":
        torch.set_float32_matmul_precision("medium")
    tokenizer = load_tokenizer(spec["model"])
    docs = documents(tokenizer)
    model = load_causal_lm(spec["model"])
    common = dict(output_dir="/tmp/posttrain-sft-bench", per_device_train_batch_size=BATCH, learning_rate=1e-5,
                  max_steps=spec["warmup"] + spec["steps"], logging_steps=1000, report_to="none",
                  save_strategy="no", disable_tqdm=True, bf16=spec["precision"] == "-bf16", dataloader_pin_memory=False, seed=0,
                  use_cpu=not torch.cuda.is_available())
    counts: list[int] = []  # real tokens in each batch, in the order the trainer asks for them

    if spec["trainer"] == "plain":
        def encode(row):
            pad = SEQ_LEN - len(row["ids"])
            ids = row["ids"] + [tokenizer.pad_token_id] * pad
            mask = [1] * len(row["ids"]) + [0] * pad
            return {"input_ids": ids, "attention_mask": mask,
                    "labels": [t if m else -100 for t, m in zip(ids, mask)]}

        data = Dataset.from_dict({"ids": docs}).map(encode, remove_columns=["ids"])

        def collate(rows):
            counts.append(sum(sum(r["attention_mask"]) for r in rows))
            return {k: torch.tensor([r[k] for r in rows]) for k in ("input_ids", "attention_mask", "labels")}

        trainer = Trainer(model=model, args=TrainingArguments(**common, remove_unused_columns=False),
                          train_dataset=data, data_collator=collate)
    else:
        config = SFTConfig(**common, max_length=SEQ_LEN, packing=spec.get("packing", False),
                           padding_free=spec.get("padding_free"))
        trainer = SFTTrainer(model, args=config, train_dataset=Dataset.from_dict({"input_ids": docs}),
                             processing_class=tokenizer)
        inner = trainer.data_collator

        def collate(rows):
            counts.append(sum(len(r["input_ids"]) for r in rows))
            return inner(rows)

        trainer.data_collator = collate

    marks: dict[str, list[float]] = {k: [] for k in ("step", "cpu", "forward", "loss", "backward", "optimizer")}
    clock = time.process_time  # the profile split is in CPU seconds of this process (exact with --threads 1)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), clock()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self.t_opt = clock()

        def on_optimizer_step(self, args, state, control, **kw):
            marks["optimizer"].append(clock() - self.t_opt)

        def on_step_end(self, args, state, control, **kw):
            marks["step"].append(time.perf_counter() - self.t0)
            marks["cpu"].append(clock() - self.c0)

    trainer.add_callback(Clock())
    if spec["profile"]:  # wall-clock split of a step: model forward, loss, backward, optimizer
        def timed(fn, key, minus=()):
            def wrapper(*a, **kw):
                t = clock()
                before = {k: sum(marks[k]) for k in minus}
                out = fn(*a, **kw)
                marks[key].append(clock() - t - sum(sum(marks[k]) - before[k] for k in minus))
                return out
            return wrapper

        fwd_start = []
        trainer.model.register_forward_pre_hook(lambda *a: fwd_start.append(clock()))
        trainer.model.register_forward_hook(lambda *a: marks["forward"].append(clock() - fwd_start[-1]))
        trainer.compute_loss = timed(trainer.compute_loss, "loss", minus=("forward",))
        trainer.training_step = timed(trainer.training_step, "backward", minus=("forward", "loss"))

    rss_before = rss_mib()
    trainer.train()
    peak = next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    w = spec["warmup"]
    steps, cpu, tokens = marks["step"][w:], marks["cpu"][w:], counts[w:w + spec["steps"]]
    return {
        "tokens_per_s": statistics.median(n / t for n, t in zip(tokens, steps)),
        "tokens_per_cpu_s": statistics.median(n / t for n, t in zip(tokens, cpu)),
        "step_s": statistics.median(steps),
        "tokens_per_step": statistics.mean(tokens),
        "peak_mib": peak,
        "train_mib": peak - rss_before,
        "optim": str(trainer.args.optim).split(".")[-1],
        "profile": {k: statistics.median(v[w:]) for k, v in marks.items() if k not in ("step", "cpu") and v[w:]}
        or None,
    }


def bf16_supported() -> bool:
    import torch

    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="posttrain/smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    parser.add_argument("--only", default="", help="comma-separated variants (default: all)")
    parser.add_argument("--no-bf16", action="store_true", help="skip the variants that compute in bf16")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per run (0: torch's default). On a shared machine use 1 and read "
                             "tokens per CPU-second, which other processes do not distort")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the whole list this many times, interleaved, and report medians")
    parser.add_argument("--profile", action="store_true", help="split each step into forward/loss/backward/optimizer")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return

    names = args.only.split(",") if args.only else DEFAULT
    for name in names:
        base = name.removesuffix("-bf16").removesuffix("-mm16")
        if base not in VARIANTS or name[len(base):] not in PRECISIONS:
            parser.error(f"unknown variant {name!r}: a base ({', '.join(VARIANTS)}) plus one of "
                         f"{', '.join(repr(p) for p in PRECISIONS)}")
    if args.no_bf16 or not bf16_supported():
        names = [n for n in names if not n.endswith(("-bf16", "-mm16"))]
    print(f"model {args.model}, max_length {SEQ_LEN}, batch {BATCH}, {args.warmup} warm-up + {args.steps} "
          f"measured steps per variant, {args.repeat} run(s) each, threads {args.threads or 'default'}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for name in names * args.repeat:  # interleaved: a slow spell on a shared machine hits every variant
        base = name.removesuffix("-bf16").removesuffix("-mm16")
        spec = {**VARIANTS[base], "model": args.model, "steps": args.steps, "warmup": args.warmup,
                "precision": name[len(base):], "threads": args.threads, "profile": args.profile}
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        runs[name].append(r := json.loads(line[len("RESULT "):]))
        print(f"  {name:<18} {r['tokens_per_s']:7.1f} tokens/s  {r['tokens_per_cpu_s']:7.1f} tokens/CPU-s", flush=True)

    results = {}
    for name, rs in runs.items():
        if rs:
            results[name] = {k: statistics.median(r[k] for r in rs) for k in
                             ("tokens_per_s", "tokens_per_cpu_s", "step_s", "tokens_per_step", "peak_mib", "train_mib")}
            results[name].update(optim=rs[0]["optim"], profile={
                k: statistics.median(r["profile"][k] for r in rs) for k in (rs[0]["profile"] or {})} or None)
    reference = results.get("baseline", {})
    header = (f"{'variant':<18} {'tokens/s':>9} {'x base':>7} {'tok/CPU-s':>10} {'x base':>7} {'tokens/step':>11} "
              f"{'s/step':>7} {'peak RSS MiB':>12} {'train + MiB':>11}")
    print("\n" + header + "\n" + "-" * len(header))
    for name, r in results.items():
        ratio = lambda k: f"{r[k] / reference[k]:.2f}" if reference else "-"  # noqa: E731
        print(f"{name:<18} {r['tokens_per_s']:>9.1f} {ratio('tokens_per_s'):>7} {r['tokens_per_cpu_s']:>10.1f} "
              f"{ratio('tokens_per_cpu_s'):>7} {r['tokens_per_step']:>11.0f} {r['step_s']:>7.2f} "
              f"{r['peak_mib']:>12.0f} {r['train_mib']:>11.0f}")
    print("\nprecision suffixes: " + "; ".join(f"{k or '(none)'} = {v}" for k, v in PRECISIONS.items()))
    if args.profile:
        print("\nmedian CPU seconds per step: forward / loss / backward / optimizer")
        for name, r in results.items():
            p = r["profile"] or {}
            print(f"{name:<18} " + " / ".join(f"{p.get(k, float('nan')):.2f}" for k in
                                              ("forward", "loss", "backward", "optimizer")))
    print(f"\noptimizer: {next(iter(results.values()))['optim'] if results else '-'}; "
          f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
