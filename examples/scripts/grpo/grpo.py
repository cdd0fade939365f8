"""GRPO on a prompt dataset with reward functions.

    python examples/scripts/grpo/grpo.py \
        --model_name_or_path posttrain/tiny-qwen2 --dataset_name reverse \
        --reward_funcs digit_match --num_generations 8 --per_device_train_batch_size 16 \
        --max_completion_length 8 --learning_rate 1e-3 --max_steps 50 --output_dir out/grpo

--reward_funcs takes built-in names (exact_match, digit_match), `module:function` paths and
reward-model names/paths; every GRPOConfig field is a flag (or use --config file.yaml).
"""

import sys

from posttrain.cli import build_online, parse
from posttrain.trainers.grpo import GRPOTrainer

if __name__ == "__main__":
    script_args, config = parse("grpo", sys.argv[1:])
    trainer = build_online(GRPOTrainer, script_args, config)
    trainer.train()
    trainer.save_model(config.output_dir)
