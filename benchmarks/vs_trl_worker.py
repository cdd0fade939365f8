"""One benchmark run of one workload by one library: TRL or posttrain. Started by vs_trl.py.

    python benchmarks/vs_trl_worker.py SPEC.json      # writes the result JSON to SPEC["out"]

The same script serves both sides so that both run the same configuration, data, seed, reward
function and step clock; only the library the trainer classes come from differs. The TRL side
runs in the benchmark environment (.bench-venv-trl, see setup_trl_env.sh), which has no posttrain,
and imports nothing but trl, transformers, torch and datasets; the posttrain side runs in the
main .venv and never imports trl. Each side checks the other library stayed out of its process.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import sys
import time

# Trainer classes by workload: the module under trl / posttrain.trainers and the class names (and, for TRL's
# experimental trainers, the TRL module).
TRAINERS = {
    "sft": ("sft", "SFTConfig", "SFTTrainer"),
    "dpo": ("dpo", "DPOConfig", "DPOTrainer"),
    "reward": ("reward", "RewardConfig", "RewardTrainer"),
    "grpo": ("grpo", "GRPOConfig", "GRPOTrainer"),
    "rloo": ("rloo", "RLOOConfig", "RLOOTrainer"),
    "online_dpo": ("online_dpo", "OnlineDPOConfig", "OnlineDPOTrainer", "trl.experimental.online_dpo"),
    "orpo": ("orpo", "ORPOConfig", "ORPOTrainer", "trl.experimental.orpo"),
    "cpo": ("cpo", "CPOConfig", "CPOTrainer", "trl.experimental.cpo"),
}
ONLINE = ("grpo", "rloo", "online_dpo")  # trained from prompts with length_reward


def trainer_classes(side: str, kind: str):
    module, config, trainer, trl_module = (*TRAINERS[kind], "trl")[:4]
    lib = importlib.import_module(trl_module if side == "trl" else f"posttrain.trainers.{module}")
    return getattr(lib, config), getattr(lib, trainer)


def make_step_clock():
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Wall-clock times of train begin, each step's begin and end, and every log dict; the process's CPU
        time at each step's end (on a machine with more runnable threads than cores it counts threads
        spinning while they wait for each other, so it does not remove the load; it shows when a step was idle),
        and its minor page faults so far (fresh pages the kernel had to hand out: large tensors freed to the
        system and allocated again pay them every step)."""

        def __init__(self):
            self.train_begin, self.begin, self.end, self.cpu_end, self.logs = None, [], [], [], []
            self.faults_end = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.train_begin = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())
            self.cpu_end.append(time.process_time())
            self.faults_end.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append({k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})

    return StepClock()


def after_first_step(make, summarise):
    """A callback that enters the context `make()` as the second step begins and, when training ends, leaves it
    and sets `table` to `summarise(context, steps)`: a profile of the steps after the first (the steady state)."""
    from transformers import TrainerCallback

    class AfterFirstStep(TrainerCallback):
        def __init__(self):
            self.context, self.table, self.steps = None, None, 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.steps += 1
            if self.steps == 2:
                self.context = make()
                self.context.__enter__()

        def on_train_end(self, args, state, control, **kwargs):
            if self.context is not None:
                self.context.__exit__(None, None, None)
                self.table = summarise(self.context, self.steps - 1)

    return AfterFirstStep()


def make_time_profile(rows: int = 30):
    """torch's profiler over the steps after the first (the steady state): `table` is the operators by
    their own CPU time, summed over those steps. Profiling slows every step: a run for where time goes."""
    from torch.profiler import ProfilerActivity, profile

    def summarise(prof, steps):
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)

    return after_first_step(lambda: profile(activities=[ProfilerActivity.CPU]), summarise)


def product_flops(a, b) -> int:
    """Floating-point operations of the product of `a` (..., M, K) by `b` (..., K, N): 2 x M x K x N per batch."""
    batch_rows = 1
    for d in a.shape[:-1]:
        batch_rows *= d
    return 2 * batch_rows * a.shape[-1] * b.shape[-1]


def make_op_times(rows: int = 25):
    """Every ATen operator's wall time over the steps after the first, taken by a `TorchDispatchMode` (the
    backward's operators included): `table` lists the operators by total time, then the matrix products
    by operand shapes with the GFLOP/s each reached inside the steps. Unlike torch's profiler it keeps
    only running sums (no heap growth); each operator pays a Python call (tens of microseconds), so
    steps run slower: a run for where time goes, not for timing. It sees what a sampling profiler
    cannot split, e.g. the share of attention, whose own small products run inside the operator."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    products = {torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
                torch.ops.aten.addmm_.default, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}

    onednn_linear = getattr(getattr(torch.ops.mkldnn, "_linear_pointwise", None), "default", None)

    class Timed(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.products = {}, {}  # name -> [calls, seconds]; (name, shapes) -> [calls, seconds, flops]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            seconds = time.perf_counter() - start
            name = str(func)
            calls = self.ops.setdefault(name, [0, 0.0])
            calls[0], calls[1] = calls[0] + 1, calls[1] + seconds
            operands = None
            if func in products:  # the operands are the last two tensor arguments
                operands = [x for x in args if isinstance(x, torch.Tensor)][-2:]
            elif func is onednn_linear:  # posttrain's products on non-Intel CPUs: x (..., K) by W^T, W (N, K)
                operands = args[0], args[1].t()
            if operands is not None:
                a, b = operands
                key = (name, tuple(a.shape), tuple(b.shape))
                row = self.products.setdefault(key, [0, 0.0, 0])
                row[0], row[1], row[2] = row[0] + 1, row[1] + seconds, row[2] + product_flops(a, b)
            return out

    def summarise(mode, steps):
        ops, prods = mode.ops, mode.products
        total = sum(s for _, s in ops.values())
        lines = [f"operators over {steps} step(s): {total:.3f} s in {sum(c for c, _ in ops.values())} calls",
                 f"{'seconds':>9} {'share':>6} {'calls':>7}  operator"]
        for name, (calls, seconds) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:rows]:
            lines.append(f"{seconds:9.3f} {seconds / total:6.1%} {calls:7d}  {name}")
        p_seconds, p_flops = sum(r[1] for r in prods.values()), sum(r[2] for r in prods.values())
        if p_seconds > 0:
            lines.append(f"matrix products: {p_seconds:.3f} s, {p_flops / 1e9:.4g} GFLOP, "
                         f"{p_flops / p_seconds / 1e9:.0f} GFLOP/s")
            lines.append(f"{'seconds':>9} {'GFLOP/s':>8} {'calls':>6}  operator (operand shapes)")
            for (name, a, b), (calls, seconds, flops) in sorted(prods.items(), key=lambda kv: -kv[1][1])[:rows]:
                rate = flops / seconds / 1e9 if seconds > 0 else float("nan")
                lines.append(f"{seconds:9.3f} {rate:8.0f} {calls:6d}  {name} {a} x {b}")
        return "\n".join(lines)

    return after_first_step(Timed, summarise)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """This process's own peak RSS: VmHWM, the high-water mark of its address space. Not getrusage's
    ru_maxrss, which Linux carries over exec from the parent's address space (a vfork-ed child execs from
    the parent's): a worker started by vs_trl.py would report at least vs_trl.py's own peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_breakdown(prof, largest: int = 10) -> dict:
    """What the CPU tensors held at the moment their total peaked, from torch's memory profiler.

    MiB by the profiler's category (parameter, optimizer_state, gradient, activation: saved for
    backward, temporary, input, autograd_detail, uncategorized) and the largest live tensors with
    theirs. Replays the profiler's allocation timeline (torch 2.13's `_memory_profile`, the data
    behind `export_memory_timeline`); tensors made before profiling started count once touched."""
    from collections import Counter

    from torch.profiler._memory_profiler import Action

    profile = prof._memory_profile()
    events = [(action, key, version, size) for _, action, (key, version), size in profile.timeline
              if key.device.type == "cpu"]

    def replay(stop):  # live tensors after events[:stop]; the peak total and the event it came at
        live, total, peak, at = {}, 0, 0, 0
        for i, (action, key, version, size) in enumerate(events[:stop]):
            if action in (Action.PREEXISTING, Action.CREATE):
                live[key], total = (size, version), total + size
            elif action == Action.INCREMENT_VERSION:
                live[key] = (size, version + 1)
            elif action == Action.DESTROY and live.pop(key, None) is not None:
                total -= size
            if total > peak:
                peak, at = total, i + 1
        return live, peak, at

    _, peak, at = replay(len(events))
    live, _, _ = replay(at)

    def category(key, version):
        found = profile._categories.get(key, version)
        return found.name.lower() if found is not None else "uncategorized"

    tensors = sorted(((size, category(key, version)) for key, (size, version) in live.items()), reverse=True)
    by_category = Counter()
    for size, name in tensors:
        by_category[name] += size
    return {"peak_tensor_mib": peak / 2**20, "tensors": len(tensors),
            "by_category_mib": {k: v / 2**20 for k, v in by_category.most_common()},
            "largest_mib": [[size / 2**20, name] for size, name in tensors[:largest]]}


def start() -> dict:
    """The run's spec (the JSON file named by the first argument), with torch's thread count and seed set from it."""
    spec = json.load(open(sys.argv[1]))
    import torch

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    return spec


def common_args(spec: dict) -> dict:
    """The configuration fields every workload's run gets besides its own: the spec's output folder, steps and seed,
    a log every step, nothing saved, no progress bar, on CPU (gpu_check.py sets use_cpu False: CUDA)."""
    return dict(output_dir=spec["output_dir"], max_steps=spec["steps"], logging_steps=1, report_to="none",
                save_strategy="no", disable_tqdm=True, seed=spec["seed"], dataloader_pin_memory=False,
                use_cpu=spec.get("use_cpu", True))


def train_and_measure(trainer, spec: dict) -> dict:
    """Run `trainer.train()` under the step clock, and the profilers the spec asks for (`time_profile`, `op_times`,
    `memory_profile`), and return the result fields every worker writes: the clock's times, peak RSS, the
    library versions, the arithmetic; the item counts (`sft_tokens`, `samples`, `completion_tokens`) empty, for
    the worker to fill in."""
    import torch

    side = spec["side"]
    clock = make_step_clock()
    trainer.add_callback(clock)
    timed = make_time_profile() if spec.get("time_profile") else None
    op_times = make_op_times() if spec.get("op_times") else None
    for callback in (timed, op_times):
        if callback is not None:
            trainer.add_callback(callback)
    rss_before = rss_mib()
    profiler = None
    if spec.get("memory_profile"):  # slows every step: a run for where memory goes, not for time
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True)
        profiler.__enter__()
    start_time = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start_time
    peak_rss = peak_rss_mib()  # before the breakdown's own memory
    if profiler is not None:
        profiler.__exit__(None, None, None)
    check_no_peer_imported(side)
    versions = {m: importlib.import_module(m).__version__ for m in ("torch", "transformers", "datasets")}
    versions[side] = importlib.import_module(side).__version__ if side == "trl" else _posttrain_version()
    args, model = trainer.args, trainer.model
    return {
        "side": side, "workload": spec["workload"], "versions": versions,
        "train_begin": clock.train_begin - start_time if clock.train_begin else None,
        "step_begin": [t - start_time for t in clock.begin], "step_end": [t - start_time for t in clock.end],
        "step_cpu_end": clock.cpu_end, "step_faults_end": clock.faults_end, "train_seconds": train_seconds,
        "sft_tokens": [], "samples": [], "completion_tokens": [], "logs": clock.logs,
        "peak_rss_mib": peak_rss, "rss_before_train_mib": rss_before,
        # on CUDA: the most memory torch's allocator held for tensors (model, optimizer, activations)
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else None,
        "memory_breakdown": memory_breakdown(profiler) if profiler is not None else None,
        "time_profile": timed.table if timed is not None else None,
        "op_times": op_times.table if op_times is not None else None,
        # posttrain: whether its trainer tuned glibc's malloc (posttrain/accel/memory.py; POSTTRAIN_KEEP_FREED_MEMORY=0 stops it)
        **({"keep_freed_memory": trainer._heap_kept} if side == "posttrain" else {}),
        "threads": torch.get_num_threads(), "batch_size": args.per_device_train_batch_size,
        "dtype": str(next(model.parameters()).dtype), "precision": precision(args, model),
        "gradient_checkpointing": bool(args.gradient_checkpointing),
    }


def write_result(spec: dict, result: dict) -> None:
    with open(spec["out"], "w") as f:
        json.dump(result, f)


def main():
    spec = start()
    from datasets import Dataset

    side, kind, cfg = spec["side"], spec["trainer"], spec["config"]
    Config, Trainer = trainer_classes(side, kind)
    rows = json.load(open(spec["data"]))
    images = bool(rows) and "images" in rows[0]
    if images:  # vision rows name their images' files: both sides get the same PIL images
        from PIL import Image

        rows = [{**row, "images": [Image.open(path).convert("RGB") for path in row["images"]]} for row in rows]
    data = Dataset.from_list(rows)
    if kind == "online_dpo" and side == "posttrain":  # TRL's batch counts prompts (2 completions each), ours completions
        cfg = {**cfg, "per_device_train_batch_size": 2 * cfg["per_device_train_batch_size"]}
    args = Config(**common_args(spec), **cfg)

    counts: list[int] = []  # SFT: real tokens of each batch, in the order the trainer asks for them
    samples: list[int] = []  # GRPO/RLOO: completions scored per reward call
    completion_tokens: list[int] = []  # GRPO/RLOO: their lengths, where the library passes completion_ids

    def length_reward(completions, completion_ids=None, **kwargs):
        """Characters / 100 of the completion text (the last message's, for conversational data)."""
        samples.append(len(completions))
        if completion_ids is not None:
            completion_tokens.extend(len(c) for c in completion_ids)
        return [len(c[-1]["content"] if isinstance(c, list) else c) / 100 for c in completions]

    if kind in ONLINE:
        from transformers import AutoProcessor, AutoTokenizer

        # TRL's OnlineDPOTrainer requires the tokenizer; a vision workload's model takes its processor; posttrain
        # loads its own from the model (which may be a built-in name that transformers cannot resolve)
        tokenizer = None if side == "posttrain" else (AutoProcessor if images else AutoTokenizer).from_pretrained(
            spec["model"])
        trainer = Trainer(model=spec["model"], reward_funcs=length_reward, args=args, train_dataset=data,
                          processing_class=tokenizer)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec["model"])
        trainer = Trainer(model=spec["model"], args=args, train_dataset=data, processing_class=tokenizer)
    if kind == "sft":
        inner = trainer.data_collator

        def collate(batch):
            counts.append(sum(len(r["input_ids"]) for r in batch))
            return inner(batch)

        trainer.data_collator = collate
    result = train_and_measure(trainer, spec)
    write_result(spec, {**result, "sft_tokens": counts, "samples": samples, "completion_tokens": completion_tokens})


def check_no_peer_imported(side: str) -> None:
    """Stop the run if this side's process imported the other library (each side runs alone)."""
    other = "posttrain" if side == "trl" else "trl"
    leaked = sorted(m for m in sys.modules if m == other or m.startswith(other + "."))
    if leaked:
        raise SystemExit(f"the {side} side imported {other}: {leaked[:5]}")


def precision(args, model) -> str:
    """The arithmetic the steps ran in: the weights' dtype, or the autocast dtype over it."""
    return "bf16 autocast" if args.bf16 else "fp16 autocast" if args.fp16 else str(next(model.parameters()).dtype)


def _posttrain_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("posttrain")


if __name__ == "__main__":
    main()
