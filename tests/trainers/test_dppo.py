"""DPPOTrainer: TRL's defaults, every parameter trains (also on a second pass, where the trust region acts),
refused settings are named, resume and the CLI. The loss by hand: tests/core/test_policy_loss_dppo.py."""

import pytest
from tests.helpers.online import ONLINE_METRICS, first_token_reward, online_args, prompts, train_and_check
from tests.helpers.resume import assert_resumes_identically

from posttrain import cli
from posttrain.trainers.dppo import DPPOConfig, DPPOTrainer

MODEL = "posttrain/tiny-qwen2"
NO_KL = ("objective/kl", "objective/non_score_reward", "objective/rlhf_reward")  # beta 0: no reference


def make(output_dir, **fields):
    args = DPPOConfig(**online_args(output_dir, num_generations=4, **fields))
    return DPPOTrainer(MODEL, first_token_reward, args=args, train_dataset=prompts(8))


def test_trl_defaults():
    args = DPPOConfig(output_dir="unused")
    assert (args.policy_loss, args.loss_type, args.epsilon, args.epsilon_high) == ("dppo", "dapo", 0.15, 0.15)
    assert (args.divergence_type, args.divergence_topk, args.clip_ratio_c) == ("binary_tv", 20, 20.0)


@pytest.mark.parametrize("divergence_type", ["binary_tv", "binary_kl"])
def test_tiny_run_changes_every_parameter(tmp_path, divergence_type):
    # two passes over each batch at a high rate: on the second the ratios have moved far from 1 (PPO's clip at
    # 0.2 would hold many tokens), but a random model's tokens have probabilities near 1/vocab, so their
    # divergence stays below 0.15: the case DPPO is made for, rare tokens free to move
    trainer = make(tmp_path, divergence_type=divergence_type, num_iterations=2, learning_rate=1e-2)
    logged = train_and_check(trainer, metrics=[m for m in ONLINE_METRICS if m not in NO_KL])
    assert max(logged["val/ratio"]) > 1.2 and max(logged["policy/clipfrac_avg"]) == 0


@pytest.mark.parametrize("fields, message", [
    ({"divergence_type": "topk_kl"}, "needs the sampler's top-K log-probs"),
    ({"divergence_type": "tv"}, "divergence_type must be one of"),
    ({"loss_type": "grpo"}, "loss_type='dapo' only"),
    ({"clip_ratio_c": 0.0}, "clip_ratio_c must be > 0"),
    ({"top_entropy_quantile": 0.5}, "top_entropy_quantile=1.0 only"),
])
def test_bad_settings_are_named(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        DPPOConfig(**online_args(tmp_path, **fields))


def test_resumes_identically(tmp_path):
    assert_resumes_identically(lambda **f: make(**f), tmp_path, max_steps=3, stop_at=1)


def test_cli_command_trains(tmp_path):
    trainer = cli.run(["dppo", "--model_name_or_path", MODEL, "--dataset_name", "reverse", "--reward_funcs",
                       "exact_match", "--output_dir", str(tmp_path), "--max_steps", "1", "--num_generations", "4",
                       "--per_device_train_batch_size", "4", "--max_completion_length", "4", "--disable_tqdm", "true",
                       "--divergence_type", "binary_kl", "--epsilon", "0.05", "--epsilon_high", "0.05"])
    assert type(trainer).__name__ == "DPPOTrainer" and trainer.state.global_step == 1
    assert (trainer.args.divergence_type, trainer.args.epsilon) == ("binary_kl", 0.05)
