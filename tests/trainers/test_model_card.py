"""save_model writes a model card beside the weights, as TRL does (issue #18)."""

import os

import yaml
from tests.helpers.preference import TINY, config_kwargs

from posttrain.trainers.dpo import DPOConfig, DPOTrainer
from posttrain.trainers.kto import KTOConfig, KTOTrainer

PAIRS = [{"prompt": "Reverse 12:", "chosen": " 21", "rejected": " 12"},
         {"prompt": "Reverse 34:", "chosen": " 43", "rejected": " 34"}]


def read_card(folder):
    text = open(os.path.join(folder, "README.md")).read()
    _, meta, body = text.split("---\n", 2)
    return yaml.safe_load(meta), body


def test_save_model_writes_a_card_with_base_model_method_hyperparameters_and_citation(tmp_path):
    args = DPOConfig(**config_kwargs(tmp_path, beta=0.25, max_steps=1))
    trainer = DPOTrainer(TINY, args=args, train_dataset=PAIRS)
    trainer.train()
    out = tmp_path / "final"
    trainer.save_model(str(out))
    meta, body = read_card(out)
    assert meta["base_model"] == TINY and meta["model_name"] == "final"
    assert {"posttrain", "dpo"} <= set(meta["tags"])
    assert "trained with posttrain's `DPOTrainer` (DPO)" in body
    assert "- beta: 0.25" in body and "- max_steps: 1" in body and "- loss_type: sigmoid" in body
    assert "- transformers: " in body and "- torch: " in body
    assert "@inproceedings{rafailov2023direct" in body and "Direct Preference Optimization" in body


def test_the_card_names_the_dataset_and_each_method(tmp_path):
    from datasets import Dataset, DatasetInfo

    data = Dataset.from_list(PAIRS, info=DatasetInfo(dataset_name="my-pairs"))
    trainer = KTOTrainer(TINY, args=KTOConfig(**config_kwargs(tmp_path)), train_dataset=data)
    trainer.save_model(str(tmp_path / "kto"))
    meta, body = read_card(tmp_path / "kto")
    assert meta["datasets"] == ["my-pairs"] and "kto" in meta["tags"]
    assert "on the my-pairs dataset" in body and "@article{ethayarajh2024kto" in body


def test_create_model_card_as_push_to_hub_calls_it_writes_posttrains_card(tmp_path):
    trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=PAIRS)
    trainer.create_model_card(model_name="my-dpo-model")
    meta, body = read_card(tmp_path)
    assert meta["model_name"] == "my-dpo-model" and "@inproceedings{rafailov2023direct" in body


def test_the_card_links_only_hub_ids_and_lists_max_steps_without_epochs(tmp_path, monkeypatch):
    from posttrain.trainers.base import _model_reference

    trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, max_steps=3)), train_dataset=PAIRS)
    trainer.save_model(str(tmp_path / "out"))
    _, body = read_card(tmp_path / "out")
    assert "huggingface.co" not in body and f"`{TINY}`" in body  # a built-in model is not on the hub
    assert "- max_steps: 3" in body and "num_train_epochs" not in body
    assert _model_reference(str(tmp_path)) == f"`{tmp_path}`"
    (tmp_path / "out" / "sft").mkdir()
    monkeypatch.chdir(tmp_path / "out")  # a relative local folder that looks like org/name
    assert _model_reference("sft/") == "`sft/`" and _model_reference("./sft") == "`./sft`"
    assert _model_reference("HuggingFaceTB/SmolLM2-135M") == \
        "[HuggingFaceTB/SmolLM2-135M](https://huggingface.co/HuggingFaceTB/SmolLM2-135M)"
