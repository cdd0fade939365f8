"""ORPO, CPO (its loss types, SimPO, AlphaPO) and TPO: tiny runs that change every parameter, their losses
against an independent float64 computation from the model's full logits, config checks, data errors,
LoRA and streamed data."""

import math

import pytest
import torch
import torch.nn.functional as F
from tests.helpers.preference import TINY, assert_all_changed, assert_finite_metrics, config_kwargs, snapshot

from posttrain.tasks.builtin import zen
from posttrain.data.formats import FormatError
from posttrain.trainers.cpo import CPOConfig, CPOTrainer
from posttrain.trainers.orpo import ORPOConfig, ORPOTrainer
from posttrain.trainers.tpo import TPOConfig, TPOTrainer

PAIR_METRICS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected", "logits/chosen", "logits/rejected", "num_tokens", "nll_loss"]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def triples():
    data = zen("preference")
    return data.add_column("reference", data["chosen"])


def make(kind, tmp_path, data=None, **fields):
    config, trainer = {"orpo": (ORPOConfig, ORPOTrainer), "cpo": (CPOConfig, CPOTrainer),
                       "tpo": (TPOConfig, TPOTrainer)}[kind]
    return trainer(TINY, args=config(**config_kwargs(tmp_path, **fields)),
                   train_dataset=data if data is not None else (triples() if kind == "tpo" else zen("preference")))


@pytest.mark.parametrize("kind, metrics", [
    ("orpo", PAIR_METRICS + ["log_odds_ratio", "log_odds_chosen"]),
    ("cpo", PAIR_METRICS),
    ("tpo", PAIR_METRICS),
])
def test_tiny_run_changes_every_parameter_and_logs_finite_metrics(tmp_path, kind, metrics):
    trainer = make(kind, tmp_path)
    assert trainer.ref_model is None  # reference-free: no second model
    before = snapshot(trainer.model)
    trainer.train()
    assert_all_changed(before, trainer.model)
    assert_finite_metrics(trainer, metrics)


def float64_logps(model, ids, mask, cmask):
    """(summed completion log-probs, completion lengths), each (N,), from the full logits in float64."""
    logits = model(input_ids=ids, attention_mask=mask).logits.double()
    token = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    m = cmask[:, 1:].double()
    return (token * m).sum(-1), m.sum(-1)


def moved(trainer):
    with torch.no_grad():  # away from the init, where chosen and rejected score alike
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.model.train()  # its metrics go to the train buffer (dropout is off)
    return trainer


def pair_batch(trainer, n=4):
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
    logps, lengths = float64_logps(trainer.model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    return batch, logps.chunk(2), lengths.chunk(2)


def logistic(x, eps=0.0):  # the ε-smoothed logistic loss, elementwise
    return -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)


def test_orpo_loss_is_the_chosen_nll_plus_beta_times_the_odds_ratio_term(tmp_path):
    torch.manual_seed(0)
    trainer = moved(make("orpo", tmp_path, beta=0.25))
    batch, (lw, ll), (nw, nl) = pair_batch(trainer)
    pw, pl = torch.exp(lw / nw), torch.exp(ll / nl)  # per-token mean probabilities
    log_or = torch.log(pw / (1 - pw)) - torch.log(pl / (1 - pl))
    expected = -lw.sum() / nw.sum() - 0.25 * F.logsigmoid(log_or).mean()
    loss = trainer.compute_loss(trainer.model, batch)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    logged = trainer.recorded_metrics()
    assert logged["log_odds_chosen"][-1] == pytest.approx(log_or.mean().item(), rel=1e-4, abs=1e-6)
    assert logged["log_odds_ratio"][-1] == pytest.approx(F.logsigmoid(log_or).mean().item(), rel=1e-4)


@pytest.mark.parametrize("fields", [
    {"loss_type": "sigmoid"},
    {"loss_type": "sigmoid", "label_smoothing": 0.2, "cpo_alpha": 0.5},
    {"loss_type": "hinge"},
    {"loss_type": "ipo"},
    {"loss_type": "simpo", "simpo_gamma": 0.3, "cpo_alpha": 0.0},
    {"loss_type": "alphapo", "alpha": 0.4},
    {"loss_type": "sigmoid", "alpha": -0.2},
], ids=["sigmoid", "smoothed", "hinge", "ipo", "simpo", "alphapo", "sigmoid-alpha"])
def test_cpo_loss_types_against_float64(tmp_path, fields):
    torch.manual_seed(0)
    trainer = moved(make("cpo", tmp_path, beta=0.5, **fields))
    args = trainer.args
    batch, (lw, ll), (nw, nl) = pair_batch(trainer)
    if args.loss_type in ("ipo", "simpo"):
        rw, rl = lw / nw, ll / nl
    else:
        rw, rl = lw, ll
    if args.alpha:
        rw, rl = (1 - torch.exp(rw) ** -args.alpha) / args.alpha, (1 - torch.exp(rl) ** -args.alpha) / args.alpha
    z = rw - rl
    pair = {"sigmoid": lambda: logistic(0.5 * z, args.label_smoothing),
            "hinge": lambda: torch.relu(1 - 0.5 * z),
            "ipo": lambda: (z - 1 / (2 * 0.5)) ** 2,
            "simpo": lambda: logistic(0.5 * z - args.simpo_gamma, args.label_smoothing)}[args.loss_type]()
    expected = pair.mean() + args.cpo_alpha * (-lw.sum() / nw.sum())
    assert trainer.compute_loss(trainer.model, batch).item() == pytest.approx(expected.item(), rel=1e-5)


def test_alphapo_is_simpo_without_behaviour_cloning():
    args = CPOConfig(output_dir="unused", loss_type="alphapo", alpha=0.1, report_to="none")
    assert (args.loss_type, args.cpo_alpha) == ("simpo", 0.0)


@pytest.mark.parametrize("fields", [
    {"loss_type": "sigmoid"},
    {"loss_type": "hinge", "tpo_alpha": 0.0},
    {"loss_type": "ipo"},
    {"loss_type": "tpo-l", "tpo_l_gamma": 0.2, "label_smoothing": 0.1},
], ids=["sigmoid", "hinge-no-nll", "ipo", "tpo-l"])
def test_tpo_loss_types_against_float64(tmp_path, fields):
    torch.manual_seed(0)
    data = zen("preference")
    data = data.add_column("reference", [" a gold answer"] * len(data))  # unlike chosen: its own NLL
    trainer = moved(make("tpo", tmp_path, data=data, beta=0.5, **fields))
    args = trainer.args
    batch, (lw, ll), (nw, nl) = pair_batch(trainer)
    gold, gold_n = float64_logps(trainer.model, batch["reference_input_ids"], batch["reference_attention_mask"],
                                 batch["reference_completion_mask"])
    normalised = args.loss_type in ("ipo", "tpo-l")
    z = lw / nw - ll / nl if normalised else lw - ll
    pair = {"sigmoid": lambda: logistic(0.5 * z, args.label_smoothing),
            "hinge": lambda: torch.relu(1 - 0.5 * z),
            "ipo": lambda: (z - 1 / (2 * 0.5)) ** 2,
            "tpo-l": lambda: logistic(0.5 * z - args.tpo_l_gamma, args.label_smoothing)}[args.loss_type]()
    expected = pair.mean() + args.tpo_alpha * (-gold.sum() / gold_n.sum())
    assert trainer.compute_loss(trainer.model, batch).item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("config, fields, message", [
    (CPOConfig, {"loss_type": "kto"}, "loss_type must be one of"),
    (CPOConfig, {"loss_type": "hinge", "label_smoothing": 0.1}, "no label-smoothed form"),
    (CPOConfig, {"label_smoothing": 0.7}, r"label_smoothing must be in \[0, 0.5\]"),
    (CPOConfig, {"cpo_alpha": -1.0}, "cpo_alpha must be >= 0"),
    (TPOConfig, {"loss_type": "simpo"}, "loss_type must be one of"),
    (TPOConfig, {"loss_type": "ipo", "label_smoothing": 0.1}, "no label-smoothed form"),
    (TPOConfig, {"tpo_alpha": -0.5}, "tpo_alpha must be >= 0"),
    (ORPOConfig, {"beta": 0.0}, "beta must be > 0"),
    (ORPOConfig, {"max_length": 8, "max_prompt_length": 8}, "max_prompt_length"),
])
def test_invalid_configs_raise(tmp_path, config, fields, message):
    with pytest.raises(ValueError, match=message):
        config(**config_kwargs(tmp_path, **fields))


def test_trl_defaults():
    orpo, cpo, tpo = (c(output_dir="unused") for c in (ORPOConfig, CPOConfig, TPOConfig))
    assert (orpo.beta, orpo.learning_rate, orpo.truncation_mode, orpo.max_length) == (0.1, 1e-6, "keep_end", 1024)
    assert (cpo.beta, cpo.loss_type, cpo.cpo_alpha, cpo.simpo_gamma, cpo.alpha, cpo.label_smoothing,
            cpo.truncation_mode) == (0.1, "sigmoid", 1.0, 0.5, 0.0, 0.0, "keep_end")
    assert (tpo.beta, tpo.loss_type, tpo.tpo_alpha, tpo.tpo_l_gamma, tpo.learning_rate, tpo.truncation_mode) == \
        (0.01, "sigmoid", 1.0, 0.5, 5e-7, "keep_start")


def test_tpo_needs_the_reference_column(tmp_path):
    with pytest.raises(FormatError, match=r"no \['reference'\] column"):
        make("tpo", tmp_path, data=zen("preference"))


def test_reference_free_trainers_refuse_a_ref_model(tmp_path):
    with pytest.raises(TypeError, match="ref_model"):
        ORPOTrainer(TINY, ref_model=TINY, args=ORPOConfig(**config_kwargs(tmp_path)), train_dataset=zen("preference"))


def test_lora_trains_the_adapter_only(tmp_path):
    from peft import LoraConfig

    trainer = CPOTrainer(TINY, args=CPOConfig(**config_kwargs(tmp_path)), train_dataset=zen("preference"),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    before = snapshot(trainer.model)
    assert before and all("lora_" in n for n in before)
    trainer.train()
    assert_all_changed(before, trainer.model)


def test_streamed_pairs_train(tmp_path):
    from datasets import IterableDataset

    rows = list(zen("preference"))
    stream = IterableDataset.from_generator(lambda: iter(rows))
    trainer = ORPOTrainer(TINY, args=ORPOConfig(**config_kwargs(tmp_path, max_steps=3)), train_dataset=stream)
    trainer.train()
    assert trainer.state.global_step == 3
    assert all(math.isfinite(r["loss"]) for r in trainer.state.log_history if "loss" in r)


@pytest.fixture(scope="module")
def self_play(sft_reverse_path):
    """(train pairs, held-out pairs) from the partially SFT-trained model's own `reverse` samples, built as the demo
    builds them for DPO (a correct sample chosen, an incorrect one rejected), each with the gold answer as TPO's
    `reference`."""
    from posttrain.tasks.builtin import task_dataset
    from posttrain.demo import DemoPlan, _self_play_pairs
    from posttrain.models.loading import load_tokenizer

    tokenizer, plan = load_tokenizer(None, model=sft_reverse_path), DemoPlan()
    out = []
    for split, limit in (("train", 512), ("test", 200)):
        rows = task_dataset("reverse", split)
        gold = {p: " " + a for p, a in zip(rows["prompt"], rows["answer"])}
        pairs = _self_play_pairs(plan, tokenizer, rows, sft_reverse_path, limit=limit)
        out.append(pairs.add_column("reference", [gold[p] for p in pairs["prompt"]]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind, fields", [("orpo", {}), ("cpo", {}), ("cpo", {"loss_type": "simpo", "beta": 2.0}),
                                          ("tpo", {"beta": 0.1})], ids=["orpo", "cpo", "simpo", "tpo"])
def test_held_out_pairwise_accuracy_rises_on_self_play_pairs(tmp_path, self_play, sft_reverse_path, kind, fields):
    """The learning table's rows: the fraction of held-out self-play pairs whose chosen completion the policy
    gives the higher log-probability, before -> after 100 steps of batch 16."""
    import time

    from posttrain.trainers.preference_base import preference_accuracy

    train, test = self_play
    config, trainer_cls = {"orpo": (ORPOConfig, ORPOTrainer), "cpo": (CPOConfig, CPOTrainer),
                           "tpo": (TPOConfig, TPOTrainer)}[kind]
    args = config(**config_kwargs(tmp_path, per_device_train_batch_size=16, max_steps=100, learning_rate=3e-4,
                                  logging_steps=50, max_length=64, **fields))
    trainer = trainer_cls(sft_reverse_path, args=args, train_dataset=train if kind == "tpo" else
                          train.remove_columns("reference"))
    pairs = test.remove_columns("reference")
    before = preference_accuracy(trainer.model, trainer.processing_class, pairs)
    started = time.time()
    trainer.train()
    after = preference_accuracy(trainer.model, trainer.processing_class, pairs)
    print(f"\n| {kind} {fields or ''} | held-out pairwise accuracy | {before:.3f} -> {after:.3f} | 100 | "
          f"{time.time() - started:.0f} s | {len(train)} train / {len(test)} held-out pairs |")
    assert after > before + 0.1
