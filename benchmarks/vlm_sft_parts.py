"""vlm_sft's posttrain side in one process, for finding where its step goes: CPU seconds per step, the losses,
and optionally an operator profile with shapes. Uses the model folder and rows `vs_trl.py --only vlm_sft` made.

    python benchmarks/vlm_sft_parts.py [--steps 6] [--threads 1] [--profile] [--cache ~/.cache/posttrain/vs-trl]

Prints each step's CPU and wall seconds, the median CPU seconds of the steps after the first, the logged losses
(full precision) and, with --profile, the torch profiler's table (by operator and input shapes) of the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--cache", default=os.path.join(Path.home(), ".cache", "posttrain", "vs-trl"))
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from PIL import Image
    from transformers import AutoProcessor, TrainerCallback

    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cache = Path(args.cache)
    model, rows = str(cache / "llava-smollm2-random"), json.load(open(cache / "vlm-rows.json"))
    for row in rows:
        row["images"] = [Image.open(p).convert("RGB") for p in row["images"]]
    config = SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=args.steps, logging_steps=1, report_to="none",
                       save_strategy="no", disable_tqdm=True, seed=0, dataloader_pin_memory=False, use_cpu=True,
                       remove_unused_columns=False, per_device_train_batch_size=4, max_length=None,
                       learning_rate=1e-5, gradient_checkpointing=False, bf16=False)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoProcessor.from_pretrained(model))

    class Clock(TrainerCallback):
        """CPU seconds of each step from the previous step's end (data included), split at the hooks: data
        (before on_step_begin), forward + backward + clipping, the optimizer, the rest (zero_grad, scheduler)."""

        def __init__(self):
            self.marks, self.wall, self.losses, self.profiler = [], [], [], None

        def mark(self, name):
            self.marks.append((name, time.process_time(), time.perf_counter()))

        def on_train_begin(self, a, state, control, **kwargs):
            self.mark("end")

        def on_step_begin(self, a, state, control, **kwargs):
            self.mark("begin")
            if args.profile and state.global_step == args.steps - 1:
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                       record_shapes=True)
                self.profiler.__enter__()

        def on_pre_optimizer_step(self, a, state, control, **kwargs):
            self.mark("pre_opt")

        def on_optimizer_step(self, a, state, control, **kwargs):
            self.mark("opt")

        def on_step_end(self, a, state, control, **kwargs):
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
            self.mark("end")

        def on_log(self, a, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

        def steps(self):
            """[(total cpu, total wall, data, fwd+bwd+clip, optimizer, rest)] per step."""
            out = []
            for i in range(0, len(self.marks) - 4, 4):
                (_, c0, w0), (_, c1, _), (_, c2, _), (_, c3, _), (_, c4, w4) = self.marks[i:i + 5]
                out.append((c4 - c0, w4 - w0, c1 - c0, c2 - c1, c3 - c2, c4 - c3))
            return out

    clock = Clock()
    parts = {"forward+loss": [], "clipping": []}  # CPU seconds of each call, the backward is what is left

    def timed(name, method):
        def run(*a, **k):
            start = time.process_time()
            out = method(*a, **k)
            parts[name].append(time.process_time() - start)
            return out
        return run

    trainer.compute_loss = timed("forward+loss", trainer.compute_loss)
    trainer._clip_grad_norm = timed("clipping", trainer._clip_grad_norm)
    trainer.add_callback(clock)
    trainer.train()
    steps = clock.steps()
    for name, k in (("cpu", 0), ("wall", 1), ("data", 2), ("fwd+bwd+clip", 3), ("optimizer", 4), ("rest", 5)):
        values = [s[k] for s in steps]
        print(f"{name:>13} s per step: " + " ".join(f"{v:.3f}" for v in values)
              + f"   steady median {statistics.median(values[1:]):.3f}")
    for name, values in parts.items():
        print(f"{name:>13} s per step: " + " ".join(f"{v:.3f}" for v in values)
              + f"   steady median {statistics.median(values[1:]):.3f}")
    print("losses:", clock.losses)
    if clock.profiler is not None:
        print(clock.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows,
                                                  max_name_column_width=50))
        print(clock.profiler.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total",
                                                                           row_limit=args.rows, max_name_column_width=40,
                                                                           max_shapes_column_width=90))


if __name__ == "__main__":
    main()
