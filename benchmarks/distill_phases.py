"""Where a distillation step's CPU time goes, phase by phase: the `distillation` workload of vs_trl.py (posttrain's
side: SmolLM2-135M student, its perturbed teacher, 8 rows, 32 new tokens, top_p 0.95), one thread by default.

    python benchmarks/distill_phases.py [--steps 4] [--threads 1] [--cprofile N]

Each phase's CPU seconds (process time) summed over the steps after the first: sampling (`generate`), the teacher's
forward, the student's forward, the divergence, the backward and the optimizer (the rest of the step), with the
first loss and mean completion length to compare runs. `--cprofile N`: also the N functions of most cumulative time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cprofile", type=int, default=0)
    args = parser.parse_args()

    import vs_trl
    cache = Path.home() / ".cache" / "posttrain" / "vs-trl"
    models = vs_trl.prepare_models(cache)
    data, _ = vs_trl.prepare_data(cache, models["causal"])
    workload = vs_trl.WORKLOADS["distillation"]
    scratch = Path(tempfile.mkdtemp())
    spec = {"side": "posttrain", "workload": "distillation", "trainer": "distillation",
            "config": {**workload["config"], "gradient_checkpointing": False, "bf16": False},
            "model": models["causal"], "models": models, "data": data[workload["data"]], "steps": args.steps,
            "threads": args.threads, "seed": vs_trl.SEED, "output_dir": str(scratch / "out")}
    import torch
    torch.set_num_threads(args.threads)
    torch.manual_seed(spec["seed"])
    import vs_trl_distill_worker as worker
    trainer, _ = worker.build(spec)

    import posttrain.trainers.distillation as dist
    from posttrain.trainers import online
    spent: dict[str, float] = defaultdict(float)
    state = {"step": 0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            start = time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                if state["step"] > 0:
                    spent[name] += time.process_time() - start
        return wrapper

    def logits(model, mb, *a, _inner=dist.completion_logits, **kw):
        name = "student forward" if torch.is_grad_enabled() else "teacher forward"
        return timed(name, _inner)(model, mb, *a, **kw)

    dist.completion_logits = logits
    dist.token_divergence = timed("divergence (forward)", dist.token_divergence)
    trainer.roll_out = timed("sampling (roll_out)", trainer.roll_out)
    trainer.make_experience = timed("make_experience (all)", trainer.make_experience)
    trainer.training_step = timed("training_step (all)", trainer.training_step)
    trainer.optimizer_step_time = 0.0
    losses, lengths = [], []

    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, a, s, c, **kw):
            self.start = time.process_time()

        def on_step_end(self, a, s, c, **kw):
            if state["step"] > 0:
                spent["whole step"] += time.process_time() - self.start
            state["step"] += 1

        def on_log(self, a, s, c, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    trainer.add_callback(Clock())
    import gc
    collecting = {}

    def gc_clock(phase, info):  # the cyclic garbage collector's passes, by generation
        if phase == "start":
            collecting["at"] = time.process_time()
        elif state["step"] > 0:
            spent[f"gc generation {info['generation']}"] += time.process_time() - collecting["at"]

    gc.callbacks.append(gc_clock)
    profiler = None
    if args.cprofile:
        import cProfile
        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
    trainer.train()
    if profiler is not None:
        profiler.disable()
    n = args.steps - 1
    print(f"CPU s per step over {n} steps after the first ({args.threads} thread(s)):")
    for name, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {s / n:8.3f}  {name}")
    print("losses", losses)
    print("mean lengths", lengths)
    if profiler is not None:
        import pstats
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.cprofile)
    _ = online


if __name__ == "__main__":
    main()
