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


# ------------------------------------------------------------------ offline trainers' data

from posttrain.data.formats import FormatError  # noqa: E402
from posttrain.trainers.dpo import DPOConfig, DPOTrainer  # noqa: E402
from posttrain.trainers.kto import KTOConfig, KTOTrainer  # noqa: E402
from posttrain.trainers.reward import RewardConfig, RewardTrainer  # noqa: E402
from posttrain.trainers.sft import SFTConfig, SFTTrainer  # noqa: E402

TINY = "posttrain/tiny-qwen2"
PAIRS = [{"prompt": f"say {i}", "chosen": f" {i}", "rejected": f" {i + 1}"} for i in range(4)]


def build(trainer, config, train, eval_data=None, **fields):
    return trainer(TINY, args=config(output_dir="unused", report_to="none", **fields), train_dataset=train,
                   eval_dataset=eval_data)


@pytest.mark.parametrize("trainer, config", [(DPOTrainer, DPOConfig), (RewardTrainer, RewardConfig)])
def test_a_bad_evaluation_row_says_it_is_the_evaluation_set(trainer, config):
    bad = [dict(row) for row in PAIRS]
    bad[2]["chosen"] = None
    with pytest.raises(FormatError, match=r"^evaluation set \(eval_dataset\): row 2, column 'chosen'"):
        build(trainer, config, PAIRS, bad)


def test_sft_names_the_evaluation_set_too():
    with pytest.raises(FormatError, match=r"^evaluation set \(eval_dataset\): row 1, column 'completion'"):
        build(SFTTrainer, SFTConfig, [{"prompt": "a", "completion": "b"}] * 2,
              [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": None}])


@pytest.mark.parametrize("trainer, config, rows, message", [
    (DPOTrainer, DPOConfig, [{"prompt": "a", "chosen": "b", "rejectd": "c"}],
     r"needs the column\(s\) 'rejected' \(is 'rejectd' a misspelling\?\); this one has \['prompt', 'chosen', "
     r"'rejectd'\]"),
    (RewardTrainer, RewardConfig, [{"prompt": "a", "chosen": "b"}], r"needs the column\(s\) 'rejected'; this one has"),
    (KTOTrainer, KTOConfig, [{"prompt": "a", "completion": "b", "labl": True}],
     r"needs the column\(s\) 'label' \(is 'labl' a misspelling\?\)"),
])
def test_a_missing_or_misspelled_column_is_named(trainer, config, rows, message):
    with pytest.raises(FormatError, match=message):
        build(trainer, config, rows * 4)


def test_a_lone_surrogate_names_its_row():
    rows = [dict(row) for row in PAIRS]
    rows[3]["chosen"] = "bad \ud800 text"
    with pytest.raises(FormatError, match=r"train_dataset: row 3, column 'chosen': holds a lone surrogate "
                                          r"character '\\ud800' at position 4"):
        build(DPOTrainer, DPOConfig, rows)
    with pytest.raises(FormatError, match="row 1, column 'messages': holds a lone surrogate"):
        build(SFTTrainer, SFTConfig, [{"messages": [{"role": "user", "content": "ok"}]},
                                      {"messages": [{"role": "user", "content": "\udc80"}]}])


@pytest.mark.parametrize("trainer, config", [(DPOTrainer, DPOConfig), (RewardTrainer, RewardConfig)])
def test_chosen_equal_to_rejected_is_warned(trainer, config, caplog):
    same = [{**row, "rejected": row["chosen"]} for row in PAIRS]
    with caplog.at_level("WARNING", logger="posttrain"):
        build(trainer, config, same)
    assert "train data: every pair has chosen == rejected" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain"):
        build(trainer, config, PAIRS[:3] + same[3:])
    assert "1 of 4 pairs have chosen == rejected" in caplog.text


def test_sft_counts_the_rows_cut_at_max_length(caplog):
    rows = [{"prompt": "a", "completion": " ".join(["word"] * n)} for n in (2, 40, 3, 60)]
    with caplog.at_level("WARNING"):
        trainer = build(SFTTrainer, SFTConfig, rows, max_length=16)
    assert "2 of 4 rows are longer than max_length=16 tokens and were cut" in caplog.text
    assert "indexing errors" not in caplog.text and "Token indices sequence length" not in caplog.text
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) == 16


def test_grpo_warns_once_when_prompts_go_past_the_models_positions(tmp_path, caplog):
    rows = [{"prompt": "1 " * 600}, {"prompt": "2 " * 600}] * 2  # 600+ tokens + 500 > 1,024 positions
    args = GRPOConfig(**online_args(tmp_path, num_generations=2, max_prompt_length=None, max_completion_length=500,
                                    max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=1))
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=rows)
    with caplog.at_level("WARNING", logger="posttrain"):
        trainer._collate(rows[:2])
        trainer._collate(rows[:2])
    assert caplog.text.count("exceeds the model's max_position_embeddings=1024") == 1
    assert "max_prompt_length=None does not cut prompts" in caplog.text
