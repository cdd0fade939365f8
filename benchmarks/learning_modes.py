"""Learning runs of DAPO's overlong reward shaping and of each importance-sampling correction mode.

Each run is GRPO from the partially SFT-trained tiny model (tests/trainers/conftest.py `sft_reverse`: held-out
greedy accuracy about 0.2) on the built-in `reverse` task, `--steps` steps of 8 prompts x 8 samples (the
learning tests' settings, tests/helpers/online.py `learning_args`), and prints the held-out greedy accuracy and
the sampled digit_match reward (100 test prompts) before and after:

  overlong           `overlong_buffer_len=4`, `overlong_penalty_factor=1.0` with `max_completion_length=10`:
                     completions longer than 6 tokens (a correct one is " dddd" + EOS) lose up to 1;
  token_truncate,    `use_vllm=True` with each `vllm_importance_sampling_mode`. No GPU here, so the engine is a
  token_mask,        stand-in (tests/helpers/engine.py `RoundedEngine`): posttrain's sampler on a copy of the
  sequence_truncate, policy whose weights each sync rounds to `--precision` (bf16, or fp8 with a scale per
  sequence_mask      tensor), so the behaviour log-probs differ from the float32 trainer's as an inference
                     engine's do, and the correction has something to correct; `--clip_min` / `--clip_max`
                     narrow its caps (TRL's defaults: none and 3) so that they bite;
  async_vllm         sequence_mask with `max_staleness=1`: the stand-in engine synced from the background
                     sampler's copy, one step behind.

    python benchmarks/learning_modes.py --steps 60                    # every mode
    python benchmarks/learning_modes.py --steps 60 --modes overlong,token_mask
    python benchmarks/learning_modes.py --steps 60 --precision fp8 --clip_min 0.97 --clip_max 1.03 \
        --modes token_truncate,token_mask,sequence_truncate,sequence_mask
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's tests/

MODES = {
    "overlong": dict(max_completion_length=10, overlong_buffer_len=4, overlong_penalty_factor=1.0),
    "token_truncate": dict(use_vllm=True, vllm_importance_sampling_mode="token_truncate"),
    "token_mask": dict(use_vllm=True, vllm_importance_sampling_mode="token_mask"),
    "sequence_truncate": dict(use_vllm=True, vllm_importance_sampling_mode="sequence_truncate"),
    "sequence_mask": dict(use_vllm=True, vllm_importance_sampling_mode="sequence_mask"),
    "async_vllm": dict(use_vllm=True, vllm_importance_sampling_mode="sequence_mask", max_staleness=1),
}


def use_rounded_engine(seed: int, precision: str):
    """`use_vllm=True` builds the stand-in engine (tests/helpers/engine.py)."""
    from tests.helpers.engine import engine_patches

    from posttrain.rollout import vllm_engine

    for name, value in engine_patches(seed, precision).items():
        setattr(vllm_engine, name, value)


def mean_logged(trainer, key: str) -> float | None:
    values = [e[key] for e in trainer.state.log_history if key in e]
    return sum(values) / len(values) if values else None


def run(mode: str, model_path: str, steps: int, out: str, **caps) -> tuple[tuple, tuple, dict]:
    """(held-out (greedy accuracy, sampled reward) before, the same after, the run's mean of a few metrics)."""
    from tests.helpers.online import heldout_scores, learning_args

    from posttrain.tasks.builtin import digit_match_reward, task_dataset
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    train = task_dataset("reverse", "train").remove_columns("completion")
    fields = {**learning_args(out, num_generations=8, max_steps=steps), **MODES[mode]}
    if fields.get("use_vllm"):
        fields.update({f"vllm_importance_sampling_{k}": v for k, v in caps.items() if v is not None})
    trainer = GRPOTrainer(model_path, digit_match_reward, train_dataset=train, args=GRPOConfig(**fields))
    before = heldout_scores(trainer)
    trainer.train()
    after = heldout_scores(trainer)
    means = {k: mean_logged(trainer, k) for k in ("shaping/overlong", "completions/mean_length",
                                                   "sampling/sampling_logp_difference/mean",
                                                   "sampling/importance_sampling_ratio/mean", "rollout/staleness")}
    return before, after, {k: v for k, v in means.items() if v is not None}


def line(mode: str, before: tuple, after: tuple, means: dict) -> str:
    shown = ", ".join(f"{k} {v:.4g}" for k, v in means.items())
    return (f"{mode:18s} held-out greedy accuracy {before[0]:.2f} -> {after[0]:.2f}, sampled reward "
            f"{before[1]:.3f} -> {after[1]:.3f} (mean over the run: {shown})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--precision", choices=["bf16", "fp8"], default="bf16", help="the stand-in engine's weights")
    parser.add_argument("--clip_min", type=float, default=None, help="vllm_importance_sampling_clip_min")
    parser.add_argument("--clip_max", type=float, default=None, help="vllm_importance_sampling_clip_max")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    options = parser.parse_args()
    modes = options.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose among {list(MODES)}")
    from tests.trainers.conftest import sft_reverse

    use_rounded_engine(seed=42, precision=options.precision)
    with tempfile.TemporaryDirectory() as folder:
        model, tok = sft_reverse()
        model.save_pretrained(f"{folder}/sft")
        tok.save_pretrained(f"{folder}/sft")
        for mode in modes:
            result = run(mode, f"{folder}/sft", options.steps, f"{folder}/{mode}", clip_min=options.clip_min,
                         clip_max=options.clip_max)
            print(line(mode, *result), flush=True)


if __name__ == "__main__":
    main()
