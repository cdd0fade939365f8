"""Asynchronous rollouts against the synchronous engine when the reward waits on I/O.

A reward function that sleeps `--sleep` seconds per call (as a code sandbox or an HTTP judge waits) scores
GRPO's completions on the built-in `reverse` task; the same run is timed with max_staleness=0 (sample, score,
then train) and max_staleness=1 (the next batch sampled and scored in the background while this one trains),
back to back, `--rounds` times alternating. Sleep-bound work is what overlaps, so the ratio of the two
rates is meaningful even on a loaded machine; the absolute figures are not.

    python benchmarks/async_rollouts.py --steps 8 --sleep 0.5 --rounds 2
"""

from __future__ import annotations

import argparse
import tempfile
import time


def sleeping_digit_match(completions, answer, **kwargs):
    """digit_match_reward after waiting `SLEEP` seconds, as an I/O-bound judge does."""
    from posttrain.tasks.builtin import digit_match_reward

    time.sleep(SLEEP)
    return digit_match_reward(completions, answer=answer)


SLEEP = 0.5


def run(staleness: int, steps: int, batch: int) -> tuple[float, float]:
    """(steps per second of train(), mean rollout/wait_time) for one run."""
    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.tasks.builtin import task_dataset

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=batch, num_generations=8, max_steps=steps,
                          max_completion_length=8, learning_rate=1e-3, logging_steps=1, report_to="none",
                          disable_tqdm=True, max_staleness=staleness, seed=0)
        trainer = GRPOTrainer("posttrain/tiny-qwen2", sleeping_digit_match, args=args,
                              train_dataset=task_dataset("reverse", "train").remove_columns("completion"))
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        waits = [e["rollout/wait_time"] for e in trainer.state.log_history if "rollout/wait_time" in e]
    return steps / seconds, sum(waits) / len(waits) if waits else float("nan")


def main():
    global SLEEP
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sleep", type=float, default=0.5, help="seconds the reward function waits per call")
    parser.add_argument("--batch", type=int, default=64, help="completions per step (per_device_train_batch_size)")
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args()
    SLEEP = options.sleep
    rates = {0: [], 1: []}
    for r in range(options.rounds):
        for staleness in (0, 1):
            rate, wait = run(staleness, options.steps, options.batch)
            rates[staleness].append(rate)
            print(f"round {r}: max_staleness={staleness}: {rate:.3f} steps/s"
                  + (f", mean rollout/wait_time {wait:.3f} s" if staleness else ""), flush=True)
    for r, (sync, async_) in enumerate(zip(rates[0], rates[1])):
        print(f"round {r}: async / sync = {async_ / sync:.2f}x")


if __name__ == "__main__":
    main()
