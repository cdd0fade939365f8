"""PPO: value head and separate critic, the classic manual loop, saving, and learning on `reverse`."""

import pytest
import torch
from tests.helpers.online import (assert_learns, CRITIC_METRICS, ONLINE_METRICS, first_token_reward, learning_args,
                            online_args, prompts, train_and_check)

from posttrain.models.value_head import CausalLMWithValueHead, PolicyWithCritic
from posttrain.trainers.ppo import PPOConfig, PPOTrainer


def test_smoke_value_head(tmp_path):
    args = PPOConfig(**online_args(tmp_path, num_mini_batches=2, num_ppo_epochs=2, kl_estimator="k3"))
    trainer = PPOTrainer(args=args, model="posttrain/tiny-qwen2", reward_funcs=first_token_reward,
                         train_dataset=prompts())
    assert isinstance(trainer.model, CausalLMWithValueHead) and trainer.ref_model is not None
    train_and_check(trainer, ONLINE_METRICS + CRITIC_METRICS)
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = CausalLMWithValueHead.from_pretrained(str(tmp_path / "saved"))
    torch.testing.assert_close(reloaded.v_head.weight, trainer.model.v_head.weight)


def test_smoke_separate_critic_and_reward_model(tmp_path):
    args = PPOConfig(**online_args(tmp_path))
    trainer = PPOTrainer(args, None, "posttrain/tiny-qwen2", None, "posttrain/tiny-qwen2-seqcls", prompts(),
                         value_model="posttrain/tiny-qwen2-seqcls")
    assert isinstance(trainer.model, PolicyWithCritic)
    train_and_check(trainer, ONLINE_METRICS + CRITIC_METRICS, reward_names=trainer.reward_scorer.names)


def test_value_head_save_and_load(tmp_path):
    from transformers import AutoModelForCausalLM

    from posttrain.models.loading import load_causal_lm

    model = CausalLMWithValueHead(load_causal_lm("posttrain/tiny-qwen2"))
    torch.nn.init.normal_(model.v_head.weight)
    model.save_pretrained(str(tmp_path))
    again = CausalLMWithValueHead.from_pretrained(str(tmp_path))
    ids = torch.tensor([[5, 6, 7, 8]])
    a, b = model(input_ids=ids, logits_to_keep=3), again(input_ids=ids, logits_to_keep=3)
    assert a.value.shape == (1, 3) and a.logits.shape[:2] == (1, 3)
    torch.testing.assert_close(a.value, b.value)
    torch.testing.assert_close(a.logits, b.logits)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path))  # the policy is an ordinary checkpoint
    torch.testing.assert_close(plain(input_ids=ids).logits[:, -3:], a.logits)


def test_classic_manual_loop(tmp_path):
    args = PPOConfig(**online_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                                   num_ppo_epochs=2))
    trainer = PPOTrainer(args=args, model="posttrain/tiny-qwen2", train_dataset=prompts())
    with pytest.raises(ValueError, match="needs a reward"):
        trainer.train()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for i, batch in enumerate(trainer.dataloader):
        assert len(batch["query"]) == 4 and isinstance(batch["input_ids"][0], torch.Tensor)
        responses = trainer.generate(batch["input_ids"], max_new_tokens=5)
        rewards = [torch.tensor(float(r[0] % 3)) for r in responses]
        stats = trainer.step(batch["input_ids"], responses, rewards)
        trainer.log(stats)
        if i == 1:
            break
    for name in ["loss/policy_avg", "loss/value_avg", "policy/approxkl_avg", "val/ratio", "objective/kl", "lr"]:
        assert name in stats and torch.isfinite(torch.tensor(stats[name])), name
    assert trainer.state.global_step == 4  # 2 batches x 2 epochs x 1 mini-batch
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert "loss/policy_avg" in trainer.state.log_history[-1]


@pytest.mark.slow
def test_ppo_raises_heldout_reward(sft_reverse_path, tmp_path):
    """PPO from the partially SFT-trained tiny model raises held-out greedy accuracy and sampled reward."""
    from posttrain.tasks.builtin import digit_match_reward, task_dataset

    train = task_dataset("reverse", "train").remove_columns("completion")
    trainer = PPOTrainer(args=PPOConfig(**learning_args(tmp_path, num_ppo_epochs=1)), model=sft_reverse_path,
                         reward_funcs=digit_match_reward, train_dataset=train)
    assert_learns(trainer, "PPO")