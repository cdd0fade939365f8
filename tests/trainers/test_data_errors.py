"""Bad rows found late are still named: a streamed prompt, the evaluation set, a missing column."""

import pytest
from datasets import IterableDataset
from tests.helpers.online import first_token_reward, online_args, prompts

from posttrain.data.tokenize import TokenizeError
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def test_a_none_prompt_in_a_stream_is_named_by_row_and_column(tmp_path):
    rows = list(prompts(8))
    rows[5]["prompt"] = None  # the third generation batch (2 prompts a step)
    data = IterableDataset.from_generator(lambda: iter(rows))
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_steps=4))
    trainer = GRPOTrainer("posttrain/tiny-qwen2", first_token_reward, args=args, train_dataset=data)
    with pytest.raises(TokenizeError, match=r"streamed train_dataset \(pass 0\): row 5, column 'prompt': expected "
                                            r".*got None"):
        trainer.train()
    assert trainer.state.global_step == 2  # the first two batches trained
