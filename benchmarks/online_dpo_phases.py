"""CPU seconds per phase of the `online_dpo` workload of vs_trl.py (posttrain's side), steps after the first.

    python benchmarks/online_dpo_phases.py [--steps 4] [--threads 1] [--trainer online_dpo|xpo|nash_md]

The same trainer, configuration, data, seed and reward as vs_trl.py's worker runs; each phase is timed by
wrapping the trainer's methods (process CPU time, so a loaded machine inflates it less than wall time):
sampling, decoding and rewards, the reference forward, the rest of build_experience, the policy's forward
(compute_loss) and backward, the gradient clipping and the optimizer step. Prints the mean per steady step,
the first loss, the completion lengths and the peak RSS.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trainer", default="online_dpo", choices=("online_dpo", "xpo", "nash_md"))
    parser.add_argument("--ops", action="store_true", help="also list the operators of the last step by phase and "
                        "operand shapes (slower: a Python call per operator)")
    parser.add_argument("--python-profile", help="a phase label: cProfile that phase in the last step and print "
                        "the functions by own time")
    parser.add_argument("--ops-rows", type=int, default=60, help="how many operator rows --ops lists")
    parser.add_argument("--cache", default=os.path.join(Path.home(), ".cache", "posttrain", "vs-trl"))
    args = parser.parse_args()
    # fixed before torch loads, as vs_trl.py runs its workers (else posttrain fits the count to the free CPUs)
    os.environ.update(OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                      HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")

    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(HERE))
    import vs_trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from posttrain.trainers import nash_md, online_dpo, xpo

    torch.manual_seed(vs_trl.SEED)
    models = vs_trl.prepare_models(Path(args.cache))
    rows = json.loads(Path(args.cache, "prompts.json").read_text())
    classes = {"online_dpo": (online_dpo.OnlineDPOConfig, online_dpo.OnlineDPOTrainer),
               "xpo": (xpo.XPOConfig, xpo.XPOTrainer), "nash_md": (nash_md.NashMDConfig, nash_md.NashMDTrainer)}
    Config, Trainer = classes[args.trainer]
    cfg = dict(vs_trl.WORKLOADS["online_dpo"]["config"])
    cfg["per_device_train_batch_size"] *= 2  # completions, as the worker counts them
    config = Config(output_dir="/tmp/online_dpo_phases", max_steps=args.steps, logging_steps=1, report_to="none",
                    save_strategy="no", disable_tqdm=True, seed=vs_trl.SEED, dataloader_pin_memory=False,
                    use_cpu=True, gradient_checkpointing=False, bf16=False, **cfg)
    lengths = []

    def length_reward(completions, completion_ids=None, **kwargs):
        lengths.extend(len(c) for c in completion_ids)
        return [len(c[-1]["content"] if isinstance(c, list) else c) / 100 for c in completions]

    trainer = Trainer(model=models["causal"], reward_funcs=length_reward, args=config,
                      train_dataset=Dataset.from_list(rows))

    seconds, wall, faults, stack = defaultdict(float), defaultdict(float), defaultdict(int), []
    ops = OpTimes() if args.ops else None
    profiler = cProfile.Profile() if args.python_profile else None

    def timed(obj, name, label):
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            start, begun, faulted = time.process_time(), time.perf_counter(), minor_faults()
            stack.append([0.0, 0.0, 0])
            if ops is not None:
                ops.phases.append(label)
            profiling = profiler is not None and label == args.python_profile and len(steps) == args.steps
            if profiling:
                profiler.enable()
            try:
                return inner(*a, **k)
            finally:
                if profiling:
                    profiler.disable()
                if ops is not None:
                    ops.phases.pop()
                spent, elapsed = time.process_time() - start, time.perf_counter() - begun
                faulted = minor_faults() - faulted
                nested = stack.pop()
                seconds[label] += spent - nested[0]  # own time: nested timed calls count under their own label
                wall[label] += elapsed - nested[1]
                faults[label] += faulted - nested[2]
                if stack:
                    stack[-1][0] += spent
                    stack[-1][1] += elapsed
                    stack[-1][2] += faulted

        setattr(obj, name, wrapper)

    timed(trainer, "sample_completions", "sample")
    timed(trainer, "decode", "decode")
    class Scorer:  # the reward scorer, its calls timed
        def __init__(self, scorer):
            self.scorer = self.score = scorer

        def __getattr__(self, name):
            return getattr(self.scorer, name)

        def __call__(self, *a, **k):
            return self.score(*a, **k)

    trainer.reward_scorer = Scorer(trainer.reward_scorer)
    timed(trainer.reward_scorer, "score", "reward")
    timed(trainer, "_no_grad_forward", "reference forward")
    timed(trainer, "build_experience", "build_experience (rest)")
    timed(trainer, "make_experience", "make_experience (rest)")
    timed(trainer, "compute_loss", "policy forward + loss")
    timed(trainer, "training_step", "backward + step overhead")
    timed(trainer, "_clip_grad_norm", "clip")
    steps, first, system = [], {}, []  # system: per step, (system CPU s, minor faults)

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if ops is not None and state.global_step == args.steps - 1:
                ops.__enter__()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            system.append([usage.ru_stime, usage.ru_minflt])
            steps.append([time.process_time(), None, dict(seconds), time.perf_counter(), dict(wall), dict(faults)])

        def on_pre_optimizer_step(self, a, state, control, **kw):
            self.opt = time.process_time(), time.perf_counter()

        def on_optimizer_step(self, a, state, control, **kw):
            seconds["optimizer"] += time.process_time() - self.opt[0]
            wall["optimizer"] += time.perf_counter() - self.opt[1]

        def on_step_end(self, a, state, control, **kw):
            if ops is not None and state.global_step == args.steps:
                ops.__exit__(None, None, None)
            usage = resource.getrusage(resource.RUSAGE_SELF)
            system[-1] = [usage.ru_stime - system[-1][0], usage.ru_minflt - system[-1][1]]
            steps[-1][1] = time.process_time()
            steps[-1] += [dict(seconds), time.perf_counter(), dict(wall), dict(faults)]

        def on_log(self, a, state, control, logs=None, **kw):
            if "loss" in (logs or {}) and not first:
                first.update(logs)

    trainer.add_callback(Clock())
    trainer.train()
    # per step: CPU begin, end, own CPU s by phase before; wall begin, by phase; faults by phase; after: the same
    steady = steps[1:]
    n = len(steady)
    per_step = sum(s[1] - s[0] for s in steady) / n
    per_wall = sum(s[7] - s[3] for s in steady) / n
    print(f"{args.trainer}: {n} steady steps, {per_step:.3f} CPU s/step, {per_wall:.3f} s wall, "
          f"first loss {first.get('loss')!r}, "
          f"completion lengths {lengths}; of which system CPU s/step "
          f"{sum(s for s, _ in system[1:]) / n:.3f}, minor page faults/step {sum(f for _, f in system[1:]) / n:.0f}")
    labels = sorted(seconds, key=lambda k: -seconds[k])
    counted = [0.0, 0.0]
    print("  CPU s  share   wall s   faults  phase")
    for label in labels:
        spent = sum(s[6].get(label, 0.0) - s[2].get(label, 0.0) for s in steady) / n
        faulted = sum(s[9].get(label, 0) - s[5].get(label, 0) for s in steady) / n
        elapsed = sum(s[8].get(label, 0.0) - s[4].get(label, 0.0) for s in steady) / n
        counted = [counted[0] + spent, counted[1] + elapsed]
        print(f"  {spent:6.3f} {spent / per_step:6.1%}  {elapsed:6.3f}  {faulted:7.0f}  {label}")
    print(f"  {per_step - counted[0]:6.3f} {(per_step - counted[0]) / per_step:6.1%}  {per_wall - counted[1]:6.3f}  "
          "         other (guard, logging, data)")
    with open("/proc/self/status") as f:
        print(f"  peak RSS {int(next(l.split()[1] for l in f if l.startswith('VmHWM:'))) / 1024:.0f} MiB")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    if ops is not None:
        totals = defaultdict(lambda: [0, 0.0])
        for (phase, _, _), (calls, spent) in ops.table.items():
            totals[phase][0] += calls
            totals[phase][1] += spent
        print("the last step's operators by phase (wall seconds, calls):")
        for phase, (calls, spent) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
            print(f"  {spent:7.4f} {calls:6d}  {phase}")
        print("the last step's operators (wall seconds, calls) by phase and operand shapes:")
        for (phase, name, shapes), (calls, spent) in sorted(ops.table.items(), key=lambda kv: -kv[1][1])[:args.ops_rows]:
            print(f"  {spent:7.4f} {calls:5d}  {phase:26s} {name} {shapes}")


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def OpTimes():
    """A dispatch mode summing each operator's wall time by (phase, operator, operand shapes)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.phases, self.table = [], {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            spent = time.perf_counter() - start
            shapes = tuple(tuple(x.shape) for x in args if isinstance(x, torch.Tensor))
            key = (self.phases[-1] if self.phases else "-", str(func), shapes)
            row = self.table.setdefault(key, [0, 0.0])
            row[0], row[1] = row[0] + 1, row[1] + spent
            return out

    return Mode()


if __name__ == "__main__":
    main()
