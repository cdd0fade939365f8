"""VESPO (loss_type="vespo"): -sg(φ(W)) A log π with W the completion's whole importance ratio and
φ(W) = W^k exp(λ (1 - W)), checked against numbers worked by hand in float64."""

import math

import pytest
import torch

from posttrain.core.policy_losses import POLICY_LOSSES, vespo
from posttrain.trainers.grpo import GRPOConfig


def test_registered_with_the_token_mean_and_its_four_options():
    loss = POLICY_LOSSES["vespo"]
    assert loss.fn is vespo and loss.aggregation == "token_mean"
    assert loss.options == ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")


def test_values_and_gradients_by_hand():
    # row 0: log ratios 0.1, -0.3, 0.2 -> log W = 0, W = 1, φ = 1 whatever (k, λ); A = 0.5 >= 0
    # row 1: log ratios ln 2 - 0.25, 0.25 and a padded token (ignored) -> W = 2; A = -1 < 0 -> (k, λ) = (3, 2):
    #        φ(2) = 2^3 exp(2 (1 - 2)) = 8 / e^2
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], dtype=torch.float64)
    step = torch.tensor([[0.1, -0.3, 0.2], [math.log(2) - 0.25, 0.25, 5.0]], dtype=torch.float64)
    logp = (old + step).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    adv = torch.tensor([[0.5] * 3, [-1.0] * 3], dtype=torch.float64)
    per_token, stats = vespo(logp, old, adv, mask)
    phi = 8 / math.e ** 2  # 1.0826822658929016
    expected = torch.tensor([[-0.5, -0.5, -0.5], [phi, phi, 0.0]], dtype=torch.float64)  # -φ A at log π's value 1
    torch.testing.assert_close(per_token, expected, rtol=0, atol=1e-12)
    per_token.sum().backward()
    # d/d log π_t of -sg(φ) A log π_t = -φ A; padding gets none
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)
    assert not stats["clipped"].any()
    torch.testing.assert_close(stats["ratio"][0], torch.exp(step[0]))


def test_each_sign_has_its_own_kernel_and_stale_samples_fade():
    old = torch.zeros(2, 1, dtype=torch.float64)
    logp = torch.full((2, 1), math.log(0.5), dtype=torch.float64)  # W = 0.5 in both rows
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    per_token, _ = vespo(logp, old, adv, torch.ones(2, 1), vespo_k_pos=1.0, vespo_lambda_pos=0.5,
                         vespo_k_neg=4.0, vespo_lambda_neg=1.0)
    phi_pos = 0.5 * math.exp(0.5 * 0.5)  # 0.5^1 e^{0.5 (1 - 0.5)}
    phi_neg = 0.5 ** 4 * math.exp(1.0 * 0.5)
    torch.testing.assert_close(per_token, torch.tensor([[-phi_pos], [phi_neg]], dtype=torch.float64))
    far = vespo(torch.tensor([[30.0]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64),
                torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1))[0]
    assert far.abs().item() < 1e-100 and torch.isfinite(far).all()  # W = e^30: clamped, φ ~ 0, not NaN


def test_loss_type_vespo_selects_the_loss_and_refuses_a_negative_rate(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), loss_type="vespo", num_generations=2, vespo_k_neg=5.0)
    assert args.policy_loss == "vespo"
    with pytest.raises(ValueError, match="vespo_lambda_pos must be >= 0"):
        GRPOConfig(output_dir=str(tmp_path), loss_type="vespo", num_generations=2, vespo_lambda_pos=-1.0)


def test_grpo_trains_off_policy_with_vespo(tmp_path):
    # 4 micro-batches per generation batch and 2 per optimizer step: the second step trains off-policy (W != 1)
    from posttrain.tasks.builtin import task_dataset
    from posttrain.trainers.grpo import GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), loss_type="vespo", num_generations=4, steps_per_generation=4,
                      per_device_train_batch_size=4, gradient_accumulation_steps=2, max_completion_length=6,
                      learning_rate=1e-3, max_steps=2, logging_steps=1, beta=0.1, disable_tqdm=True)

    def reward(completion_ids, **kwargs):
        return [float(ids[0] % 5) if ids else 0.0 for ids in completion_ids]

    data = task_dataset("reverse", "train", size=8).remove_columns("completion")
    trainer = GRPOTrainer("posttrain/tiny-qwen2", reward, args=args, train_dataset=data)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2 and all(math.isfinite(e["loss"]) for e in logs)
    assert logs[1]["val/ratio"] != 1.0  # the second step's samples came from the policy before the first step
