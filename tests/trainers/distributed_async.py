"""Asynchronous rollouts on 2 CPU processes (DDP, gloo), run by tests/trainers/test_async_distributed.py under
`accelerate launch`. In one launch, to pay its start once:

  sync    GRPO, 3 steps (the synchronous engine);
  zero    AsyncGRPOTrainer with max_staleness=0, 3 steps: must equal `sync` bit for bit;
  full    max_staleness=1, 4 steps, a checkpoint at step 2 (with a batch in flight);
  resumed max_staleness=1 resumed from full's checkpoint-2: must equal `full` bit for bit.

The runs with max_staleness=1 have a tool, so each process's background sampler gathers the tool metrics over
the processes (its own process group) while the training thread all-reduces gradients. The main process writes
a digest of each run's weights and logs to a JSON file.
"""

import json
import os
import sys

import torch
from datasets import Dataset

from posttrain.cli import close_process_group
from posttrain.trainers.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


def first_token_reward(completion_ids, **kwargs):
    return [float(ids[0] % 5) if ids else 0.0 for ids in completion_ids]


def ping(x: int) -> int:
    """Add one.

    Args:
        x: A number.
    """
    return x + 1


def digest(trainer) -> dict:
    """Each weight's float64 sum and sum of squares, and every logged (step, name, number) but timings."""
    weights = {n: [p.detach().double().sum().item(), p.detach().double().square().sum().item()]
               for n, p in trainer.policy.named_parameters()}
    skip = ("runtime", "per_second", "total_flos", "train_loss", "eps", "wait_time")  # timings, the run's mean
    logs = [[entry.get("step", 0), k, v] for entry in trainer.state.log_history for k, v in entry.items()
            if k != "step" and isinstance(v, (int, float)) and not any(s in k for s in skip)]
    return {"weights": weights, "logs": logs, "processes": trainer.accelerator.num_processes}


def run(out_dir: str, config_class, trainer_class, max_steps: int, resume: bool = False, tools=None, **fields):
    args = config_class(output_dir=out_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                        num_generations=4, max_completion_length=6, learning_rate=1e-2, max_steps=max_steps,
                        logging_steps=1, beta=0.1, report_to="none", disable_tqdm=True, use_cpu=True,
                        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None, seed=3, **fields)
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Go {i}"}] for i in range(16)]})
    trainer = trainer_class("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts, tools=tools)
    trainer.train(resume_from_checkpoint=f"{out_dir}/checkpoint-2" if resume else None)
    return digest(trainer)


def main(out_path: str, work: str):
    ahead = dict(tools=[ping], max_staleness=1, save_strategy="steps", save_steps=2, max_tool_calling_iterations=1)
    results = {
        "sync": run(f"{work}/sync", GRPOConfig, GRPOTrainer, 3, save_strategy="no"),
        "zero": run(f"{work}/zero", AsyncGRPOConfig, AsyncGRPOTrainer, 3, max_staleness=0, save_strategy="no"),
        "full": run(f"{work}/full", GRPOConfig, GRPOTrainer, 4, **ahead),
    }
    results["resumed"] = run(f"{work}/full", GRPOConfig, GRPOTrainer, 4, resume=True, **ahead)
    world = results["full"]["processes"]
    name = f"posttrain_state_{world - 1}.pt" if world > 1 else "posttrain_state.pt"  # the last process's
    in_flight = torch.load(f"{work}/full/checkpoint-2/{name}", weights_only=True)["_rollouts_in_flight"]
    results["in_flight_on_last_rank"] = [ordinal for ordinal, _ in in_flight]
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    finally:  # see cli.close_process_group
        close_process_group()
