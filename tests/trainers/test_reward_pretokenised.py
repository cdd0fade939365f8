"""RewardTrainer on rows that are already token ids (TRL's `chosen_input_ids` / `rejected_input_ids`,
or `chosen_ids` / `rejected_ids` with `prompt_ids`) trains exactly as on the same rows as text."""

import pytest
from datasets import Dataset
from tests.helpers.preference import TINY, config_kwargs

from posttrain.data.formats import FormatError
from posttrain.data.tokenize import encode_prompt_completion
from posttrain.tasks.builtin import zen
from posttrain.trainers.reward import RewardConfig, RewardTrainer


def _losses(trainer):
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _text_and_ids(tmp_path):
    text = zen("preference").select(range(8))
    reference = RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path / "text", max_steps=2)),
                              train_dataset=text)
    tok = reference.processing_class
    rows = []
    for r in text:
        chosen = encode_prompt_completion(tok, r["prompt"], r["chosen"])
        rejected = encode_prompt_completion(tok, r["prompt"], r["rejected"])
        rows.append({"prompt_ids": chosen["prompt_ids"], "chosen_ids": chosen["completion_ids"],
                     "rejected_ids": rejected["completion_ids"]})
    return reference, rows


def test_pretokenised_rows_train_like_text_rows(tmp_path):
    reference, rows = _text_and_ids(tmp_path)
    expected = _losses(reference)
    split = RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path / "ids", max_steps=2)),
                          train_dataset=Dataset.from_list(rows))
    assert split.train_dataset["chosen_ids"] == [r["chosen_ids"] for r in rows]
    assert _losses(split) == expected
    whole = [{"chosen_input_ids": r["prompt_ids"] + r["chosen_ids"],
              "rejected_input_ids": r["prompt_ids"] + r["rejected_ids"]} for r in rows]
    trl_style = RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path / "trl", max_steps=2)),
                              train_dataset=Dataset.from_list(whole))
    # the shared prefix becomes the prompt; a reward model scores the whole sequence either way
    assert all(len(p) >= len(r["prompt_ids"]) for p, r in zip(trl_style.train_dataset["prompt_ids"], rows))
    assert _losses(trl_style) == pytest.approx(expected, rel=1e-6)


def test_pretokenised_rows_are_checked(tmp_path):
    bad = Dataset.from_list([{"chosen_ids": [1, 2, 3], "rejected_ids": [1.0, 2.5]}])  # floats are no token ids
    with pytest.raises(FormatError, match=r"row 0, column 'rejected_ids': expected a list of token ids"):
        RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=bad)
    nan_margin = Dataset.from_list([{"chosen_ids": [1, 2, 3], "rejected_ids": [1, 2, 4], "margin": float("nan")}])
    with pytest.raises(FormatError, match="column 'margin': expected a finite number"):
        RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=nan_margin)
