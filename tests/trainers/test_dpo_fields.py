"""DPOConfig fields TRL users set: new loss types in mixtures, f-divergences, LD-DPO, WPO, truncation_mode,
compute_metrics, and the refused values."""

import math

import pytest
import torch
from tests.helpers.preference import TINY, assert_all_changed, assert_finite_metrics, config_kwargs, snapshot

from posttrain.core.preference_losses import PreferenceInput, dpo_loss
from posttrain.forward.completions import completion_logps
from posttrain.models.loading import load_tokenizer
from posttrain.tasks.builtin import zen
from posttrain.trainers.dpo import DPOConfig, DPOTrainer
from posttrain.trainers.preference_base import prepare_preference_dataset


def batch_of(trainer, n=4):
    return trainer.data_collator([trainer.train_dataset[i] for i in range(n)])


def nudge(model, seed=0, scale=0.05):
    """Move the policy away from the reference, so the losses are not at their tie values."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def token_rows(model, batch):
    """Per row: the completion tokens' log-probs and log Σ_v π(v)^2, from a full float64 log-softmax."""
    ids, mask, cmask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    rows = []
    for r in range(ids.shape[0]):
        cols = [t for t in range(1, ids.shape[1]) if cmask[r, t]]
        probs = torch.softmax(logits[r, [t - 1 for t in cols]], -1)
        logps = [math.log(probs[j, ids[r, t]].item()) for j, t in enumerate(cols)]
        sq = [math.log((probs[j] ** 2).sum().item()) for j in range(len(cols))]
        rows.append((logps, sq))
    return rows


@pytest.mark.parametrize("fields", [
    dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),  # MPO
    dict(loss_type=["aot", "sigmoid_norm"], loss_weights=[0.5, 2.0], label_smoothing=0.2),
    dict(loss_type=["exo_pair", "discopop"], discopop_tau=0.3, f_divergence_type="js_divergence"),
    dict(loss_type="ipo", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5),
])
def test_new_losses_and_f_divergences_through_the_trainer(tmp_path, fields):
    trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, **fields)), train_dataset=zen("preference"))
    nudge(trainer.model)
    batch = batch_of(trainer)
    loss = trainer.compute_loss(trainer.model, batch)
    rows = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    logps, lengths, _ = completion_logps(trainer.model, *rows)
    ref = completion_logps(trainer.ref_model, *rows)[0]
    inp = PreferenceInput(*logps.chunk(2), *ref.chunk(2), *lengths.chunk(2))
    options = {}
    if "discopop" in fields["loss_type"]:
        options["discopop_tau"] = fields["discopop_tau"]
    if "f_divergence_type" in fields:
        options.update(f_divergence=fields["f_divergence_type"], f_alpha=fields.get("f_alpha_divergence_coef", 1.0))
    if "bco_pair" in fields["loss_type"]:
        options["delta"] = 0.0  # the running reward mean starts at 0
    expected = dpo_loss(inp, fields["loss_type"], 0.1, fields.get("label_smoothing", 0.0), fields.get("loss_weights"),
                        **options).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert abs(dpo_loss(inp, "sigmoid", 0.1).mean().item() - loss.item()) > 1e-4  # the fields change the loss
    loss.backward()
    assert all(p.grad is not None for p in trainer.model.parameters())


def test_ld_alpha_and_wpo_weighting_against_a_float64_reference(tmp_path):
    data = zen("preference")
    beta, alpha = 0.1, 0.3
    trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, ld_alpha=alpha, use_weighting=True)),
                         train_dataset=data)
    nudge(trainer.model)
    batch = batch_of(trainer)
    loss = trainer.compute_loss(trainer.model, batch)
    policy, ref = token_rows(trainer.model, batch), token_rows(trainer.ref_model, batch)
    B = len(policy) // 2
    expected, weights = [], []
    for i in range(B):
        (lw, sq_w), (ll, sq_l) = policy[i], policy[B + i]
        public = min(len(lw), len(ll))
        # LD-DPO: tokens beyond the shorter completion count alpha times; the reference is a plain sum
        ld_w = sum(x if t < public else alpha * x for t, x in enumerate(lw))
        ld_l = sum(x if t < public else alpha * x for t, x in enumerate(ll))
        rho_w, rho_l = ld_w - sum(ref[i][0]), ld_l - sum(ref[B + i][0])
        # WPO: exp(mean(log π(y_t) - log Σπ²) over chosen + the same over rejected), capped at 1
        w = sum(a - b for a, b in zip(lw, sq_w)) / len(lw) + sum(a - b for a, b in zip(ll, sq_l)) / len(ll)
        weights.append(min(1.0, math.exp(w)))
        expected.append(weights[-1] * math.log1p(math.exp(-beta * (rho_w - rho_l))))
    assert len(policy[0][0]) != len(policy[B][0]) or len(policy[1][0]) != len(policy[B + 1][0])  # lengths differ
    assert min(weights) < 1  # the weights do something
    assert loss.item() == pytest.approx(sum(expected) / B, rel=1e-4)
    loss.backward()
    assert all(p.grad is not None for p in trainer.model.parameters())
    # ld_alpha = 1 and no weighting is plain DPO, through the per-token path (same nudge: the same policy)
    one = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, ld_alpha=1.0)), train_dataset=data)
    nudge(one.model)
    margins = [sum(policy[i][0]) - sum(ref[i][0]) - sum(policy[B + i][0]) + sum(ref[B + i][0]) for i in range(B)]
    plain = sum(math.log1p(math.exp(-beta * m)) for m in margins) / B
    assert one.compute_loss(one.model, batch).item() == pytest.approx(plain, rel=1e-4)
    assert abs(plain - loss.item()) > 1e-4


def test_truncation_mode_keeps_the_prompt_or_the_completion(tmp_path):
    tokenizer = load_tokenizer(None, model=TINY)
    rows = [{"prompt": "one two three four five six seven eight", "chosen": " nine ten", "rejected": " eleven"}]
    full = prepare_preference_dataset(rows, tokenizer, paired=True, max_length=None)[0]
    P, C, R = len(full["prompt_ids"]), len(full["chosen_ids"]), len(full["rejected_ids"])
    assert P > 3 and C > R
    limit = P + 1  # room for the prompt and one completion token
    start = prepare_preference_dataset(rows, tokenizer, paired=True, max_length=limit, truncation_mode="keep_start")[0]
    assert start["prompt_ids"] == full["prompt_ids"] and start["chosen_ids"] == full["chosen_ids"][:1]
    end = prepare_preference_dataset(rows, tokenizer, paired=True, max_length=limit, truncation_mode="keep_end")[0]
    # the prompt loses its start, just enough for the longer completion; both completions stay whole
    assert end["prompt_ids"] == full["prompt_ids"][-(limit - C):]
    assert (end["chosen_ids"], end["rejected_ids"]) == (full["chosen_ids"], full["rejected_ids"])
    # a prompt that alone fills max_length: dropped with keep_start, cut with keep_end
    with pytest.raises(ValueError, match="no train rows"):
        prepare_preference_dataset(rows, tokenizer, paired=True, max_length=P, truncation_mode="keep_start")
    tiny = prepare_preference_dataset(rows, tokenizer, paired=True, max_length=C, truncation_mode="keep_end")[0]
    assert tiny["prompt_ids"] == full["prompt_ids"][-1:] and tiny["chosen_ids"] == full["chosen_ids"][:C - 1]
    # the config field reaches the data path
    trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, max_length=limit, truncation_mode="keep_end")),
                         train_dataset=rows * 2)
    assert trainer.train_dataset[0]["chosen_ids"] == full["chosen_ids"]


def test_compute_metrics_receives_pair_rewards(tmp_path):
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction)
        return {"pair_accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    data = zen("preference")
    trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, per_device_eval_batch_size=4)),
                         train_dataset=data, eval_dataset=data.select(range(6)), compute_metrics=compute_metrics)
    nudge(trainer.model)
    result = trainer.evaluate()
    predictions, labels = seen[0].predictions, seen[0].label_ids
    assert predictions.shape == (6, 2) and labels.tolist() == [0] * 6
    trainer.model.eval()
    rows = [trainer.eval_dataset[i] for i in range(6)]
    with torch.no_grad():
        _, outputs = trainer.compute_loss(trainer.model, trainer.data_collator(rows), return_outputs=True)
    torch.testing.assert_close(torch.as_tensor(predictions[:, 0]), outputs["rewards_chosen"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.as_tensor(predictions[:, 1]), outputs["rewards_rejected"], rtol=1e-4, atol=1e-6)
    expected = float((outputs["rewards_chosen"] > outputs["rewards_rejected"]).float().mean())
    assert result["eval_pair_accuracy"] == pytest.approx(expected)
    assert "eval_loss" in result


def test_reward_compute_metrics_receives_the_pair_scores(tmp_path):
    from posttrain.trainers.reward import RewardConfig, RewardTrainer

    seen = []

    def compute_metrics(prediction):  # TRL's reward accuracy: argmax over [chosen, rejected] == label 0
        seen.append(prediction)
        return {"argmax_accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    data = zen("preference")
    trainer = RewardTrainer(TINY, args=RewardConfig(**config_kwargs(tmp_path, per_device_eval_batch_size=4)),
                            train_dataset=data, eval_dataset=data.select(range(6)), compute_metrics=compute_metrics)
    result = trainer.evaluate()
    predictions, labels = seen[0].predictions, seen[0].label_ids
    assert predictions.shape == (6, 2) and labels.tolist() == [0] * 6
    trainer.model.eval()
    batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(6)])
    with torch.no_grad():
        scores = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    torch.testing.assert_close(torch.as_tensor(predictions), torch.stack([scores[:6], scores[6:]], -1),
                               rtol=1e-4, atol=1e-5)
    assert result["eval_argmax_accuracy"] == pytest.approx(float((scores[:6] > scores[6:]).float().mean()))


@pytest.mark.parametrize("fields, message", [
    (dict(label_smoothing=-0.1), r"label_smoothing must be in \[0, 0.5\]"),
    (dict(label_smoothing=0.6), r"label_smoothing must be in \[0, 0.5\]"),
    (dict(loss_type="robust", label_smoothing=0.5), "label_smoothing < 0.5"),
    (dict(loss_type="discopop", label_smoothing=0.1), "no label-smoothed form"),
    (dict(max_completion_length=0), "max_completion_length must be a positive"),
    (dict(max_prompt_length=0), "max_prompt_length must be a positive"),
    (dict(max_prompt_length=-4), "max_prompt_length must be a positive"),
    (dict(max_length=0), "max_length must be a positive"),
    (dict(truncation_mode="keep_middle"), "truncation_mode"),
    (dict(f_divergence_type="chi_squared"), "f_divergence_type"),
    (dict(loss_type="bco_pair", f_divergence_type="forward_kl"), "has none of them"),
    (dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.0), "f_alpha_divergence_coef"),
    (dict(ld_alpha=1.5), "ld_alpha"),
    (dict(loss_type="aot_pair"), "'aot_pair' is 'aot_unpaired'"),
    (dict(loss_type=["sigmoid", "aot"], use_weighting=True), "use_weighting"),
    (dict(loss_type="discopop", discopop_tau=0.0), "discopop_tau"),
    (dict(loss_type=["sft", "simpo"], sync_ref_model=True), "no reference"),
    (dict(ref_model_mixup_alpha=1.5), "ref_model_mixup_alpha"),
])
def test_refused_values_name_the_field(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        DPOConfig(output_dir=str(tmp_path), **fields)


def test_accepted_edge_values(tmp_path):
    for loss in ("sigmoid", "exo_pair", "aot", "aot_unpaired", "sigmoid_norm", "simpo"):
        DPOConfig(output_dir=str(tmp_path), loss_type=loss, label_smoothing=0.5)
    DPOConfig(output_dir=str(tmp_path), loss_type="robust", label_smoothing=0.49)
    DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "bco_pair"], f_divergence_type="forward_kl")


def test_sft_alone_is_reference_free_and_trains(tmp_path):
    trainer = DPOTrainer(TINY, args=DPOConfig(**config_kwargs(tmp_path, loss_type="sft", max_steps=1)),
                         train_dataset=zen("preference"))
    assert trainer.reference_free and trainer.ref_model is None
    batch = batch_of(trainer)
    logps, lengths, _ = completion_logps(trainer.model, batch["input_ids"], batch["attention_mask"],
                                         batch["completion_mask"])
    B = logps.shape[0] // 2
    expected = (-logps[:B] / lengths[:B]).mean()  # the chosen completions' per-token NLL
    assert trainer.compute_loss(trainer.model, batch).item() == pytest.approx(expected.item(), rel=1e-5)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_tiny_run_with_the_new_fields_changes_every_parameter(tmp_path):
    args = DPOConfig(**config_kwargs(tmp_path, loss_type=["exo_pair", "sft"], loss_weights=[1.0, 0.1],
                                     f_divergence_type="js_divergence", ld_alpha=0.5, use_weighting=True,
                                     truncation_mode="keep_end", max_length=64))
    trainer = DPOTrainer(TINY, args=args, train_dataset=zen("preference"))
    before = snapshot(trainer.model)
    trainer.train()
    assert_all_changed(before, trainer.model)
    assert_finite_metrics(trainer, ["loss", "rewards/chosen", "rewards/margins", "logps/chosen", "logits/chosen"])
