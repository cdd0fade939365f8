"""RLOO: both call forms, a reward model as a module, a smoke run, and learning on `reverse`."""

import pytest
from tests.helpers.online import assert_learns, learning_args, first_token_reward, online_args, prompts, train_and_check

from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer


def test_classic_form_with_reward_model(tmp_path):
    from posttrain.models.loading import load_causal_lm, load_sequence_classifier, load_tokenizer

    config = RLOOConfig(**online_args(tmp_path, rloo_k=4, num_ppo_epochs=1, token_level_kl=True))
    tok = load_tokenizer(None, model="posttrain/tiny-qwen2")
    reward_model = load_sequence_classifier("posttrain/tiny-qwen2-seqcls")
    trainer = RLOOTrainer(config=config, processing_class=tok, policy=load_causal_lm("posttrain/tiny-qwen2"),
                          ref_policy=load_causal_lm("posttrain/tiny-qwen2"), reward_model=reward_model,
                          train_dataset=prompts())
    assert trainer.args.num_generations == 4 and trainer.args.beta == 0.05 and trainer.ref_model is not None
    train_and_check(trainer, reward_names=trainer.reward_scorer.names)


def test_positional_classic_and_grpo_style_forms(tmp_path):
    from posttrain.models.loading import load_tokenizer

    config = RLOOConfig(**online_args(tmp_path))
    tok = load_tokenizer(None, model="posttrain/tiny-qwen2")
    classic = RLOOTrainer(config, tok, "posttrain/tiny-qwen2", None, first_token_reward, prompts())
    assert classic.reward_scorer.names == ["first_token_reward"] and classic.args.rloo_k == 2
    modern = RLOOTrainer("posttrain/tiny-qwen2", first_token_reward, args=config, train_dataset=prompts())
    assert modern.args is config
    with pytest.raises(ValueError, match="policy="):
        RLOOTrainer(config=config, reward_model=first_token_reward, train_dataset=prompts())


def test_smoke_grpo_style(tmp_path):
    args = RLOOConfig(**online_args(tmp_path, num_generations=4, num_iterations=1, normalize_advantage=True,
                                    missing_eos_penalty=1.0))
    trainer = RLOOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts())
    train_and_check(trainer)


@pytest.mark.slow
def test_rloo_raises_heldout_reward(sft_reverse_path, tmp_path):
    """RLOO from the partially SFT-trained tiny model raises held-out greedy accuracy and sampled reward."""
    from posttrain.tasks.builtin import digit_match_reward, task_dataset

    train = task_dataset("reverse", "train").remove_columns("completion")
    trainer = RLOOTrainer(sft_reverse_path, digit_match_reward, train_dataset=train,
                          args=RLOOConfig(**learning_args(tmp_path, num_generations=8, num_ppo_epochs=1)))
    assert_learns(trainer, "RLOO")


def test_cli_classic_flags(tmp_path):
    from posttrain.cli import run

    trainer = run(["rloo", "--dataset_name", "reverse", "--learning_rate", "3e-6", "--output_dir", str(tmp_path),
                   "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                   "--total_episodes", "8", "--model_name_or_path", "posttrain/tiny-qwen2",
                   "--reward_model_path", "posttrain/tiny-qwen2-seqcls", "--missing_eos_penalty", "1.0",
                   "--response_length", "6", "--num_ppo_epochs", "1", "--disable_tqdm", "true"])
    assert trainer.state.global_step == 2  # 8 episodes / 4 completions per generation batch
    assert trainer.args.missing_eos_penalty == 1.0 and len(trainer.reward_scorer.funcs) == 1
