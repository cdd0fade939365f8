"""The classic PPO loop, driven by hand as the classic TRL docs wrote it: generate, score with your own
code, step. Texts in, texts out; `step` also takes token ids, and (responses, rewards, queries) in the
classic docs' order.

    python examples/scripts/ppo/ppo_manual_loop.py
"""

from posttrain import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from posttrain.models.loading import load_tokenizer
from posttrain.tasks.builtin import digit_match_reward, task_dataset

if __name__ == "__main__":
    dataset = task_dataset("reverse", "train", size=64).remove_columns("completion")
    model = AutoModelForCausalLMWithValueHead.from_pretrained("posttrain/tiny-qwen2")
    tokenizer = load_tokenizer(None, model="posttrain/tiny-qwen2")
    ppo_config = PPOConfig(output_dir="out/ppo-manual", learning_rate=1e-4, batch_size=8, mini_batch_size=4,
                           kl_penalty="kl", init_kl_coef=0.2, adap_kl_ctrl=True)
    # ref_model=model: the reference is a frozen copy of the starting policy
    ppo_trainer = PPOTrainer(config=ppo_config, model=model, ref_model=model, tokenizer=tokenizer, dataset=dataset)
    for batch in ppo_trainer.dataloader:
        responses = ppo_trainer.generate(batch["prompt"], max_new_tokens=8)
        rewards = digit_match_reward(responses, batch["answer"])
        stats = ppo_trainer.step(batch["prompt"], responses, rewards)
        ppo_trainer.log(stats)
    model.save_pretrained("out/ppo-manual")
