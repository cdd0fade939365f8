"""Reward models that would score wrongly are refused or warned about: an object with other than one
output, a causal LM given as a reward model, a checkpoint whose score head is newly initialised."""

import warnings

import pytest
from transformers import AutoModelForSequenceClassification

from posttrain.models import loading
from posttrain.models.loading import UntrainedHeadWarning
from posttrain.rollout.rewards import RewardScorer


def two_label_classifier():
    return AutoModelForSequenceClassification.from_pretrained(loading.resolve("posttrain/tiny-qwen2-seqcls"),
                                                              num_labels=2, ignore_mismatched_sizes=True)


def test_reward_model_object_with_two_labels_is_refused():
    model = two_label_classifier()
    with pytest.raises(ValueError, match="has num_labels=2, but a reward model gives 1 score.* only logit 0"):
        loading.load_sequence_classifier(model)
    with pytest.raises(ValueError, match="has num_labels=2"):
        RewardScorer([model])


def test_causal_lm_object_as_reward_model_is_refused():
    model = loading.load_causal_lm("posttrain/tiny-qwen2")
    with pytest.raises(ValueError, match="is a causal language model .* pass its path instead"):
        RewardScorer([model])


def test_reward_trainer_refuses_a_two_label_model(tmp_path):
    from posttrain.tasks.builtin import zen
    from posttrain.trainers.reward import RewardConfig, RewardTrainer

    args = RewardConfig(output_dir=str(tmp_path), max_steps=1, report_to="none")
    with pytest.raises(ValueError, match="has num_labels=2"):
        RewardTrainer(two_label_classifier(), args=args, train_dataset=zen("preference"),
                      processing_class=loading.load_tokenizer("posttrain/tiny-qwen2"))


def test_causal_lm_folder_as_reward_function_warns_that_the_head_is_untrained():
    folder = loading.resolve("posttrain/tiny-qwen2")  # the causal-LM checkpoint's folder
    with pytest.warns(UntrainedHeadWarning, match=r"has no trained score head: \['score.weight'\] were newly"):
        scorer = RewardScorer([folder])
    assert scorer.funcs[0].config.num_labels == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntrainedHeadWarning)
        RewardScorer(["posttrain/tiny-qwen2-seqcls"])  # a classifier with its head loads quietly
        loading.load_sequence_classifier(folder)  # a model about to be trained: no warning by default
