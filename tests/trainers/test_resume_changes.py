"""Resuming with settings that differ from the checkpoint's: refused where the stored state cannot be used
under the new settings, said where the run's meaning changes."""

import pytest
from tests.helpers.online import first_token_reward, online_args, prompts

from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def grpo(tmp_path, **overrides):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, save_strategy="steps", save_steps=1,
                                    **{"steps_per_generation": 4, **overrides}))
    return GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=prompts(6))


@pytest.mark.parametrize("changed, message", [
    ({"steps_per_generation": 2}, "planned with steps_per_generation=4; this run has steps_per_generation=2"),
    ({"num_iterations": 2}, "planned with num_iterations=1; this run has num_iterations=2"),
])
def test_grpo_resumed_inside_a_generation_batch_with_another_plan_is_refused(tmp_path, changed, message):
    grpo(tmp_path, max_steps=1).train()  # steps_per_generation 4, ga 2: checkpoint-1 is inside the batch
    with pytest.raises(ValueError, match=message + r".*Resume with the checkpoint's"):
        grpo(tmp_path, max_steps=3, **changed).train(resume_from_checkpoint=True)
