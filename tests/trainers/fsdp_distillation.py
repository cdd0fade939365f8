"""One distillation step with the student sharded by FSDP2 (`fully_shard`) over CPU processes (gloo) and the teacher
sharded as the engine shards a reference model (`loading.prepare_frozen` -> `fully_shard_frozen`), run by
tests/trainers/test_distillation_family.py under torchrun, and as a plain single process for the reference; writes
the first-step loss and how far each weight moved.

As in fsdp_grpo.py: accelerate 1.15 runs no FSDP on the CPU, so the script shards the student itself as
accelerate's FSDP2 path does, and reports FSDP2 to the engine (`loading.shards_weights`) so that the trainer's own
code shards the teacher. Off-policy batches (lmbda=0: the dataset's completions, of uneven lengths), so both runs
train on the same tokens; plain SGD at lr 1, so each weight moves by its gradient."""

import json
import os
import sys

import torch
import torch.distributed as dist

from posttrain.cli import close_process_group, end_process
from posttrain.models import loading
from posttrain.tasks.builtin import task_dataset
from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer


def main(out_path: str, per_device_batch: int):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        loading.shards_weights = lambda accelerator: "fsdp2"  # what accelerate's FSDP2 plugin would report
    args = DistillationConfig(output_dir=out_path + ".run", per_device_train_batch_size=per_device_batch,
                              max_completion_length=6, optim="sgd", learning_rate=1.0, max_steps=1, logging_steps=1,
                              lmbda=0.0, beta=0.5, loss_top_k=0, shuffle_dataset=False, report_to="none",
                              disable_tqdm=True, use_cpu=True, save_strategy="no",
                              ddp_backend="gloo" if world > 1 else None)
    data = task_dataset("reverse", "train", size=16)
    data = data.map(lambda row, i: {"completion": row["completion"][:1 + i % 4]}, with_indices=True)  # uneven
    trainer = DistillationTrainer("posttrain/tiny-qwen2", teacher_model="posttrain/tiny-llama", args=args,
                                  train_dataset=data)
    start = {name: p.detach().double().clone() for name, p in trainer.model.named_parameters()}
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in trainer.policy.model.layers:
            fully_shard(layer)
        fully_shard(trainer.model)
        trainer.accelerator.prepare_model = lambda model, *a, **k: model  # sharded already: no DDP on top
    trainer.train()
    shards = [type(p).__name__ == "DTensor" for m in (trainer.policy, trainer.teacher_model) for p in m.parameters()]
    moves = {}  # per weight: the norm of its move and the move's projection on a fixed random direction
    for name, p in trainer.model.named_parameters():  # full_tensor gathers: every rank takes part
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        move = full.detach().double() - start[name]
        direction = torch.randn(move.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        moves[name] = [move.norm().item(), (move * direction).sum().item()]
    rank = trainer.accelerator.process_index
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"sharded": all(shards)}, f)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"loss": trainer.state.log_history[0]["loss"], "processes": trainer.accelerator.num_processes,
                       "moves": moves}, f)
    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    try:
        main(sys.argv[1], int(sys.argv[2]))
    finally:  # see cli.close_process_group
        close_process_group()
    end_process(0)  # see cli.end_process
