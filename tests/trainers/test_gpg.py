"""GPG: GRPO's defaults changed to GPG's, the completions of all-equal groups out of the loss so that the gradient is
GRPO's times B / (B - M); every parameter trains; refused settings are named; resume; the CLI."""

import pytest
import torch
from tests.helpers.online import ONLINE_METRICS, first_token_reward, online_args, prompts, train_and_check
from tests.helpers.resume import assert_resumes_identically

from posttrain import cli
from posttrain.trainers.gpg import GPGConfig, GPGTrainer, informative_rows

MODEL = "posttrain/tiny-qwen2"
DATA = prompts(4)
FLAT = set(DATA["prompt"][:2])  # every completion of these prompts scores 0: their groups carry no gradient


def reward(prompts, completion_ids, **kwargs):
    return [0.0 if p in FLAT else s for p, s in zip(prompts, first_token_reward(completion_ids))]


def make(output_dir, **fields):
    args = GPGConfig(**{**online_args(output_dir), "num_generations": 4, "per_device_train_batch_size": 16,
                        "gradient_accumulation_steps": 1, "seed": 3, **fields})
    return GPGTrainer(MODEL, reward, args=args, train_dataset=DATA)


def test_trl_defaults():
    args = GPGConfig(output_dir="unused")
    assert (args.beta, args.scale_rewards, args.loss_type, args.bias_correction) == (0.0, "none", "grpo", True)


def test_informative_rows_by_hand():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 2.0, 3.0, 3.0, 3.0])
    assert informative_rows(scores, 3).tolist() == [False] * 3 + [True] * 3 + [False] * 3
    assert informative_rows(torch.tensor([0.5, 0.5]), 2).tolist() == [False, False]


def batch_and_grads(trainer):
    mb = trainer.make_experience(next(iter(trainer.get_train_dataloader())))[0]
    trainer.model.zero_grad()
    trainer.compute_loss(trainer.model, mb).backward()
    grads = {n: p.grad.double().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return mb, grads


def test_gradient_is_grpos_divided_by_the_informative_share(tmp_path):
    gpg_mb, gpg = batch_and_grads(make(tmp_path / "gpg"))
    grpo_mb, grpo = batch_and_grads(make(tmp_path / "grpo", bias_correction=False))
    assert torch.equal(gpg_mb["completion_ids"], grpo_mb["completion_ids"])  # the same seed, the same samples
    in_loss = gpg_mb["loss_mask"].sum(1) > 0
    assert (grpo_mb["loss_mask"].sum(1) > 0).all()
    n, m = in_loss.numel(), int((~in_loss).sum())
    assert 8 <= m < n  # the flat prompts' groups, maybe more, are out
    advantages = grpo_mb["advantages"][:, 0]
    assert (advantages[~in_loss] == 0).all() and advantages[in_loss].abs().sum() > 0
    assert float(gpg_mb.denominator) == n - m and float(grpo_mb.denominator) == n
    for name, g in grpo.items():  # grad GPG = grad GRPO * B / (B - M), in float64
        torch.testing.assert_close(gpg[name], g * n / (n - m), rtol=1e-4, atol=1e-9, msg=name)


def test_tiny_run_changes_every_parameter(tmp_path):
    trainer = GPGTrainer(MODEL, first_token_reward, train_dataset=DATA,
                         args=GPGConfig(**online_args(tmp_path, num_generations=4)))
    no_kl = ("objective/kl", "objective/non_score_reward", "objective/rlhf_reward")  # beta 0: no reference
    train_and_check(trainer, metrics=[m for m in ONLINE_METRICS if m not in no_kl])


@pytest.mark.parametrize("fields, message", [
    ({"beta": 0.1}, "beta != 0"),
    ({"mask_truncated_completions": True}, "mask_truncated_completions=True"),
    ({"entropy_coef": 0.01}, "entropy_coef != 0"),
    ({"missing_eos_penalty": 1.0}, "missing_eos_penalty"),
])
def test_settings_the_correction_cannot_serve_are_named(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        GPGConfig(**online_args(tmp_path, **fields))
    GPGConfig(**online_args(tmp_path, bias_correction=False, **fields))  # fine without the correction


def test_resumes_identically(tmp_path):
    assert_resumes_identically(lambda **f: make(**f), tmp_path, max_steps=3, stop_at=1)


def test_cli_command_trains(tmp_path):
    trainer = cli.run(["gpg", "--model_name_or_path", MODEL, "--dataset_name", "reverse", "--reward_funcs",
                       "exact_match", "--output_dir", str(tmp_path), "--max_steps", "1", "--num_generations", "4",
                       "--per_device_train_batch_size", "4", "--max_completion_length", "4", "--disable_tqdm", "true",
                       "--bias_correction", "false"])
    assert type(trainer).__name__ == "GPGTrainer" and trainer.state.global_step == 1
    assert trainer.args.bias_correction is False and trainer.args.scale_rewards == "none"
