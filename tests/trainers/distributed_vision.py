"""One SFT or GRPO step on the tiny vision-language model, run by tests/trainers/test_distributed_vision.py under
`accelerate launch` (2 CPU processes, gloo) and as a plain single process; writes the first step's loss and the
updated weights to a file.

GRPO's sampling is made independent of how the prompts are split over processes as in distributed_grpo.py: each
prompt is sampled in its own `generate` call with its own images and a generator seeded from its token ids and
pixels, and the per-prompt rollouts (their images included) are joined into one.
"""

import dataclasses
import json
import os

import torch
from distributed_grpo import join_rollouts

from posttrain.forward.vision import IMAGE_GROUP
from posttrain.rollout.images import text_tokenizer
from posttrain.tasks.vision import vision_dataset
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.sft import SFTConfig, SFTTrainer

VLM = "posttrain/tiny-llava"


def first_token_reward(completion_ids, **kwargs):
    return [float(ids[0] % 5) if ids else 0.0 for ids in completion_ids]


def join_vision(parts) -> dict:
    """The row tensors of per-prompt rollouts' images as one rollout's: concatenated, prompts renumbered
    (every prompt of the task has one image, so the per-row tensors have the same shape)."""
    joined = {key: torch.cat([p.vision[key] for p in parts]) for key in parts[0].vision if key != IMAGE_GROUP}
    joined[IMAGE_GROUP] = torch.cat([torch.full_like(p.vision[IMAGE_GROUP], i) for i, p in enumerate(parts)])
    return joined


class PerPromptSeededGRPO(GRPOTrainer):
    def sample_completions(self, prompt_ids, sampling=None, continue_turn=None, vision=None):
        from posttrain.rollout.generate import generate

        tok = text_tokenizer(self.processing_class)
        parts = []
        for ids, images in zip(prompt_ids, vision):
            seed = sum(ids) + int(images["pixel_values"].sum() * 1000) % 100003
            parts.append(generate(self.policy, [ids], sampling or self.sampling, pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, generator=torch.Generator().manual_seed(seed),
                                  vision=[images]))
        return dataclasses.replace(join_rollouts(parts, tok.pad_token_id), vision=join_vision(parts))


def main(out_path: str, trainer_name: str, per_device_batch: int):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    common = dict(output_dir=out_path + ".run", per_device_train_batch_size=per_device_batch, max_steps=1,
                  logging_steps=1, report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no",
                  ddp_backend="gloo" if world > 1 else None)
    if trainer_name == "sft":
        # 8 rows: the one step reads them all, however the sampler orders and splits them
        trainer = SFTTrainer(VLM, args=SFTConfig(**common, learning_rate=1e-2), train_dataset=vision_dataset("train", 8))
    else:
        args = GRPOConfig(**common, num_generations=4, max_completion_length=4, learning_rate=1e-2, beta=0.1,
                          shuffle_dataset=False, replay_linear_outputs=False)
        trainer = PerPromptSeededGRPO(VLM, first_token_reward, args=args,
                                      train_dataset=vision_dataset("train", 16).remove_columns("completion"))
    trainer.train()
    if trainer.accelerator.is_main_process:
        first = trainer.state.log_history[0]
        weights = {n: p.detach().double().sum().item() for n, p in trainer.model.named_parameters()}
        with open(out_path, "w") as f:
            json.dump({"loss": first["loss"], "reward": first.get("reward"), "weights": weights,
                       "processes": trainer.accelerator.num_processes}, f)


if __name__ == "__main__":
    from worker_jobs import run_jobs

    run_jobs(main, str, str, int)  # out.json, sft | grpo, per-device batch
