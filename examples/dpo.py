"""DPO on the built-in `reverse` task: held-out preference for the right answer before and after.

    python examples/dpo.py [--model posttrain/tiny-qwen2] [--steps 15] [--loss_type sigmoid]

The pairs are `task_preference_dataset("reverse")`: chosen is the reversed number, rejected the
same answer with one digit replaced by a letter. The script prints how often the policy gives
the right answer a higher log-probability than the corrupted one, on held-out prompts. Runs in
well under a minute on a laptop CPU. The same run from the command line:

    posttrain dpo --model_name_or_path posttrain/tiny-qwen2 --dataset_name reverse/preference \
        --output_dir dpo-reverse --max_steps 15 --per_device_train_batch_size 8 --learning_rate 3e-3
"""

import argparse

from posttrain import DPOConfig, DPOTrainer
from posttrain.data.builtin import task_preference_dataset
from posttrain.trainers.preference_base import preference_accuracy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="posttrain/tiny-qwen2")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--loss_type", default="sigmoid")
    parser.add_argument("--output_dir", default="dpo-reverse")
    args = parser.parse_args()

    train, test = task_preference_dataset("reverse", "train", 1000), task_preference_dataset("reverse", "test")
    config = DPOConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8,
                       learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=5, max_length=64,
                       loss_type=args.loss_type, beta=2.0 if args.loss_type == "simpo" else 0.1)
    trainer = DPOTrainer(args.model, args=config, train_dataset=train)
    before = preference_accuracy(trainer.model, trainer.processing_class, test)
    trainer.train()
    after = preference_accuracy(trainer.model, trainer.processing_class, test)
    print(f"held-out: log p(right answer) > log p(corrupted answer) for {before:.0%} -> {after:.0%} of prompts")
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
