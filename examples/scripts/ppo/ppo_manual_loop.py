"""The classic PPO loop, driven by hand: generate, score with your own code, step.

    python examples/scripts/ppo/ppo_manual_loop.py
"""

import torch

from posttrain.data.builtin import digit_match_reward, task_dataset
from posttrain.trainers.ppo import PPOConfig, PPOTrainer

if __name__ == "__main__":
    dataset = task_dataset("reverse", "train", size=64).remove_columns("completion")
    trainer = PPOTrainer(args=PPOConfig(output_dir="out/ppo-manual", per_device_train_batch_size=8,
                                        learning_rate=1e-4, max_completion_length=8),
                         model="posttrain/tiny-qwen2", train_dataset=dataset)
    for batch in trainer.dataloader:
        responses = trainer.generate(batch["input_ids"])
        texts = trainer.processing_class.batch_decode(responses, skip_special_tokens=True)
        rewards = [torch.tensor(r) for r in digit_match_reward(texts, batch["answer"])]
        stats = trainer.step(batch["input_ids"], responses, rewards)
        trainer.log(stats)
    trainer.save_model("out/ppo-manual")
