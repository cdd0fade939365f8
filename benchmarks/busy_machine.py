"""A busy machine: how much slower posttrain trains while other processes hold part of the CPU.

Runs the same GRPO workload (tiny-qwen2 on the `reverse` task: `--steps` steps of 8 prompts x 8 samples,
8 new tokens, from step 0) in a fresh process, once on the otherwise idle machine and once beside `--busy`
processes that spin in a busy loop, each with posttrain's thread setup (`posttrain/accel/threads.py`: threads from
the affinity mask and the cgroup quota, a short OpenMP spin, the count fitted when the run starts to the CPUs
the other processes leave free), with that count fixed instead ("fixed count"), with libgomp's defaults
(OMP_NUM_THREADS = the CPUs, GOMP_SPINCOUNT 300,000: what runs did before), and with one thread. Reported per setting: the wall time and the CPU
time the workload used, its slowdown against the idle run, and the fair-share bound -- the slowdown of a
process that loses only its share of the CPU: with T threads beside N busy loops on C CPUs it gets
C * T / (T + N) CPUs, so the bound is max(1, (T + N) / C) for a workload that kept its T threads busy.

Compare the slowdown with the bound on a machine that is otherwise idle (the busy loops are the only
other load); on a machine loaded by unknown others, the figures mean nothing.

    python benchmarks/busy_machine.py [--steps 6] [--busy 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import time

SETUPS = {  # name -> environment of the workload process
    "posttrain threads": {},
    "fixed count": {"POSTTRAIN_FIT_THREADS": "0"},
    "libgomp defaults": {"POSTTRAIN_THREADS": "", "POSTTRAIN_FIT_THREADS": "0", "GOMP_SPINCOUNT": "300000"},
    "one thread": {"POSTTRAIN_THREADS": "1"},
}


def workload(steps: int) -> dict:
    """Train `steps` GRPO steps; wall and CPU seconds of the training alone (model loading excluded)."""
    import torch

    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.tasks.builtin import digit_match_reward, task_dataset

    args = GRPOConfig(output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "busy_machine_bench"),
                      max_steps=steps, learning_rate=1e-3, per_device_train_batch_size=64, num_generations=8,
                      max_completion_length=8, report_to="none", save_strategy="no", disable_tqdm=True,
                      logging_steps=steps, seed=0)
    trainer = GRPOTrainer(model="posttrain/tiny-qwen2", reward_funcs=digit_match_reward, args=args,
                          train_dataset=task_dataset("reverse", "train").remove_columns("completion"))
    usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    trainer.train()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    return {"wall": wall, "cpu": cpu, "threads": torch.get_num_threads()}


def _spin():
    while True:
        pass


def measure(setup: str, steps: int, busy: int) -> dict:
    """One workload process under `setup` beside `busy` busy loops."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update({k: v for k, v in SETUPS[setup].items() if v}, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if setup == "libgomp defaults":  # one thread per CPU of the affinity mask, as libgomp and torch choose
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    loops = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
    for loop in loops:
        loop.start()
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", "--steps", str(steps)], env=env,
                             capture_output=True, text=True, check=True)
    finally:
        for loop in loops:
            loop.terminate()
            loop.join()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the workload")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(workload(args.steps)))
        return
    cpus = len(os.sched_getaffinity(0))
    print(f"{cpus} CPUs, load average {os.getloadavg()[0]:.1f} before the runs; GRPO, {args.steps} steps")
    print("| setup | busy loops | threads | wall s | CPU s | slowdown | fair-share bound |")
    print("|---|---|---|---|---|---|---|")
    for setup in SETUPS:
        quiet = measure(setup, args.steps, 0)
        for busy, result in ((0, quiet), (args.busy, measure(setup, args.steps, args.busy))):
            bound = max(1.0, (result["threads"] + busy) / cpus) if busy else 1.0
            print(f"| {setup} | {busy} | {result['threads']} | {result['wall']:.1f} | {result['cpu']:.1f} | "
                  f"{result['wall'] / quiet['wall']:.2f}x | {bound:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
