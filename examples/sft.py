"""Supervised fine-tuning of the tiny built-in model on the `reverse` task, then held-out accuracy.

    python examples/sft.py [--model posttrain/tiny-qwen2] [--steps 220] [--packing]

Runs on a laptop CPU in a minute or two; prints greedy exact-match accuracy on held-out prompts
before and after training. The same run from the command line:

    posttrain sft --model_name_or_path posttrain/tiny-qwen2 --dataset_name reverse \
        --output_dir sft-reverse --max_steps 220 --per_device_train_batch_size 32 \
        --learning_rate 3e-3 --lr_scheduler_type constant_with_warmup --warmup_steps 10
"""

import argparse

from posttrain import SFTConfig, SFTTrainer, task_dataset
from posttrain.eval import generation_accuracy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="posttrain/tiny-qwen2")
    parser.add_argument("--steps", type=int, default=220)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--output_dir", default="sft-reverse")
    args = parser.parse_args()

    train, test = task_dataset("reverse", "train"), task_dataset("reverse", "test", size=100)
    config = SFTConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=32,
                       learning_rate=3e-3, lr_scheduler_type="constant_with_warmup", warmup_steps=10,
                       logging_steps=20, packing=args.packing, max_length=64)
    trainer = SFTTrainer(args.model, args=config, train_dataset=train)
    before = generation_accuracy(trainer.model, trainer.processing_class, test)
    trainer.train()
    after = generation_accuracy(trainer.model, trainer.processing_class, test)
    print(f"held-out exact match: {before:.2f} -> {after:.2f}")
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
