"""One off-policy distillation step (the dataset's completions, so no sampling), run by
tests/trainers/test_distillation.py under `accelerate launch` (2 CPU processes) and as a plain single process;
writes the first-step loss and the updated weights' sums to a file."""

import json
import os
import sys

from posttrain.cli import close_process_group
from posttrain.tasks.builtin import task_dataset
from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer


def main(out_path: str, per_device_batch: int):
    args = DistillationConfig(output_dir=out_path + ".run", per_device_train_batch_size=per_device_batch,
                              max_completion_length=6, learning_rate=1e-2, max_steps=1, logging_steps=1, lmbda=0.0,
                              beta=0.5, loss_top_k=0, shuffle_dataset=False, report_to="none", disable_tqdm=True,
                              use_cpu=True, save_strategy="no",
                              ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    data = task_dataset("reverse", "train", size=16)
    data = data.map(lambda row, i: {"completion": row["completion"][:1 + i % 4]}, with_indices=True)  # uneven
    trainer = DistillationTrainer("posttrain/tiny-qwen2", teacher_model="posttrain/tiny-llama", args=args,
                                  train_dataset=data)
    trainer.train()
    if trainer.accelerator.is_main_process:
        weights = {n: p.detach().double().sum().item() for n, p in trainer.policy.named_parameters()}
        with open(out_path, "w") as f:
            json.dump({"loss": trainer.state.log_history[0]["loss"], "processes": trainer.accelerator.num_processes,
                       "weights": weights}, f)


if __name__ == "__main__":
    try:
        main(sys.argv[1], int(sys.argv[2]))
    finally:  # see cli.close_process_group
        close_process_group()
