"""Non-finite and out-of-range numeric settings of every config, transformers' fields included, are refused
before anything loads, naming the field: from Python, from the command line (exit 2, one line) and from YAML."""

import math

import pytest

from posttrain import cli
from posttrain.trainers.dpo import DPOConfig
from posttrain.trainers.grpo import GRPOConfig
from posttrain.trainers.kto import KTOConfig
from posttrain.trainers.ppo import PPOConfig
from posttrain.trainers.reward import RewardConfig
from posttrain.trainers.sft import SFTConfig

TINY = ["--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name", "zen"]


@pytest.mark.parametrize("config_class, overrides, message", [
    (SFTConfig, {"learning_rate": math.inf}, "learning_rate must be a finite number >= 0, got inf"),
    (SFTConfig, {"learning_rate": math.nan}, "learning_rate must be a finite number >= 0, got nan"),
    (SFTConfig, {"learning_rate": -1e-3}, "learning_rate must be a finite number >= 0, got -0.001"),
    (SFTConfig, {"weight_decay": math.inf}, "weight_decay must be a finite number >= 0, got inf"),
    (SFTConfig, {"adam_epsilon": 0.0}, "adam_epsilon must be a finite number > 0, got 0.0"),
    (SFTConfig, {"adam_beta2": 1.0}, r"adam_beta2 must be a finite number in \[0, 1\), got 1.0"),
    (SFTConfig, {"max_grad_norm": math.nan}, "max_grad_norm must be a finite number >= 0, got nan"),
    (SFTConfig, {"per_device_train_batch_size": 0}, "per_device_train_batch_size must be a finite number >= 1"),
    (SFTConfig, {"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be a finite number >= 1"),
    (SFTConfig, {"max_steps": -1, "num_train_epochs": 0}, "max_steps=-1 and num_train_epochs=0: the run would "
                                                          "train nothing"),
    (DPOConfig, {"beta": math.nan}, "beta must be a finite number, got nan"),
    (DPOConfig, {"beta": math.inf}, "beta must be a finite number, got inf"),
    (KTOConfig, {"desirable_weight": math.inf}, "desirable_weight must be a finite number, got inf"),
    (RewardConfig, {"center_rewards_coefficient": math.nan}, r"center_rewards_coefficient must be a finite number "
                                                             r"\(or None\), got nan"),
    (GRPOConfig, {"temperature": math.inf}, "temperature must be a finite number, got inf"),
    (GRPOConfig, {"reward_weights": [1.0, math.nan]}, r"every entry of reward_weights must be a finite number"),
    (PPOConfig, {"vf_coef": math.inf}, "vf_coef must be a finite number, got inf"),
])
def test_every_config_refuses_non_finite_and_out_of_range_numbers(config_class, overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        config_class(output_dir=str(tmp_path), **overrides)


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("x")
    with pytest.raises(ValueError, match="output_dir .*notes.txt' is a file; give a folder"):
        SFTConfig(output_dir=str(path))


def test_the_limits_themselves_are_accepted(tmp_path):
    config = SFTConfig(output_dir=str(tmp_path), learning_rate=0.0, weight_decay=0.0, max_grad_norm=0.0,
                       adam_beta1=0.0, max_steps=3, num_train_epochs=0, save_total_limit=0)
    assert config.learning_rate == 0.0 and config.max_steps == 3


@pytest.mark.parametrize("argv, message", [
    (["--learning_rate", "nan"], "learning_rate must be a finite number >= 0, got nan"),
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size must be a finite number >= 1, got 0"),
    (["--max_steps", "-1", "--num_train_epochs", "0"], "the run would train nothing"),
    (["--weight_decay", "inf"], "weight_decay must be a finite number >= 0, got inf"),
])
def test_the_cli_gives_a_usage_error_of_one_line(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sft", *TINY, "--output_dir", str(tmp_path / "out"), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 2  # usage + error


def test_the_cli_refuses_an_output_dir_that_is_a_file(tmp_path, capsys):
    path = tmp_path / "out"
    path.write_text("x")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sft", *TINY, "--output_dir", str(path)])
    assert exit_.value.code == 2 and "is a file; give a folder" in capsys.readouterr().err


def test_yaml_values_are_checked_too(tmp_path, capsys):
    path = tmp_path / "dpo.yaml"
    path.write_text("beta: .inf\nlearning_rate: 1e-3\n")
    with pytest.raises(SystemExit) as exit_:
        cli.parse("dpo", ["--config", str(path), *TINY, "--output_dir", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "beta must be a finite number, got inf" in capsys.readouterr().err
