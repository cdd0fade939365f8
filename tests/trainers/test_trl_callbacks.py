"""TRL's callbacks, create_reference_model and SFT activation offloading, each in a tiny run where its effect
can be checked by hand."""

import io
import json
import os
import sys
import types

import pytest
import torch
from transformers import TrainerCallback

from posttrain import (BEMACallback, LogCompletionsCallback, MergeModelCallback, RichProgressCallback,
                       SFTConfig, SFTTrainer, SyncRefModelCallback, WeaveCallback, create_reference_model)
from posttrain.tasks.builtin import task_dataset
from posttrain.models.loading import load_causal_lm
from posttrain.models.offloading import OffloadActivations
from posttrain.callbacks import MergeConfig, slerp

MODEL = "posttrain/tiny-qwen2"
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


class Recorder(TrainerCallback):
    """The trainable weights (float64 copies) after every optimizer step."""

    def __init__(self):
        self.weights = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.weights[0] = {n: p.detach().double().clone() for n, p in model.named_parameters() if p.requires_grad}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {n: p.detach().double().clone() for n, p in model.named_parameters()
                                           if p.requires_grad}


def sft(tmp_path, callbacks=(), model=MODEL, max_steps=4, **kw):
    args = SFTConfig(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
                     learning_rate=1e-2, logging_steps=1, disable_tqdm=True, report_to=[], save_strategy="no",
                     seed=0, **kw)
    trainer = SFTTrainer(model, args=args, train_dataset=task_dataset("reverse", "train").select(range(32)),
                         callbacks=list(callbacks))
    trainer.train()
    return trainer


def test_bema_weights_by_hand(tmp_path):
    recorder, bema = Recorder(), BEMACallback(update_freq=1)
    sft(tmp_path, [recorder, bema])
    saved = load_causal_lm(str(tmp_path / "bema"))
    # t = 1..4: beta_t = (10 + t)^-0.5, alpha_t = (10 + t)^-0.2; EMA from theta_0; BEMA = EMA + alpha (theta - theta_0)
    theta0 = recorder.weights[0]
    ema = {n: w.clone() for n, w in theta0.items()}
    for t in range(1, 5):
        beta, alpha = (10 + t) ** -0.5, (10 + t) ** -0.2
        for n in ema:
            ema[n] = (1 - beta) * ema[n] + beta * recorder.weights[t][n]
    for name, param in saved.named_parameters():
        expected = ema[name] + (10 + 4) ** -0.2 * (recorder.weights[4][name] - theta0[name])
        assert torch.allclose(param.double(), expected, atol=1e-6), name
        assert not torch.allclose(param.double(), recorder.weights[4][name], atol=1e-4)  # not just the last weights


def test_bema_burn_in_and_frequency(tmp_path):
    recorder, bema = Recorder(), BEMACallback(update_freq=2, update_after=1, ema_power=0.0, lag=1)
    sft(tmp_path, [recorder, bema], max_steps=3)
    # theta_0 = weights at step 1; step 2: t = 1, skipped (update_freq 2); step 3: t = 2, beta = 1 (ema_power 0):
    # EMA = theta_3, BEMA = theta_3 + (1 + 2)^-0.2 (theta_3 - theta_1)
    for name, param in load_causal_lm(str(tmp_path / "bema")).named_parameters():
        w1, w3 = recorder.weights[1][name], recorder.weights[3][name]
        assert torch.allclose(param.double(), w3 + 3 ** -0.2 * (w3 - w1), atol=1e-6), name


def test_merge_model_callback_linear(tmp_path):
    recorder = Recorder()
    trainer = sft(tmp_path, [recorder, MergeModelCallback()], max_steps=2)
    merged = load_causal_lm(str(tmp_path / "checkpoint-2" / "merged"), dtype=torch.float32)
    assert os.path.exists(tmp_path / "checkpoint-2" / "merged" / "tokenizer_config.json")
    for name, param in merged.named_parameters():  # (trained + start) / 2, stored in float16
        expected = ((recorder.weights[2][name] + recorder.weights[0][name]) / 2).half().double()
        assert torch.equal(param.double(), expected), name
    assert trainer.state.global_step == 2


def test_merge_config_and_slerp_by_hand():
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    assert torch.allclose(slerp(e1, e2, 0.5), torch.tensor([2 ** -0.5, 2 ** -0.5]))  # the arc's midpoint
    assert torch.allclose(slerp(e1, 3 * e1, 0.25), torch.tensor([1.5, 0.0]))  # parallel: linear
    config = MergeConfig("slerp")
    config.t_values = 0.0
    assert torch.equal(config.merge(e1, e2), e1)
    linear = MergeConfig()
    linear.policy_model_weight, linear.target_model_weight = 3.0, 1.0
    assert torch.allclose(linear.merge(e1, e2), torch.tensor([0.75, 0.25]))
    with pytest.raises(ValueError, match="mergekit"):
        MergeConfig("ties")


def test_sync_ref_model_callback(tmp_path):
    model = load_causal_lm(MODEL)
    ref = create_reference_model(model)
    recorder = Recorder()
    sft(tmp_path, [recorder, SyncRefModelCallback(ref, ref_model_mixup_alpha=0.25, ref_model_sync_steps=2)],
        model=model, max_steps=3)
    # step 2: ref = 0.25 * policy_2 + 0.75 * ref_0; steps 1 and 3 leave it
    for name, param in ref.named_parameters():
        expected = 0.25 * recorder.weights[2][name] + 0.75 * recorder.weights[0][name]
        assert torch.allclose(param.double(), expected, atol=1e-6), name
    with pytest.raises(ValueError, match="pass them to the callback"):
        sft(tmp_path / "missing", [SyncRefModelCallback(create_reference_model(model))], model=model, max_steps=1)


def test_sync_ref_model_callback_reads_trl_fields():
    policy, ref = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    args = types.SimpleNamespace(ref_model_mixup_alpha=0.5, ref_model_sync_steps=3)
    callback = SyncRefModelCallback(ref_model=ref, accelerator=None)
    for step in (1, 2):
        callback.on_step_end(args, types.SimpleNamespace(global_step=step), None, model=policy)
    assert all(torch.equal(p, start[n]) for n, p in ref.named_parameters())
    callback.on_step_end(args, types.SimpleNamespace(global_step=3), None, model=policy)
    for name, param in ref.named_parameters():
        assert torch.allclose(param, 0.5 * dict(policy.named_parameters())[name] + 0.5 * start[name])
    target = torch.nn.Linear(2, 2)
    expected = {n: 0.1 * p.detach() + 0.9 * dict(target.named_parameters())[n].detach()
                for n, p in policy.named_parameters()}
    SyncRefModelCallback.sync_target_model(policy, target, 0.1)
    assert all(torch.allclose(p, expected[n]) for n, p in target.named_parameters())


def test_create_reference_model():
    model = load_causal_lm(MODEL)
    ref = create_reference_model(model)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in model.parameters())  # the policy still trains
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name
    shared = create_reference_model(model, num_shared_layers=1)
    params, ref_params = dict(model.named_parameters()), dict(shared.named_parameters())
    for name in params:
        same = ref_params[name] is params[name]
        before_layer_1 = not name.startswith(("model.layers.1.", "model.norm", "lm_head"))
        assert same == before_layer_1, name
        assert params[name].requires_grad == (not before_layer_1), name  # shared layers are frozen in both
    with pytest.raises(ValueError, match="pattern="):
        create_reference_model(model, num_shared_layers=1, pattern="encoder.block.{layer}")


def test_rich_progress_callback(tmp_path):
    from rich.console import Console

    out = io.StringIO()
    sft(tmp_path, [RichProgressCallback(console=Console(file=out, width=120))], max_steps=2)
    text = out.getvalue()
    assert "training" in text and "2/2" in text
    assert "step 1: loss=" in text and "step 2: loss=" in text


def online_trainer(tmp_path, callbacks_for=lambda trainer: [], **kw):
    from datasets import Dataset

    from posttrain import GRPOConfig, GRPOTrainer

    prompts = Dataset.from_dict({"prompt": ["reverse 12 =", "reverse 345 =", "reverse 6 ="]})
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_steps=2,
                      max_completion_length=4, logging_steps=1, report_to=[], disable_tqdm=True, **kw)
    trainer = GRPOTrainer(MODEL, lambda completions, **k: [float(len(c)) for c in completions], args=args,
                          train_dataset=prompts, eval_dataset=prompts)
    for callback in callbacks_for(trainer):
        trainer.add_callback(callback)
    return trainer


def test_log_completions_callback(tmp_path):
    trainer = online_trainer(tmp_path, lambda t: [LogCompletionsCallback(t, num_prompts=2, freq=1)])
    trainer.train()
    with open(tmp_path / LogCompletionsCallback.FILE) as f:
        rows = [json.loads(line) for line in f]
    assert [(r["step"], r["prompt"]) for r in rows] == [(1, "reverse 12 ="), (1, "reverse 345 ="),
                                                       (2, "reverse 12 ="), (2, "reverse 345 =")]
    assert all(isinstance(r["completion"], str) for r in rows)


def test_log_completions_callback_reads_tokenised_prompts(tmp_path):
    from posttrain import DPOConfig, DPOTrainer
    from tests.helpers.preference import task_pairs

    pairs = task_pairs("train", 8)
    trainer = DPOTrainer(MODEL, args=DPOConfig(output_dir=str(tmp_path), max_steps=1, report_to=[],
                                               per_device_train_batch_size=2, disable_tqdm=True),
                         train_dataset=pairs, eval_dataset=pairs)
    callback = LogCompletionsCallback(trainer, num_prompts=3)
    assert callback.prompts == pairs["prompt"][:3]  # decoded from the tokenised eval rows
    with pytest.raises(ValueError, match="evaluation dataset"):
        LogCompletionsCallback(types.SimpleNamespace(eval_dataset=None))


def test_weave_callback(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "weave", None)  # not installed
    with pytest.raises(ImportError, match="pip install weave"):
        WeaveCallback(types.SimpleNamespace(eval_dataset=None))

    calls = []

    class Prediction:
        def __init__(self, inputs, output):
            calls.append(("prediction", inputs["prompt"], output))

        def log_score(self, scorer, score):
            calls.append(("score", scorer, score))

        def finish(self):
            calls.append(("finish",))

    class EvaluationLogger:
        def __init__(self, model, dataset):
            calls.append(("logger", model, dataset))

        def log_prediction(self, inputs, output):
            return Prediction(inputs, output)

        def log_summary(self, summary):
            calls.append(("summary", summary))

    fake = types.SimpleNamespace(init=lambda project: calls.append(("init", project)),
                                 EvaluationLogger=EvaluationLogger)
    monkeypatch.setitem(sys.modules, "weave", fake)
    trainer = online_trainer(tmp_path)
    callback = WeaveCallback(trainer, project_name="proj", scorers={"length": lambda p, c: len(c)}, num_prompts=2,
                             model_name="tiny")
    callback.on_evaluate(trainer.args, trainer.state, None)
    assert calls[:2] == [("init", "proj"), ("logger", "tiny", "eval_dataset")]
    predictions = [c for c in calls if c[0] == "prediction"]
    scores = [c[2] for c in calls if c[0] == "score"]
    assert [p[1] for p in predictions] == ["reverse 12 =", "reverse 345 ="]
    assert scores == [len(p[2]) for p in predictions]
    assert calls[-1] == ("summary", {"step": 0, "length": sum(scores) / 2})
    callback.on_evaluate(trainer.args, trainer.state, None)
    assert [c for c in calls if c[0] == "init"] == [("init", "proj")]  # started once


def test_offload_activations_round_trip(tiny_lm):
    model, tokenizer = tiny_lm
    ids = torch.tensor([tokenizer("reverse 1234 = 4321")["input_ids"]])

    def grads(context):
        model.zero_grad()
        with context:
            model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    import contextlib

    plain = grads(contextlib.nullcontext())
    hooks = OffloadActivations(min_bytes=0, offload_cpu=True)  # CPU tensors take the round trip too
    moved = grads(hooks)
    assert hooks.offloaded > 10
    assert all(torch.equal(plain[n], moved[n]) for n in plain)
    on_cpu = OffloadActivations()
    grads(on_cpu)
    assert on_cpu.offloaded == 0  # a CPU model's activations are in CPU memory already
    model.zero_grad()


def test_sft_activation_offloading_trains_the_same(tmp_path):
    plain = sft(tmp_path / "plain", max_steps=2)
    offloaded = sft(tmp_path / "offloaded", max_steps=2, activation_offloading=True)
    losses = lambda t: [r["loss"] for r in t.state.log_history if "loss" in r]  # noqa: E731
    assert losses(plain) == losses(offloaded)
