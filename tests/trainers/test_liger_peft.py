"""use_liger_kernel=True with a PEFT set-up TRL refuses (an adapter on the output layer, prompt learning) is refused
at construction with the reason, by offline and online trainers alike; other adapters pass that check."""

import importlib.util

import pytest
from tests.helpers.online import first_token_reward, online_args, prompts
from peft import LoraConfig, PromptTuningConfig
from tests.helpers.preference import TINY, config_kwargs

from posttrain.trainers.dpo import DPOConfig, DPOTrainer
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

PAIRS = [{"prompt": "Reverse 12:", "chosen": " 21", "rejected": " 2x"}] * 4
LORA_HEAD = dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
SAVED_HEAD = dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM")


def dpo(tmp_path, peft_config):
    return DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, use_liger_kernel=True)), train_dataset=PAIRS,
                      peft_config=peft_config)


def grpo(tmp_path, peft_config):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, use_liger_kernel=True))
    return GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(8), peft_config=peft_config)


@pytest.mark.parametrize("build", [dpo, grpo], ids=["dpo", "grpo"])
@pytest.mark.parametrize("head", [LORA_HEAD, SAVED_HEAD], ids=["lora_on_lm_head", "lm_head_in_modules_to_save"])
def test_an_adapter_on_the_output_layer_is_refused(tmp_path, build, head):
    with pytest.raises(ValueError, match=r"adapter on the output layer.*lm_head\.weight directly.*no gradient"):
        build(tmp_path, LoraConfig(**head))


@pytest.mark.parametrize("build", [dpo, grpo], ids=["dpo", "grpo"])
def test_prompt_learning_is_refused(tmp_path, build):
    config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with pytest.raises(ValueError, match=r"prompt-learning PEFT adapter \(\['PROMPT_TUNING'\]\).*PeftModel.forward"):
        build(tmp_path, config)


def test_lora_off_the_output_layer_passes_the_peft_check(tmp_path):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    if importlib.util.find_spec("liger_kernel") is None:  # the only refusal left is the missing package
        with pytest.raises(ValueError, match="liger-kernel is not installed"):
            dpo(tmp_path, config)
    else:
        assert dpo(tmp_path, config).args.use_liger_kernel


def test_the_same_adapters_without_liger_are_accepted(tmp_path):
    trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=PAIRS,
                         peft_config=LoraConfig(**LORA_HEAD))
    assert any("lm_head" in name and "lora_" in name for name, _ in trainer.model.named_parameters())
