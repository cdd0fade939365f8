"""RLOO with a reward model (or reward functions), as the classic RLOO example.

    python examples/scripts/rloo/rloo.py \
        --dataset_name reverse --learning_rate 3e-6 --output_dir out/rloo \
        --per_device_train_batch_size 16 --gradient_accumulation_steps 1 --total_episodes 256 \
        --model_name_or_path posttrain/tiny-qwen2 --reward_model_path posttrain/tiny-qwen2-seqcls \
        --missing_eos_penalty 1.0

Every RLOOConfig field is a flag (rloo_k, kl_coef, num_ppo_epochs, ...); --reward_funcs adds
reward functions (exact_match, digit_match, module:function).
"""

import sys

from posttrain.cli import build_online, parse
from posttrain.trainers.rloo import RLOOTrainer

if __name__ == "__main__":
    script_args, config = parse("rloo", sys.argv[1:])
    trainer = build_online(RLOOTrainer, script_args, config)
    trainer.train()
    trainer.save_model(config.output_dir)
