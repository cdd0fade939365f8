"""One GRPO step with tools, run by tests/trainers/test_tools_distributed.py under `accelerate launch` (2 CPU
processes) and as a plain single process; writes the first-step loss, the tool counts and the updated weights.

argv: out_path, per-device batch, "tool" (`tools=[ping]`) or "env" (`environment_factory=GuessNumberEnv`),
the path of the fitted tiny-qwen2 weights (a state dict that makes its rollouts call the tools).

As in distributed_grpo.py, each prompt is sampled in its own `generate` call with a generator seeded from
its token ids, so both runs train on the same episodes. The multi-turn callback (`Episodes`) numbers the
rows of the whole batch, so each prompt's call gets it with its rows offset to that prompt's place.
"""

import json
import os

import torch
from datasets import Dataset

from posttrain.models.loading import load_causal_lm
from posttrain.forward import completions as completions_module
from posttrain.rollout.generate import generate
from posttrain.tasks.environments import GuessNumberEnv
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from distributed_grpo import join_rollouts


def ping(x: int) -> int:
    """Add one.

    Args:
        x: A number.
    """
    return x + 1


def episode_reward(completions, **kwargs):
    """Varies between episodes of one prompt (messages and characters), so the group advantages are not 0."""
    return [len(c) + sum(len(m.get("content") or "") for m in c) % 7 / 7 for c in completions]


def _offset(continue_turn, offset):
    return None if continue_turn is None else lambda rows, tokens: continue_turn([offset + r for r in rows], tokens)


class PerPromptSeededGRPO(GRPOTrainer):
    def sample_completions(self, prompt_ids, sampling=None, continue_turn=None):
        tok = self.processing_class
        record = self.replays and sampling is None
        sampling = sampling or self.sampling
        G = sampling.num_generations
        parts = [generate(self.policy, [ids], sampling, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, tokenizer=tok,
                          generator=torch.Generator().manual_seed(sum(ids) + len(ids)),
                          record_linears=record,
                          continue_turn=_offset(continue_turn, b * G))
                 for b, ids in enumerate(prompt_ids)]
        return join_rollouts(parts, tok.pad_token_id)


def main(out_path: str, per_device_batch: int, kind: str, weights_path: str):
    replayed = []
    real = completions_module.replaying
    completions_module.replaying = lambda *a: replayed.append(1) or real(*a)
    try:
        _train(out_path, per_device_batch, kind, weights_path, replayed)
    finally:  # the next job counts its own
        completions_module.replaying = real


def _train(out_path: str, per_device_batch: int, kind: str, weights_path: str, replayed: list):
    args = GRPOConfig(output_dir=out_path + ".run", per_device_train_batch_size=per_device_batch, num_generations=4,
                      max_completion_length=48, max_tool_calling_iterations=2, learning_rate=1e-2, max_steps=1,
                      optim="sgd",
                      logging_steps=1, beta=0.1, shuffle_dataset=False, report_to="none", disable_tqdm=True,
                      use_cpu=True, ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
                      save_strategy="no")
    model = load_causal_lm("posttrain/tiny-qwen2")
    model.load_state_dict(torch.load(weights_path))
    if kind == "tool":  # two prompts, rows 0 and 1 (one per process in the 2-process run)
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": text}]} for text in ["Go", "Go on"] * 4])
        extra = {"tools": [ping]}
    else:
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Find my number from 1 to {high}."}],
                                   "secret": 1, "low": 1, "high": high} for high in [1, 2] * 4])
        extra = {"environment_factory": GuessNumberEnv}
    trainer = PerPromptSeededGRPO(model, episode_reward, args=args, train_dataset=data, **extra)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    trainer.train()
    if trainer.accelerator.is_main_process:
        log = trainer.state.log_history[0]
        # each parameter's update (SGD: the learning rate times the gradient, averaged over all episodes):
        # its sum and its L1 norm
        updates = {n: (p.detach() - before[n]).double() for n, p in trainer.policy.named_parameters()}
        weights = {n: [u.sum().item(), u.abs().sum().item()] for n, u in updates.items()}
        with open(out_path, "w") as f:
            json.dump({"loss": log["loss"], "reward": log["reward"], "reward_std": log["reward_std"],
                       "calls": log["tools/calls_per_completion"], "turns": log["tools/turns_per_episode"],
                       "processes": trainer.accelerator.num_processes, "weights": weights,
                       "replayed": len(replayed)}, f)


if __name__ == "__main__":
    from worker_jobs import run_jobs

    run_jobs(main, str, int, str, str)  # out.json, per-device batch, tool | env, the caller's weights
