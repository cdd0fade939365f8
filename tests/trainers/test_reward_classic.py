"""The classic documentation's RewardTrainer example, as written (issue #13): `instruction` rows ranked
by `scores`, `tokenizer=`, an unused `ref_model=`, and a causal-LM object given as the reward model."""

import pytest
import torch
from tests.helpers.preference import TINY, assert_all_changed, config_kwargs, snapshot
from transformers import AutoModelForSequenceClassification

from posttrain.models.loading import UntrainedHeadWarning, load_causal_lm, load_tokenizer, resolve
from posttrain.trainers.reward import RewardConfig, RewardTrainer

CLASSIC = [{"instruction": "I have a fever.", "responses": [" rest", " see a doctor", " dance"], "scores": [1, 2, 0]},
           {"instruction": "I am thirsty.", "responses": [" drink water", " eat salt"], "scores": [1, 0]}]


def pairs(trainer):
    decode = trainer.processing_class.decode
    return [(decode(r["chosen_ids"], skip_special_tokens=True), decode(r["rejected_ids"], skip_special_tokens=True))
            for r in trainer.train_dataset]


def test_the_classic_example_runs_as_written(tmp_path):
    reward_model = AutoModelForSequenceClassification.from_pretrained(resolve(TINY + "-seqcls"), num_labels=1)
    model = load_causal_lm(TINY)
    with pytest.warns(UserWarning, match="a reward model has no reference model"):
        trainer = RewardTrainer(model=reward_model, tokenizer=load_tokenizer(TINY), ref_model=model,
                                args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=CLASSIC)
    # scores: higher is better, so " see a doctor" (2) beats " rest" (1) beats " dance" (0)
    assert [(c.split(".")[-1], r.split(".")[-1]) for c, r in pairs(trainer)] == [
        (" see a doctor", " rest"), (" see a doctor", " dance"), (" rest", " dance"), (" drink water", " eat salt")]
    before = snapshot(reward_model)
    trainer.train()
    assert_all_changed(before, reward_model)


def test_ranks_are_lower_is_better_and_rows_may_mix_ranks_and_scores(tmp_path):
    rows = [{"instruction": "I have a fever.", "responses": [" rest", " see a doctor", " dance"], "ranks": [1, 0, 2]},
            CLASSIC[0]]
    trainer = RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=rows)
    ranked = pairs(trainer)
    assert ranked[:3] == ranked[3:] and ranked[0][0].endswith(" see a doctor") and ranked[0][1].endswith(" rest")


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "responses": [" a", " b"], "scores": [1, 0], "ranks": [0, 1]},
     r"row 1 gives both: .* one of 'scores' \(higher is better\) or 'ranks' \(lower is better, 0 = best\)"),
    ({"prompt": "q", "responses": [" a", " b"]}, r"row 1 gives neither"),
    ({"instruction": "q", "responses": [" a", " b", " c"], "scores": [1, 0]}, r"row 1, column 'scores': has 2 values"),
])
def test_ambiguous_ranked_rows_are_refused_by_row(tmp_path, row, message):
    rows = [{"prompt": "p", "responses": [" x", " y"], "scores": [0, 1]}, row]
    with pytest.raises(ValueError, match=message):
        RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=rows)


def test_a_causal_lm_object_becomes_a_one_output_scorer_with_its_weights(tmp_path):
    model = load_causal_lm(TINY)
    with pytest.warns(UntrainedHeadWarning, match=r"new, randomly initialised score head \['score.weight'\]"):
        trainer = RewardTrainer(model, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=CLASSIC)
    scorer = trainer.model
    assert type(scorer).__name__ == "Qwen2ForSequenceClassification" and scorer.config.num_labels == 1
    body = dict(model.model.named_parameters())
    assert all(torch.equal(p, body[n]) for n, p in scorer.model.named_parameters())
    before = snapshot(scorer)
    trainer.train()
    assert_all_changed(before, scorer)


def test_lora_on_a_reward_model_trains_the_score_head_and_keeps_the_body_frozen(tmp_path):
    from peft import LoraConfig

    model = load_causal_lm(TINY)
    with pytest.warns(UntrainedHeadWarning):
        trainer = RewardTrainer(model, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=CLASSIC,
                                peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("score" in n for n in trainable) and any("lora_" in n for n in trainable)
    assert all("score" in n or "lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    before = snapshot(trainer.model)
    trainer.train()
    assert_all_changed(before, trainer.model)
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, after[n]) for n, p in frozen.items())


def test_a_sequence_classifier_with_two_outputs_is_refused(tmp_path):
    two = AutoModelForSequenceClassification.from_pretrained(resolve(TINY), num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardTrainer(two, args=RewardConfig(**config_kwargs(tmp_path)), train_dataset=CLASSIC)
