"""The online trainers as drop-ins for TRL's older calls: tokenizer=, config fields given to the trainer, a
list of dicts as the dataset, and a model card on every save (streamed datasets: test_online_streaming.py)."""

import os

import pytest
import torch
import yaml
from tests.helpers.online import first_token_reward, online_args, prompts

from posttrain.models.loading import UntrainedHeadWarning, load_causal_lm, load_tokenizer
from posttrain.models.value_head import CausalLMWithValueHead, PolicyWithCritic
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.ppo import PPOConfig, PPOTrainer
from posttrain.trainers.reinforce_pp import ReinforcePPConfig, ReinforcePPTrainer
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

MODEL = "posttrain/tiny-qwen2"
TRAINERS = [(GRPOTrainer, GRPOConfig, {"num_generations": 4}), (RLOOTrainer, RLOOConfig, {}),
            (ReinforcePPTrainer, ReinforcePPConfig, {}), (PPOTrainer, PPOConfig, {})]
IDS = ["grpo", "rloo", "reinforce_pp", "ppo"]


def build(trainer_class, args, **kwargs):
    """Each trainer called by keyword, as TRL's current signatures name the arguments."""
    return trainer_class(model=MODEL, reward_funcs=first_token_reward, args=args, **kwargs)


def read_card(folder):
    _, meta, body = open(os.path.join(folder, "README.md")).read().split("---\n", 2)
    return yaml.safe_load(meta), body


@pytest.mark.parametrize("trainer_class, config_class, extra", TRAINERS, ids=IDS)
def test_tokenizer_and_config_fields_given_to_the_trainer(tmp_path, trainer_class, config_class, extra):
    args = config_class(**online_args(tmp_path, **extra))
    tok = load_tokenizer(MODEL)
    with pytest.warns(FutureWarning, match=r"\['temperature'\].*fields"):
        trainer = build(trainer_class, args, train_dataset=prompts(8), tokenizer=tok, temperature=0.5)
    assert trainer.processing_class is tok
    assert trainer.args.temperature == 0.5 and trainer.sampling.temperature == 0.5
    assert args.temperature != 0.5  # applied to a copy: the caller's config is unchanged


@pytest.mark.parametrize("trainer_class, config_class, extra", TRAINERS, ids=IDS)
def test_an_unknown_keyword_is_a_type_error_naming_it(tmp_path, trainer_class, config_class, extra):
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['betta'\]"):
        build(trainer_class, config_class(**online_args(tmp_path, **extra)), train_dataset=prompts(8), betta=0.1)


def test_tokenizer_and_processing_class_together_are_refused(tmp_path):
    tok = load_tokenizer(MODEL)
    with pytest.raises(ValueError, match="processing_class= or its old name tokenizer="):
        build(GRPOTrainer, GRPOConfig(**online_args(tmp_path, num_generations=4)), train_dataset=prompts(8),
              processing_class=tok, tokenizer=load_tokenizer(MODEL))


def test_a_list_of_dicts_trains(tmp_path):
    rows = [{"prompt": f"Reverse {i}{i + 1}:", "hint": i} for i in range(8)]
    seen = []

    def reward(completion_ids, hint, **kwargs):
        seen.extend(hint)
        return first_token_reward(completion_ids)

    trainer = RLOOTrainer(MODEL, reward, args=RLOOConfig(**online_args(tmp_path, max_steps=1)), train_dataset=rows,
                          eval_dataset=rows[:2])
    assert trainer.train_dataset.column_names == ["prompt", "hint"] and len(trainer.eval_dataset) == 2
    trainer.train()
    assert trainer.state.global_step == 1 and set(seen) <= set(range(8)) and seen


def test_a_list_whose_column_changes_type_names_the_rows(tmp_path):
    rows = [{"prompt": "Reverse 12:"}, {"prompt": ["not", "text"]}]
    with pytest.raises(ValueError, match=r"column 'prompt' is a str in row 0 but a list of str in row 1"):
        build(GRPOTrainer, GRPOConfig(**online_args(tmp_path, num_generations=4)), train_dataset=rows)


def test_a_transformed_dataset_is_refused(tmp_path):
    data = prompts(8).with_transform(lambda batch: batch)
    with pytest.raises(ValueError, match="with_transform"):
        build(GRPOTrainer, GRPOConfig(**online_args(tmp_path, num_generations=4)), train_dataset=data)


@pytest.mark.parametrize("trainer_class, config_class, extra, name, key", [
    (GRPOTrainer, GRPOConfig, {"num_generations": 4}, "GRPO", "@article{shao2024deepseekmath"),
    (RLOOTrainer, RLOOConfig, {}, "RLOO", "@inproceedings{ahmadian2024back"),
    (ReinforcePPTrainer, ReinforcePPConfig, {}, "REINFORCE++", "@article{hu2025reinforce"),
    (PPOTrainer, PPOConfig, {}, "PPO", "@article{schulman2017proximal"),  # a value-head model: its own save
], ids=IDS)
def test_save_model_writes_the_model_card(tmp_path, trainer_class, config_class, extra, name, key):
    trainer = build(trainer_class, config_class(**online_args(tmp_path, **extra)), train_dataset=prompts(8))
    trainer.save_model(str(tmp_path / "saved"))
    meta, body = read_card(tmp_path / "saved")
    assert meta["base_model"] == MODEL and meta["model_name"] == "saved" and "posttrain" in meta["tags"]
    assert f"trained with posttrain's `{trainer_class.__name__}` ({name})" in body
    assert key in body and "## Citations" in body
    assert not trainer.aux_loss_enabled  # BaseTrainer's default: no router loss in the online losses


def test_ppo_value_head_save_keeps_weights_beside_the_card(tmp_path):
    trainer = build(PPOTrainer, PPOConfig(**online_args(tmp_path)), train_dataset=prompts(8))
    assert isinstance(trainer.model, CausalLMWithValueHead)
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = CausalLMWithValueHead.from_pretrained(str(tmp_path / "saved"))
    torch.testing.assert_close(reloaded.v_head.weight, trainer.model.v_head.weight)
    assert "Proximal Policy Optimization" in read_card(tmp_path / "saved")[1]


def test_sft_card_names_the_method(tmp_path):
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", disable_tqdm=True)
    trainer = SFTTrainer(MODEL, args=args, train_dataset=[{"prompt": "Reverse 12:", "completion": " 21"}])
    trainer.save_model(str(tmp_path / "sft"))
    _, body = read_card(tmp_path / "sft")
    assert "`SFTTrainer` (SFT (supervised fine-tuning))" in body and "## Citations" not in body
    assert trainer.aux_loss_enabled is False  # the tiny model has no router


def test_ppo_value_model_given_as_a_causal_lm_is_converted(tmp_path):
    critic = load_causal_lm(MODEL)
    with pytest.warns(UntrainedHeadWarning, match="randomly initialised score head"):
        trainer = build(PPOTrainer, PPOConfig(**online_args(tmp_path)), train_dataset=prompts(8),
                        value_model=critic)
    assert isinstance(trainer.model, PolicyWithCritic)
    assert "ForSequenceClassification" in type(trainer.model.value_model).__name__


def test_ppo_reward_model_path_is_the_reward(tmp_path):
    """reward_model_path (in the config or, with the FutureWarning, given to the trainer) is PPO's reward."""
    args = PPOConfig(**online_args(tmp_path, reward_model_path="posttrain/tiny-qwen2-seqcls"))
    trainer = PPOTrainer(args=args, model=MODEL, train_dataset=prompts(8))
    assert trainer.reward_scorer.names != ["_no_reward"] and not trainer._manual_only
    with pytest.warns(FutureWarning, match="reward_model_path"):
        given = PPOTrainer(args=PPOConfig(**online_args(tmp_path)), model=MODEL, train_dataset=prompts(8),
                           reward_model_path="posttrain/tiny-qwen2-seqcls")
    assert given.reward_scorer.names == trainer.reward_scorer.names
