"""One GRPO (or RLOO, or PPO) step with the policy sharded by FSDP2 (`fully_shard`) over CPU processes (gloo), run by
tests/trainers/test_fsdp.py under torchrun, and as a plain single process for the reference; writes the
first-step loss, the updated weights and what each process's sampler did.

accelerate 1.15 does not run FSDP on the CPU: launched with examples/accelerate_configs/fsdp2.yaml, a run
with `use_cpu=True` becomes MULTI_CPU (DDP, the FSDP settings ignored) and one without it a single
process on each rank. So the script shards the policy itself as accelerate's FSDP2 path does (`fully_shard`
on each decoder layer, then on the whole model) and keeps accelerate from wrapping it in DDP as well.

Sampling is per prompt with a generator seeded from its token ids (`distributed_grpo.PerPromptSeededGRPO`),
so the runs train on the same completions however the prompts are split. With `uneven`, the completions of
rank 0 stop at their first token (every token id is a stop id there) while rank 1's run to
max_completion_length: the ranks stop decoding at different steps.
"""

import dataclasses
import json
import os

import torch.distributed as dist

from distributed_grpo import PerPromptSeededGRPO, first_token_reward
from posttrain.cli import end_process
from posttrain.tasks.builtin import task_dataset
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.ppo import PPOConfig, PPOTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer


def _counting(base):
    """`base` sampling each prompt as `PerPromptSeededGRPO` does, counting the policy's forwards while it
    samples and keeping each rollout's completion width."""

    class Counting(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.forwards, self.widths = 0, []

        def sample_completions(self, prompt_ids, sampling=None):
            # counted under FSDP only: a hook on the plain model would turn its lean decoding step off
            sharded = dist.is_initialized()
            count = sharded and self.policy.register_forward_pre_hook(
                lambda *a: setattr(self, "forwards", self.forwards + 1))
            try:
                rollout = PerPromptSeededGRPO.sample_completions(self, prompt_ids, sampling)
            finally:
                if sharded:
                    count.remove()
            self.widths.append(rollout.completion_ids.shape[1])
            return rollout

    return Counting


def _shard(trainer):
    """As accelerate's FSDP2 path: each decoder layer, then the model the Trainer trains (for PPO the policy
    with its value head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in trainer.policy.model.layers:
        fully_shard(layer)
    fully_shard(trainer.model)
    trainer.accelerator.prepare_model = lambda model, *args, **kwargs: model  # sharded already: no DDP on top


def main(out_path: str, per_device_batch: int, uneven: bool, algorithm: str):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config, trainer_class = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer),
                             "ppo": (PPOConfig, PPOTrainer)}[algorithm]
    # PPO: one completion per prompt (4 times the prompts), one epoch of one mini-batch: one optimizer step
    per_algorithm = dict(num_ppo_epochs=1, num_mini_batches=1) if algorithm == "ppo" else dict(num_generations=4)
    # no replay of the sampler's linear outputs: it needs the lean decoding step, which sharded weights turn
    # off, and the reference must compute the training forward the same way. Plain SGD: the update is the
    # gradient itself (Adam's first step, about lr * sign(gradient), would hide a wrongly scaled gradient)
    args = config(**per_algorithm, replay_linear_outputs=False, output_dir=out_path + ".run",
                  per_device_train_batch_size=per_device_batch, max_completion_length=6, optim="sgd",
                  learning_rate=1.0, max_steps=1, logging_steps=1, beta=0.1, shuffle_dataset=False, report_to="none",
                  disable_tqdm=True, use_cpu=True, ddp_backend="gloo" if world > 1 else None, save_strategy="no")
    prompts = task_dataset("reverse", "train", size=16).remove_columns("completion")
    trainer = _counting(trainer_class)(model="posttrain/tiny-qwen2", reward_funcs=first_token_reward, args=args,
                                       train_dataset=prompts)
    rank = trainer.accelerator.process_index
    # the policy's weights, and for PPO its value head's
    start = {name: p.detach().double().sum().item() for name, p in trainer.model.named_parameters()}
    if uneven and rank == 0:
        vocab = trainer.policy.get_output_embeddings().weight.shape[0]
        trainer.sampling = dataclasses.replace(trainer.sampling, stop_token_ids=tuple(range(vocab)))
    if world > 1:
        _shard(trainer)
    trainer.train()
    sharded = any(type(p).__name__ == "DTensor" for p in trainer.policy.parameters())
    weights = {}
    for name, p in trainer.model.named_parameters():  # full_tensor gathers: every rank takes part
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        weights[name] = full.detach().double().sum().item()
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"forwards": trainer.forwards, "widths": trainer.widths, "sharded": sharded}, f)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"loss": trainer.state.log_history[0]["loss"], "reward": trainer.state.log_history[0]["reward"],
                       "processes": trainer.accelerator.num_processes, "start": start, "weights": weights}, f)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    from worker_jobs import run_jobs

    # out.json, per-device batch, even | uneven, grpo | rloo | ppo
    run_jobs(main, str, int, lambda split: split == "uneven", str)
    end_process(0)  # see cli.end_process
