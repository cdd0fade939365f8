"""MaxRL: the p-normalised advantage by hand and in float64 (1/p weighting of log p's gradient), the preset's
defaults, every parameter trains, resume, the CLI."""

import torch
from tests.helpers.online import ONLINE_METRICS, first_token_reward, online_args, prompts, train_and_check
from tests.helpers.resume import assert_resumes_identically

from posttrain import cli
from posttrain.core.advantages import AdvantageInput, compute_advantages
from posttrain.trainers.maxrl import MaxRLConfig, MaxRLTrainer

MODEL = "posttrain/tiny-qwen2"


def test_p_norm_by_hand():
    # groups of 4: pass rate 1/4, 1/2, none right, rewards 2 and 4 (mean 3)
    scores = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 2, 4, 2, 4], dtype=torch.float64)
    adv, returns = compute_advantages("p_norm", AdvantageInput(scores, torch.ones(16, 3), group_size=4))
    eps = 1e-6
    expected = [0.75 / (0.25 + eps)] + [-0.25 / (0.25 + eps)] * 3 + [0.5 / (0.5 + eps)] * 2 \
        + [-0.5 / (0.5 + eps)] * 2 + [0.0] * 4 + [-1 / (3 + eps), 1 / (3 + eps)] * 2
    assert returns is None and adv.dtype == torch.float64
    torch.testing.assert_close(adv[:, 0], torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert (adv == adv[:, :1]).all()  # one value per completion, at every token


def test_p_norm_policy_gradient_is_the_gradient_of_log_pass_rate_in_float64():
    """MaxRL's claim: with 0/1 rewards, E[A * grad log pi(y)] = grad log p, p the pass rate (GRPO's std gives
    grad p / std instead). A 3-outcome softmax policy pi = (3/8, 1/8, 1/2), outcome 0 correct, and a group of 8
    holding each outcome in proportion (so the group mean is p exactly): the group's mean A_i grad log pi(y_i)
    must equal autograd's grad of log pi(0), in float64, up to the 1e-6 guard."""
    theta = torch.log(torch.tensor([3 / 8, 1 / 8, 1 / 2], dtype=torch.float64)).requires_grad_(True)
    outcomes = [0, 0, 0, 1, 2, 2, 2, 2]
    scores = torch.tensor([float(o == 0) for o in outcomes], dtype=torch.float64)
    adv, _ = compute_advantages("p_norm", AdvantageInput(scores, torch.ones(8, 1), group_size=8))
    logp = torch.log_softmax(theta, -1)
    (policy_gradient,) = torch.autograd.grad((adv[:, 0] * logp[outcomes]).mean(), theta, retain_graph=True)
    (log_pass_rate,) = torch.autograd.grad(logp[0], theta)
    torch.testing.assert_close(policy_gradient, log_pass_rate, rtol=1e-5, atol=1e-12)


def make(output_dir, **fields):
    args = MaxRLConfig(**online_args(output_dir, num_generations=4, **fields))
    return MaxRLTrainer(MODEL, first_token_reward, args=args, train_dataset=prompts(8))


def test_defaults_are_grpos_with_p_norm():
    args = MaxRLConfig(output_dir="unused")
    assert args.advantage_estimator == "p_norm" and (args.beta, args.loss_type, args.epsilon) == (0.0, "dapo", 0.2)


def test_tiny_run_changes_every_parameter(tmp_path):
    train_and_check(make(tmp_path), metrics=[m for m in ONLINE_METRICS if m not in (
        "objective/kl", "objective/non_score_reward", "objective/rlhf_reward")])


def test_resumes_identically(tmp_path):
    assert_resumes_identically(lambda **f: make(**f), tmp_path, max_steps=3, stop_at=1)


def test_cli_command_trains(tmp_path):
    trainer = cli.run(["maxrl", "--model_name_or_path", MODEL, "--dataset_name", "reverse", "--reward_funcs",
                       "exact_match", "--output_dir", str(tmp_path), "--max_steps", "1", "--num_generations", "4",
                       "--per_device_train_batch_size", "4", "--max_completion_length", "4", "--disable_tqdm", "true"])
    assert type(trainer).__name__ == "MaxRLTrainer" and trainer.state.global_step == 1
    assert trainer.args.advantage_estimator == "p_norm"
