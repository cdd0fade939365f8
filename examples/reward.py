"""Reward model on the built-in `reverse` task: held-out pairwise accuracy before and after.

    python examples/reward.py [--model posttrain/tiny-qwen2] [--steps 20]

tiny-qwen2 gets a fresh one-output score head; the pairs are `task_preference_dataset("reverse")`
(chosen: the reversed number, rejected: the same answer with one digit replaced by a letter).
Accuracy is the fraction of held-out pairs whose chosen answer scores higher. The same run from
the command line:

    posttrain reward --model_name_or_path posttrain/tiny-qwen2 --dataset_name reverse/preference \
        --output_dir reward-reverse --max_steps 20 --per_device_train_batch_size 16 --learning_rate 3e-3
"""

import argparse

from posttrain import RewardConfig, RewardTrainer
from posttrain.tasks.builtin import task_preference_dataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="posttrain/tiny-qwen2")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output_dir", default="reward-reverse")
    args = parser.parse_args()

    config = RewardConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=16,
                          learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=5, max_length=64,
                          per_device_eval_batch_size=100)
    trainer = RewardTrainer(args.model, args=config, train_dataset=task_preference_dataset("reverse", "train", 1000),
                            eval_dataset=task_preference_dataset("reverse", "test"))
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()["eval_accuracy"]
    print(f"held-out pairwise accuracy: {before:.0%} -> {after:.0%}")
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
