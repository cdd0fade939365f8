"""Learning runs of DAPO's overlong reward shaping and of each importance-sampling correction mode.

Each run is GRPO from the partially SFT-trained tiny model (tests/trainers/conftest.py `sft_reverse`: held-out
greedy accuracy about 0.2) on the built-in `reverse` task, `--steps` steps of 8 prompts x 8 samples (the
learning tests' settings, tests/helpers/online.py `learning_args`), and prints the held-out greedy accuracy and
the sampled digit_match reward (100 test prompts) before and after:

  overlong           `overlong_buffer_len=4`, `overlong_penalty_factor=1.0` with `max_completion_length=10`:
                     completions longer than 6 tokens (a correct one is " dddd" + EOS) lose up to 1;
  token_truncate,    `use_vllm=True` with each `vllm_importance_sampling_mode`. No GPU here, so the engine is a
  token_mask,        stand-in (`RoundedEngine`): posttrain's sampler on a copy of the policy whose weights each
  sequence_truncate, sync rounds to bfloat16, so the behaviour log-probs differ from the float32 trainer's as a
  sequence_mask      vLLM engine's do, and the correction has something to correct;
  async_vllm         sequence_mask with `max_staleness=1`: the stand-in engine synced from the background
                     sampler's copy, one step behind.

    python benchmarks/learning_modes.py --steps 60                    # every mode
    python benchmarks/learning_modes.py --steps 60 --modes overlong,token_mask
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's tests/

MODES = {
    "overlong": dict(max_completion_length=10, overlong_buffer_len=4, overlong_penalty_factor=1.0),
    "token_truncate": dict(use_vllm=True, vllm_importance_sampling_mode="token_truncate"),
    "token_mask": dict(use_vllm=True, vllm_importance_sampling_mode="token_mask"),
    "sequence_truncate": dict(use_vllm=True, vllm_importance_sampling_mode="sequence_truncate"),
    "sequence_mask": dict(use_vllm=True, vllm_importance_sampling_mode="sequence_mask"),
    "async_vllm": dict(use_vllm=True, vllm_importance_sampling_mode="sequence_mask", max_staleness=1),
}


class RoundedEngine:
    """Stands in for vLLM (`use_vllm=True`): posttrain's sampler on a copy of the policy whose weights each sync
    rounds to bfloat16, as a bf16 inference engine holds them."""

    def __init__(self, policy, pad_token_id: int, eos_token_id, seed: int):
        self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.generator = torch.Generator().manual_seed(seed)
        self.syncs = 0

    def sync(self, policy, group=None):
        from posttrain.rollout.vllm_engine import policy_weights

        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in policy_weights(policy):
                state[name].copy_(tensor.to(torch.bfloat16).float())
        self.syncs += 1

    def generate(self, prompt_ids, sampling):
        from posttrain.rollout.generate import generate

        return generate(self.model, prompt_ids, sampling, pad_token_id=self.pad_token_id,
                        eos_token_id=self.eos_token_id, generator=self.generator)


def use_rounded_engine(seed: int):
    """`use_vllm=True` builds a RoundedEngine (and the config's vLLM and GPU checks pass)."""
    from posttrain.rollout import vllm_engine

    vllm_engine.vllm_installed = lambda: True
    vllm_engine.cuda_available = lambda: True
    vllm_engine.make_engine = lambda args, name, accelerator, pad, eos, extra=None, policy=None: RoundedEngine(
        policy, pad, eos, seed)


def mean_logged(trainer, key: str) -> float | None:
    values = [e[key] for e in trainer.state.log_history if key in e]
    return sum(values) / len(values) if values else None


def run(mode: str, model_path: str, steps: int, out: str) -> str:
    from tests.helpers.online import heldout_scores, learning_args

    from posttrain.tasks.builtin import digit_match_reward, task_dataset
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    train = task_dataset("reverse", "train").remove_columns("completion")
    fields = {**learning_args(out, num_generations=8, max_steps=steps), **MODES[mode]}
    trainer = GRPOTrainer(model_path, digit_match_reward, train_dataset=train, args=GRPOConfig(**fields))
    before = heldout_scores(trainer)
    trainer.train()
    after = heldout_scores(trainer)
    extra = {k: mean_logged(trainer, k) for k in ("shaping/overlong", "completions/mean_length",
                                                   "sampling/sampling_logp_difference/mean",
                                                   "sampling/importance_sampling_ratio/mean", "rollout/staleness")}
    shown = ", ".join(f"{k} {v:.4g}" for k, v in extra.items() if v is not None)
    return (f"{mode:18s} held-out greedy accuracy {before[0]:.2f} -> {after[0]:.2f}, sampled reward "
            f"{before[1]:.3f} -> {after[1]:.3f} (mean over the run: {shown})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    options = parser.parse_args()
    modes = options.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose among {list(MODES)}")
    from tests.trainers.conftest import sft_reverse

    use_rounded_engine(seed=42)
    with tempfile.TemporaryDirectory() as folder:
        model, tok = sft_reverse()
        model.save_pretrained(f"{folder}/sft")
        tok.save_pretrained(f"{folder}/sft")
        for mode in modes:
            print(run(mode, f"{folder}/sft", options.steps, f"{folder}/{mode}"), flush=True)


if __name__ == "__main__":
    main()
