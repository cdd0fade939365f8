"""TRL users' code as written runs on the offline trainers (issue #13): the older calling conventions,
plain lists as datasets, streaming, evaluate on new data, a reference that is the policy object,
model_init_kwargs, model tags and TRL's refusals."""

import math

import pytest
import torch
from datasets import Dataset, IterableDataset
from tests.helpers.preference import TINY, assert_all_changed, config_kwargs, snapshot

from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.trainers.bco import BCOConfig, BCOTrainer
from posttrain.trainers.dpo import DPOConfig, DPOTrainer
from posttrain.trainers.kto import KTOConfig, KTOTrainer
from posttrain.trainers.reward import RewardConfig, RewardTrainer

PAIRS = [{"prompt": f"Reverse {a}{b}:", "chosen": f" {b}{a}", "rejected": f" {a}{b}x"}
         for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 1)]]
TRAINERS = {"dpo": (DPOTrainer, DPOConfig), "kto": (KTOTrainer, KTOConfig), "bco": (BCOTrainer, BCOConfig),
            "reward": (RewardTrainer, RewardConfig)}


@pytest.mark.parametrize("name", list(TRAINERS))
def test_tokenizer_is_the_old_name_of_processing_class_and_a_list_of_dicts_is_a_dataset(tmp_path, name):
    trainer_class, config_class = TRAINERS[name]
    tokenizer = load_tokenizer(TINY)
    trainer = trainer_class(TINY, args=config_class(**config_kwargs(tmp_path)), tokenizer=tokenizer,
                            train_dataset=PAIRS, eval_dataset=PAIRS[:2])
    assert trainer.processing_class is tokenizer
    assert "prompt_ids" in trainer.train_dataset.column_names and "prompt_ids" in trainer.eval_dataset.column_names
    assert trainer.model.model_tags[:2] == ["posttrain", trainer_class._tag]


def test_a_column_whose_type_changes_between_rows_is_named_with_its_rows(tmp_path):
    rows = PAIRS[:2] + [{"prompt": "Reverse 12:", "chosen": " 21", "rejected": 12}]
    with pytest.raises(ValueError, match=r"column 'rejected' is a str in row 0 but a number in row 2"):
        DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=rows)
    with pytest.raises(TypeError, match="row 1 is a str"):
        DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=[PAIRS[0], "text"])


def test_config_fields_given_to_the_trainer_are_set_on_a_copy_with_a_deprecation_warning(tmp_path):
    args = DPOConfig(**config_kwargs(tmp_path))
    with pytest.warns(FutureWarning, match=r"\['beta', 'max_length'\].*DPOConfig\(\.\.\., beta=0\.3, max_length=64\)"):
        trainer = DPOTrainer(TINY, args=args, train_dataset=PAIRS, beta=0.3, max_length=64)
    assert (trainer.args.beta, trainer.args.max_length) == (0.3, 64)
    assert (args.beta, args.max_length) == (0.1, 1024)  # the caller's config is left alone
    with pytest.raises(ValueError, match="beta must be > 0"):  # checked as in the config
        DPOTrainer(TINY, args=args, train_dataset=PAIRS, beta=-1.0)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['betta'\]"):
        DPOTrainer(TINY, args=args, train_dataset=PAIRS, betta=0.3)
    with pytest.raises(ValueError, match="not both"):
        DPOTrainer(TINY, args=args, train_dataset=PAIRS, processing_class=load_tokenizer(TINY),
                   tokenizer=load_tokenizer(TINY))


@pytest.mark.parametrize("name", ["bco", "dpo", "kto"])
def test_ref_model_that_is_the_policy_object_becomes_a_frozen_copy_and_the_policy_trains(tmp_path, name):
    trainer_class, config_class = TRAINERS[name]
    model = load_causal_lm(TINY)
    trainer = trainer_class(model, ref_model=model, args=config_class(**config_kwargs(tmp_path)),
                            processing_class=load_tokenizer(TINY), train_dataset=PAIRS)
    assert trainer.ref_model is not None and trainer.ref_model is not model
    initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    before = snapshot(model)
    assert len(before) == len(list(model.parameters()))  # the policy was not frozen
    trainer.train()
    assert_all_changed(before, model)
    assert all(torch.equal(p, initial[n]) for n, p in trainer.ref_model.named_parameters())


def test_ref_model_that_is_the_peft_policy_uses_the_disabled_adapter(tmp_path):
    from peft import LoraConfig

    model = load_causal_lm(TINY)
    trainer = DPOTrainer(model, ref_model=model, args=DPOConfig(**config_kwargs(tmp_path)), train_dataset=PAIRS,
                         peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert trainer.ref_model is None  # the reference is the policy with its adapter disabled
    trainer.train()


@pytest.mark.parametrize("name", ["dpo", "reward"])
def test_evaluate_prepares_raw_data_and_dicts_of_it_given_after_construction(tmp_path, name):
    trainer_class, config_class = TRAINERS[name]
    trainer = trainer_class(TINY, args=config_class(**config_kwargs(tmp_path)), train_dataset=PAIRS)
    single = trainer.evaluate(eval_dataset=Dataset.from_list(PAIRS[:3]))
    assert single["eval_loss"] > 0
    several = trainer.evaluate(eval_dataset={"a": Dataset.from_list(PAIRS[:3]), "b": PAIRS[3:]})
    assert several["eval_a_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    assert several["eval_b_loss"] > 0
    logged = [row for row in trainer.state.log_history if "eval_b_loss" in row]
    assert len(logged) == 1 and logged[0]["eval_num_tokens"] > 0  # the raw rows were tokenised and scored


def stream(rows):
    return IterableDataset.from_generator(lambda: iter(rows))


@pytest.mark.parametrize("name", list(TRAINERS))
def test_streamed_train_and_eval_data_are_tokenised_lazily(tmp_path, name):
    trainer_class, config_class = TRAINERS[name]
    args = config_class(**config_kwargs(tmp_path, max_steps=2, per_device_eval_batch_size=2))
    trainer = trainer_class(TINY, args=args, train_dataset=stream(PAIRS),
                            eval_dataset={"held": stream(PAIRS[:2]), "more": Dataset.from_list(PAIRS[2:4])})
    before = snapshot(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 2
    assert_all_changed(before, trainer.model)
    metrics = trainer.evaluate()
    assert metrics["eval_held_loss"] > 0 and metrics["eval_more_loss"] > 0
    assert trainer.evaluate(eval_dataset=stream(PAIRS[:2]))["eval_loss"] == pytest.approx(metrics["eval_held_loss"])


def test_streaming_needs_max_steps(tmp_path):
    with pytest.raises(ValueError, match="set max_steps"):
        DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, max_steps=-1)), train_dataset=stream(PAIRS))
    with pytest.raises(ValueError, match="precompute_ref_log_probs"):
        DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, precompute_ref_log_probs=True)),
                   train_dataset=stream(PAIRS))
    with pytest.raises(ValueError, match="embedding_func"):
        BCOTrainer(TINY, args=BCOConfig(**config_kwargs(tmp_path)), train_dataset=stream(PAIRS),
                   embedding_func=lambda ids, mask: ids.float(), embedding_tokenizer=load_tokenizer(TINY))


def test_evaluate_on_new_data_after_the_reference_was_precomputed_and_freed(tmp_path):
    """Before training the model is still its own reference: new data is scored with it (as TRL does), giving the
    loss a trainer built with that eval data gives (log 2 for DPO at the reference); after training, refused."""
    args = DPOConfig(**config_kwargs(tmp_path, precompute_ref_log_probs=True))
    trainer = DPOTrainer(TINY, args=args, train_dataset=PAIRS, eval_dataset=PAIRS[:2])
    assert trainer.evaluate()["eval_loss"] > 0  # the eval data given at construction was scored
    new = trainer.evaluate(eval_dataset=PAIRS[2:])["eval_loss"]
    built = DPOTrainer(TINY, args=args, train_dataset=PAIRS, eval_dataset=PAIRS[2:]).evaluate()["eval_loss"]
    assert new == pytest.approx(built, abs=1e-6) and new == pytest.approx(math.log(2), abs=1e-4)
    trainer.train()
    with pytest.raises(ValueError, match="trained since.*pass it as eval_dataset= to the trainer"):
        trainer.evaluate(eval_dataset=PAIRS[2:])


def test_refusals_as_trl(tmp_path):
    args = DPOConfig(**config_kwargs(tmp_path))
    with pytest.raises(ValueError, match="train_dataset is required"):
        DPOTrainer(TINY, args=args, train_dataset=None)
    with pytest.raises(ValueError, match="with_transform"):
        DPOTrainer(TINY, args=args, train_dataset=Dataset.from_list(PAIRS).with_transform(lambda batch: batch))
    with pytest.raises(ValueError, match="liger-kernel is not installed.*never built"):
        DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, use_liger_kernel=True)), train_dataset=PAIRS)


def test_model_init_kwargs_as_trl_reads_them(tmp_path):
    args = DPOConfig(**config_kwargs(tmp_path, model_init_kwargs={"torch_dtype": "bfloat16",
                                                                   "attn_implementation": "eager",
                                                                   "trust_remote_code": False}))
    trainer = DPOTrainer(TINY, args=args, train_dataset=PAIRS)
    assert trainer.model.dtype == torch.bfloat16
    assert trainer.model.config._attn_implementation == "eager"
    args = DPOConfig(**config_kwargs(tmp_path, model_init_kwargs={"dtype": "float32", "torch_dtype": "bfloat16"}))
    with pytest.raises(ValueError, match="give one of them"):
        DPOTrainer(TINY, args=args, train_dataset=PAIRS)


def test_trust_remote_code_in_model_init_kwargs_loads_the_folders_own_model_and_tokenizer(tmp_path, remote_code_model):
    folder = remote_code_model
    trainer = DPOTrainer(str(folder), args=DPOConfig(**config_kwargs(tmp_path / "off")), train_dataset=PAIRS)
    assert type(trainer.model).__name__ == "Qwen2ForCausalLM"  # off by default: transformers' own class
    args = DPOConfig(**config_kwargs(tmp_path / "on", model_init_kwargs={"trust_remote_code": True}))
    trainer = DPOTrainer(str(folder), args=args, train_dataset=PAIRS)
    assert (type(trainer.model).__name__, type(trainer.processing_class).__name__) == ("RemoteLM", "RemoteTokenizer")
