"""PPO with a reward model and a value head on the policy, as the classic PPO example.

    python examples/scripts/ppo/ppo.py \
        --dataset_name reverse --learning_rate 3e-6 --output_dir out/ppo \
        --per_device_train_batch_size 16 --gradient_accumulation_steps 1 --total_episodes 256 \
        --model_name_or_path posttrain/tiny-qwen2 --reward_model_path posttrain/tiny-qwen2-seqcls \
        --missing_eos_penalty 1.0

The policy is saved as an ordinary checkpoint in --output_dir, the value head next to it.
"""

import sys

from posttrain.cli import build_online, parse
from posttrain.trainers.ppo import PPOTrainer

if __name__ == "__main__":
    script_args, config = parse("ppo", sys.argv[1:])
    trainer = build_online(PPOTrainer, script_args, config)
    trainer.train()
    trainer.save_model(config.output_dir)
