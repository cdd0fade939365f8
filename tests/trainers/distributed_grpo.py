"""One GRPO step, run by tests/trainers/test_distributed.py under `accelerate launch` (2 CPU processes) and
as a plain single process; writes the first-step loss and the updated weights to a file.

Sampling is made independent of how prompts are split over processes: each prompt is sampled in its own
`generate` call, with a generator seeded from its token ids, so both runs train on the same completions.
With replay (the default), the per-prompt records of the sampler's linear outputs are merged into one, as
a single `generate` call would have made it, and the number of replayed forwards is written out too.
"""

import json
import os

import torch

from posttrain.accel.replay import LinearRecord
from posttrain.forward import completions as completions_module
from posttrain.rollout.generate import Rollout, generate
from posttrain.tasks.builtin import task_dataset
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


def first_token_reward(completion_ids, **kwargs):
    return [float(ids[0] % 5) if ids else 0.0 for ids in completion_ids]


def _cat(tensors, value, left=False):
    """Concatenate (n_i, T_i) tensors along rows, padding each to the widest (on the left or the right)."""
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]),
                                              value=value) for t in tensors])


def _merge(records):
    """One LinearRecord for prompts sampled one `generate` call each (prompt positions left-padded)."""
    first = records[0]
    P = max(r.shape[1] for r in records)
    T = max(r.shape[3] for r in records)
    G = first.group
    merged = LinearRecord(first.modules, len(records), P, G * len(records), T, G)
    for b, r in enumerate(records):
        for layer in range(len(merged.layers)):
            for kind in range(len(merged.widths)):
                merged.prompt(layer, kind)[b, P - r.shape[1]:] = r.prompt(layer, kind)[0]
                merged.completion(layer, kind)[b * G:(b + 1) * G, :r.shape[3]] = r.completion(layer, kind)
    return merged


def join_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """One prompt-major Rollout from per-prompt ones (padded to common widths, records merged)."""
    records = [p.linear_outputs for p in parts]
    tool_masks = [p.tool_mask for p in parts]
    return Rollout(prompt_ids=_cat([p.prompt_ids for p in parts], pad_token_id, left=True),
                   prompt_mask=_cat([p.prompt_mask for p in parts], 0, left=True),
                   completion_ids=_cat([p.completion_ids for p in parts], pad_token_id),
                   completion_mask=_cat([p.completion_mask for p in parts], 0),
                   logprobs=_cat([p.logprobs for p in parts], 0.0),
                   is_truncated=torch.cat([p.is_truncated for p in parts]),
                   linear_outputs=_merge(records) if all(r is not None for r in records) else None,
                   tool_mask=_cat(tool_masks, 0) if all(m is not None for m in tool_masks) else None)


class PerPromptSeededGRPO(GRPOTrainer):
    def sample_completions(self, prompt_ids, sampling=None):
        tok = self.processing_class
        parts = [generate(self.policy, [ids], sampling or self.sampling, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, generator=torch.Generator().manual_seed(sum(ids) + len(ids)),
                          record_linears=self.replays and sampling is None)
                 for ids in prompt_ids]
        return join_rollouts(parts, tok.pad_token_id)


def main(out_path: str, per_device_batch: int, replay: bool):
    replayed = []
    real = completions_module.replaying
    completions_module.replaying = lambda *a: replayed.append(1) or real(*a)
    try:
        _train(out_path, per_device_batch, replay, replayed)
    finally:  # the next job counts its own
        completions_module.replaying = real


def _train(out_path: str, per_device_batch: int, replay: bool, replayed: list):
    args = GRPOConfig(replay_linear_outputs=replay, output_dir=out_path + ".run", per_device_train_batch_size=per_device_batch, num_generations=4,
                      max_completion_length=6, learning_rate=1e-2, max_steps=1, logging_steps=1, beta=0.1,
                      shuffle_dataset=False, report_to="none", disable_tqdm=True, use_cpu=True,
                      ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
                      save_strategy="no")
    trainer = PerPromptSeededGRPO("posttrain/tiny-qwen2", first_token_reward, args=args,
                                  train_dataset=task_dataset("reverse", "train", size=16).remove_columns("completion"))
    trainer.train()
    if trainer.accelerator.is_main_process:
        weights = {n: p.detach().double().sum().item() for n, p in trainer.policy.named_parameters()}
        with open(out_path, "w") as f:
            json.dump({"loss": trainer.state.log_history[0]["loss"], "reward": trainer.state.log_history[0]["reward"],
                       "processes": trainer.accelerator.num_processes, "weights": weights,
                       "replayed": len(replayed)}, f)


if __name__ == "__main__":
    from worker_jobs import run_jobs

    run_jobs(main, str, int, lambda mode: mode == "replay")  # out.json, per-device batch, replay | plain
