"""DPO's precompute_ref_log_probs and BCO's prompt-embedding pass, run by tests/trainers/test_distributed_precompute.py
under `accelerate launch` (2 CPU processes, gloo) and as a plain process; writes the columns these passes add
and how many rows each process scored."""

import json
import os

import torch

from posttrain.models.loading import load_tokenizer
from posttrain.tasks.builtin import task_preference_dataset


def main(out_path: str, trainer_name: str):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    common = dict(output_dir=out_path + ".run", per_device_eval_batch_size=3, report_to="none", disable_tqdm=True,
                  use_cpu=True, ddp_backend="gloo" if world > 1 else None, save_strategy="no")
    data = task_preference_dataset("reverse", size=11)  # 11 rows: the second process's share is padded
    scored = []
    if trainer_name == "dpo":
        from posttrain.trainers.dpo import DPOConfig, DPOTrainer

        class Counting(DPOTrainer):
            def reference_logps(self, input_ids, attention_mask, completion_mask):
                scored.append(input_ids.shape[0] // 2)  # chosen and rejected rows of each pair
                return super().reference_logps(input_ids, attention_mask, completion_mask)

        trainer = Counting("posttrain/tiny-qwen2", args=DPOConfig(**common, precompute_ref_log_probs=True),
                           train_dataset=data)
        columns = {name: list(trainer.train_dataset[name]) for name in trainer.reference_columns}
    else:
        from posttrain.trainers.bco import BCOConfig, BCOTrainer

        def embed(input_ids, attention_mask):  # a fixed embedding: counts of token ids modulo 8
            scored.append(input_ids.shape[0])
            counts = torch.zeros(input_ids.shape[0], 8)
            return counts.scatter_add_(1, input_ids % 8, attention_mask.float())

        trainer = BCOTrainer("posttrain/tiny-qwen2", args=BCOConfig(**common, prompt_sample_size=5), train_dataset=data,
                             embedding_func=embed, embedding_tokenizer=load_tokenizer("posttrain/tiny-qwen2"))
        columns = {"udm_weight": list(trainer.train_dataset["udm_weight"])}
    rank = trainer.accelerator.process_index
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"scored": sum(scored), "columns": columns, "processes": trainer.accelerator.num_processes}, f)


if __name__ == "__main__":
    from worker_jobs import run_jobs

    run_jobs(main, str, str)  # out.json, dpo | bco
