"""KTO (Ethayarajh et al. 2024) on the built-in `reverse` task, from unpaired feedback.

    python examples/kto.py [--model posttrain/tiny-qwen2] [--steps 40]

Each training row is a prompt, one answer and a thumbs-up or thumbs-down label
(`task_preference_dataset("reverse", unpaired=True)`: the right answer, or the answer with one
digit replaced by a letter). The script prints how often the policy gives the right answer a
higher log-probability than the corrupted one on held-out prompts, before and after.
The same run from the command line:

    posttrain kto --model_name_or_path posttrain/tiny-qwen2 --dataset_name reverse/unpaired_preference \
        --output_dir kto-reverse --max_steps 40 --per_device_train_batch_size 8 --learning_rate 5e-3
"""

import argparse

from posttrain import KTOConfig, KTOTrainer
from posttrain.data.builtin import task_preference_dataset
from posttrain.trainers.preference_base import preference_accuracy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="posttrain/tiny-qwen2")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output_dir", default="kto-reverse")
    args = parser.parse_args()

    train = task_preference_dataset("reverse", "train", 1000, unpaired=True)
    test = task_preference_dataset("reverse", "test")
    config = KTOConfig(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8,
                       learning_rate=5e-3, lr_scheduler_type="constant", logging_steps=5, max_length=64)
    trainer = KTOTrainer(args.model, args=config, train_dataset=train)
    before = preference_accuracy(trainer.model, trainer.processing_class, test)
    trainer.train()
    after = preference_accuracy(trainer.model, trainer.processing_class, test)
    print(f"held-out: log p(right answer) > log p(corrupted answer) for {before:.0%} -> {after:.0%} of prompts")
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
