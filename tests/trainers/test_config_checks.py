"""Config values and data refused before training, with messages that say what to change."""

import math

import pytest
from datasets import Dataset
from tests.helpers.online import first_token_reward, online_args
from tests.helpers.preference import TINY, config_kwargs

from posttrain.data.formats import FormatError
from posttrain.data.tokenize import TokenizeError
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.online_config import OnlineConfig
from posttrain.trainers.reward import RewardConfig, RewardTrainer


@pytest.mark.parametrize("overrides, message", [
    ({"max_prompt_length": -4}, "max_prompt_length must be >= 1 .* got -4; set it to None for no limit"),
    ({"max_prompt_length": 0}, "max_prompt_length must be >= 1 .* got 0"),
    ({"epsilon": -0.2}, r"epsilon \(a clip range of the importance ratio\) must be >= 0, got -0.2"),
    ({"epsilon": math.nan}, "epsilon .* must be >= 0, got nan"),
    ({"epsilon_high": -0.1}, "epsilon_high .* must be >= 0"),
    ({"num_generations": 1, "per_device_train_batch_size": 4}, "'group_norm' compares .* num_generations >= 2"),
    ({"total_episodes": -8}, "total_episodes must be >= 1 completions, got -8; set it to None"),
    ({"total_episodes": 0}, "total_episodes must be >= 1"),
    ({"beta": 0.1, "sync_ref_model": True, "ref_model_mixup_alpha": 1.5}, r"ref_model_mixup_alpha must be in \[0, 1\]"),
    ({"ref_model_mixup_alpha": -0.1}, r"ref_model_mixup_alpha must be in \[0, 1\]"),
    ({"ref_model_sync_steps": 0}, "ref_model_sync_steps must be >= 1"),
])
def test_online_config_refuses(overrides, message):
    kwargs = {"output_dir": "x", "per_device_train_batch_size": 8, **overrides}
    with pytest.raises(ValueError, match=message):
        OnlineConfig(**kwargs)


def test_online_config_accepts_the_limits():
    config = OnlineConfig(output_dir="x", per_device_train_batch_size=8, max_prompt_length=None, epsilon=0.0,
                          total_episodes=1, ref_model_mixup_alpha=1.0)
    assert config.max_prompt_length is None and config.total_episodes == 1
    # a group of one is fine where the baseline is not the group
    assert OnlineConfig(output_dir="x", per_device_train_batch_size=2, num_generations=1,
                        advantage_estimator="reinforce_pp").num_generations == 1


def grpo(tmp_path, rows):
    args = GRPOConfig(**online_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                                    num_generations=2))
    return GRPOTrainer("posttrain/tiny-qwen2", reward_funcs=first_token_reward, args=args,
                       train_dataset=Dataset.from_list(rows))


def test_grpo_refuses_a_none_prompt_at_construction(tmp_path):
    rows = [{"prompt": f"reverse {i} ="} for i in range(8)]
    rows[5]["prompt"] = None
    with pytest.raises(TokenizeError, match="train_dataset: row 5, column 'prompt': expected a string .* got None"):
        grpo(tmp_path, rows)


def test_grpo_refuses_an_empty_prompt_its_tokenizer_cannot_start_from(tmp_path):
    rows = [{"prompt": f"reverse {i} ="} for i in range(8)]
    rows[3]["prompt"] = ""
    with pytest.raises(TokenizeError, match="row 3, column 'prompt': the prompt is the empty string .* no BOS"):
        grpo(tmp_path, rows)


def test_sft_trains_on_an_empty_prompt(tmp_path):
    """docs/datasets.md: a standard prompt may be empty; SFT then scores the completion alone."""
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    rows = [{"prompt": "", "completion": " 1274"}, {"prompt": "reverse 4721 =", "completion": " 1274"}] * 2
    trainer = SFTTrainer(TINY, args=SFTConfig(**config_kwargs(tmp_path, max_steps=1)),
                         train_dataset=Dataset.from_list(rows))
    assert len(trainer.train_dataset) == 4  # the empty-prompt rows are kept
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses and all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize("bad", [math.nan, math.inf, None])
def test_reward_trainer_refuses_a_bad_margin(tmp_path, bad):
    rows = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "margin": m}
            for m in (1.0, 0.5, bad, 0.0)]
    with pytest.raises(FormatError, match="row 2, column 'margin': expected a finite number"):
        RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=Dataset.from_list(rows))
