"""lean_activations: every trainer patches the models it trains (and the frozen copies it makes), by default;
False, or torch_compile, leaves transformers' modules."""

import pytest
from tests.helpers.online import first_token_reward, online_args, prompts

from posttrain.accel.lean import is_lean
from posttrain.models.loading import load_causal_lm
from posttrain.tasks.builtin import zen
from posttrain.trainers.ppo import PPOConfig, PPOTrainer
from posttrain.trainers.sft import SFTConfig, SFTTrainer

MODEL = "posttrain/tiny-qwen2"
LAYERS = 2  # tiny-qwen2: two norms and an MLP per layer, and the final norm


def lean_count(model) -> int:
    return sum(map(is_lean, model.modules()))


def sft(tmp_path, model, **kw):
    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, disable_tqdm=True, **kw)
    return SFTTrainer(model, args=args, train_dataset=zen())


@pytest.mark.usefixtures("one_thread")
def test_sft_trains_the_lean_model_by_default_and_the_plain_one_when_asked(tmp_path):
    model = load_causal_lm(MODEL)
    trainer = sft(tmp_path, model)
    assert trainer.model is model and lean_count(model) == 3 * LAYERS + 1
    trainer.train()
    assert lean_count(sft(tmp_path, model, lean_activations=False).model) == 0  # the same object, plain again
    assert lean_count(sft(tmp_path, model, torch_compile=True).model) == 0


def test_ppo_patches_policy_critic_and_reference(tmp_path):
    args = PPOConfig(**online_args(tmp_path))
    trainer = PPOTrainer(args=args, model=MODEL, reward_funcs=first_token_reward, train_dataset=prompts(8),
                         value_model=f"{MODEL}-seqcls")
    assert lean_count(trainer.policy) == lean_count(trainer.model.value_model) == 3 * LAYERS + 1
    assert lean_count(trainer.ref_model) == 3 * LAYERS + 1
    plain = PPOTrainer(args=PPOConfig(**online_args(tmp_path), lean_activations=False), model=MODEL,
                       reward_funcs=first_token_reward, train_dataset=prompts(8), value_model=f"{MODEL}-seqcls")
    assert lean_count(plain.model) == lean_count(plain.ref_model) == 0
