"""DistillationTrainer, GKDTrainer and MiniLLMTrainer on tiny models: every trainable parameter changes, the logged
metrics are finite, the loss is the divergence of the right positions (checked against a plain forward of each
model in float64), lmbda mixes on- and off-policy batches, GKD's seq_kd and `messages` data, bit-identical
resume (stopped, and killed with SIGKILL), and the config's refusals."""

import json
import math
import os
import sys

import pytest
import torch
from tests.helpers.online import online_args, prompts
from tests.helpers.resume import (assert_resumes_identically, assert_same_run, killed_at_save, logged_numbers,
                                  run_fields, trained_state)

from posttrain.tasks.builtin import task_dataset
from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer
from posttrain.trainers.gkd import GKDConfig, GKDTrainer
from posttrain.trainers.minillm import MiniLLMConfig, MiniLLMTrainer


def reverse(n: int = 16):
    return task_dataset("reverse", "train", size=n)


def changed_everything(trainer) -> dict:
    """Train; assert every trainable parameter changed and every logged number is finite; the last log line."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    unchanged = [n for n, p in trainer.model.named_parameters() if n in before and torch.equal(p, before[n])]
    assert not unchanged, f"parameters that did not change: {unchanged}"
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert logs and all(math.isfinite(v) for e in logs for v in e.values() if isinstance(v, float))
    return logs[-1]


def uneven(n: int = 16):
    """Prompts and completions of several lengths (left-padded prompts, right-padded completions)."""
    from datasets import Dataset

    return Dataset.from_list([{"prompt": "reverse " + "1234567"[:1 + i % 5] + " =",
                               "completion": " " + "98765"[:1 + i % 4]} for i in range(n)])


def distillation(dataset=None, **fields):
    """Student tiny-qwen2, teacher tiny-llama (given by name), full vocabulary, half the batches on-policy."""
    args = DistillationConfig(**{**online_args(fields.get("output_dir", "unused")), "learning_rate": 1e-2,
                                 "lmbda": 0.5, "loss_top_k": 0, "beta": 0.5, **fields})
    return DistillationTrainer("posttrain/tiny-qwen2", teacher_model="posttrain/tiny-llama", args=args,
                               train_dataset=reverse(16) if dataset is None else dataset)


def test_distillation_trains_every_parameter_on_and_off_policy(tmp_path):
    trainer = distillation(output_dir=str(tmp_path), max_steps=4)
    last = changed_everything(trainer)
    assert {"divergence", "on_policy", "completions/mean_length", "episode"} <= set(last)
    on_policy = [e["on_policy"] for e in trainer.state.log_history if "on_policy" in e]
    assert 0.0 in on_policy and 1.0 in on_policy  # lmbda = 0.5: both kinds of batch in 4 steps (seed 42)
    assert trainer.ref_model is None  # beta is the JSD's interpolation: no reference model
    metrics = trainer.evaluate(reverse(4))
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] > 0


@torch.no_grad()
def direct_divergence(student, teacher, mb, beta: float) -> torch.Tensor:
    """Mean per-token JSD(beta) of the completion tokens, each row run alone unpadded, in float64."""
    total, count = 0.0, 0
    for i in range(mb["completion_ids"].shape[0]):
        prompt = mb["prompt_ids"][i][mb["prompt_mask"][i].bool()]
        completion = mb["completion_ids"][i][mb["completion_mask"][i].bool()]
        ids = torch.cat([prompt, completion])[None]
        P, C = len(prompt), len(completion)
        s = student(ids).logits[0, P - 1:P + C - 1].double().log_softmax(-1)
        t = teacher(ids).logits[0, P - 1:P + C - 1].double()[:, :s.shape[-1]].log_softmax(-1)
        m = torch.logaddexp(t + math.log(beta), s + math.log(1 - beta))
        kl = lambda p, q: (p.exp() * (p - q)).sum(-1)  # noqa: E731
        total += float((beta * kl(t, m) + (1 - beta) * kl(s, m)).sum())
        count += C
    return total / count


@pytest.mark.parametrize("top_k", [0, 3])
def test_loss_is_the_divergence_at_the_completion_positions(tmp_path, top_k):
    trainer = distillation(uneven(), output_dir=str(tmp_path), lmbda=0.0, loss_top_k=top_k,
                           gradient_accumulation_steps=1)
    batch = next(iter(trainer.get_train_dataloader()))
    (mb,) = trainer.make_experience(batch)  # the dataset's completions, left-padded prompts of several lengths
    assert mb["prompt_mask"].sum(1).unique().numel() > 1 and mb["completion_mask"].sum(1).unique().numel() > 1
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, mb)
    if top_k == 0:
        assert float(loss) == pytest.approx(direct_divergence(trainer.model, trainer.teacher_model, mb, 0.5), rel=1e-4)
    else:  # a top-3 support with a tail bucket loses some of the difference, never adds any
        full = direct_divergence(trainer.model, trainer.teacher_model, mb, 0.5)
        assert 0 < float(loss) <= full * (1 + 1e-4)


def test_teacher_defaults_to_a_frozen_copy_of_the_student(tmp_path):
    args = DistillationConfig(**{**online_args(tmp_path), "lmbda": 1.0, "loss_top_k": 0})
    trainer = DistillationTrainer("posttrain/tiny-qwen2", args=args, train_dataset=reverse(16))
    teacher = trainer.teacher_model
    assert teacher is not trainer.model and not any(p.requires_grad for p in teacher.parameters())
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, trainer.make_experience(batch)[0])
    assert float(loss) == pytest.approx(0, abs=1e-6)


def test_gkd_seq_kd_and_messages(tmp_path):
    conversations = [{"messages": [{"role": "user", "content": r["prompt"]},
                                   {"role": "assistant", "content": r["answer"]}]} for r in reverse(16)]
    from datasets import Dataset

    args = GKDConfig(**{**online_args(tmp_path), "learning_rate": 1e-2, "seq_kd": True, "max_new_tokens": 6,
                        "max_steps": 3})
    assert args.max_completion_length == 6 and (args.lmbda, args.beta, args.temperature) == (0.5, 0.5, 0.9)
    trainer = GKDTrainer("posttrain/tiny-qwen2", "posttrain/tiny-llama", args=args,
                         train_dataset=Dataset.from_list(conversations))
    assert trainer.train_dataset.column_names[:2] == ["prompt", "completion"]
    changed_everything(trainer)


def test_minillm_trains_every_parameter(tmp_path):
    args = MiniLLMConfig(**{**online_args(tmp_path), "learning_rate": 1e-2, "num_generations": 2, "gamma": 1.0})
    trainer = MiniLLMTrainer("posttrain/tiny-qwen2", teacher_model="posttrain/tiny-llama", args=args,
                             train_dataset=prompts(8))
    last = changed_everything(trainer)
    assert last["divergence"] > 0 and last["objective/kl"] != 0  # the single-step term and the sampled log-ratio


def test_distillation_resumes_identically(tmp_path):
    # lmbda = 0.5: the on-/off-policy draws continue from the checkpoint too
    assert_resumes_identically(lambda **f: distillation(**f), tmp_path, max_steps=4, stop_at=2)


def test_distillation_resumes_after_sigkill(tmp_path):
    full = distillation(**run_fields(tmp_path / "full", 3, 2))
    full.train()
    expected_state, expected_logs = trained_state(full), logged_numbers(full, 2)
    del full
    killed_at_save(tmp_path, os.path.dirname(__file__), 'from test_distillation import distillation',
                   'distillation(**run_fields(output_dir, 3, 2))')
    resumed = distillation(**run_fields(tmp_path / "killed", 3, 2))
    resumed.train(resume_from_checkpoint=True)
    assert_same_run(resumed, expected_state, expected_logs, max_steps=3, stop_at=2)


@pytest.mark.parametrize("fields, message", [
    ({"lmbda": 1.5}, "lmbda=1.5 must be in"), ({"beta": 1.5}, "beta=1.5 must be in"),
    ({"loss_top_k": -1}, "loss_top_k=-1"), ({"reverse_kl_top_1_mode": "best"}, "reverse_kl_top_1_mode"),
    ({"use_teacher_server": True}, "use_teacher_server=True needs teacher_model_server_url"),
    ({"max_length": 100, "max_completion_length": 200}, "leaves no prompt tokens"),
])
def test_config_refuses(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        DistillationConfig(output_dir=str(tmp_path), **fields)


def test_off_policy_batch_needs_a_completion_column(tmp_path):
    args = DistillationConfig(**{**online_args(tmp_path), "lmbda": 0.0})
    trainer = DistillationTrainer("posttrain/tiny-qwen2", args=args, train_dataset=prompts(16))
    with pytest.raises(ValueError, match="reads the dataset's 'completion' column"):
        trainer.train()


@pytest.mark.parametrize("command, extra", [("distillation", ["--loss_top_k", "0", "--max_completion_length", "4"]),
                                            ("gkd", ["--max_new_tokens", "4"]),
                                            ("minillm", ["--max_completion_length", "4", "--num_generations", "2"])])
def test_cli_commands_train(tmp_path, command, extra):
    from posttrain import cli

    trainer = cli.run([command, "--model_name_or_path", "posttrain/tiny-qwen2", "--teacher_model_name_or_path",
                       "posttrain/tiny-llama", "--dataset_name", "reverse", "--output_dir", str(tmp_path / command),
                       "--max_steps", "1", "--per_device_train_batch_size", "4", "--disable_tqdm", "true", *extra])
    assert trainer.state.global_step == 1 and type(trainer).__name__.lower().startswith(command)
    assert trainer.teacher_model if command != "minillm" else trainer.ref_model  # the teacher was loaded


def test_demo_distill_stage_runs_every_trainer_and_the_sft_baseline(tmp_path):
    from posttrain import demo

    plan = demo.plan_for(None)
    plan.output_dir, plan.stages = str(tmp_path), ("distill",)
    plan.steps = dict.fromkeys(demo.STEPS, 2)
    plan.eval_size, plan.rl_batch_size, plan.distill_batch_size = 8, 8, 8
    rows = demo.run(plan)
    # the stage starts from the SFT checkpoint (run first); no online stage was asked for: GRPO trains the teacher
    assert [r["stage"] for r in rows] == ["base", "sft", "grpo", *demo.DISTILLERS]
    assert plan.distill_tokens and plan.distill_tokens > 0  # the SFT baseline's budget, from the distillation run
    assert all(0.0 <= r["after"] <= 1.0 for r in rows)
    assert "| sft on teacher samples |" in (tmp_path / "report.md").read_text()


def test_lora_student_with_the_adapter_disabled_student_as_teacher(tmp_path):
    from peft import LoraConfig

    # The adapter starts away from zero (peft's init_lora_weights=False draws B too), so the student differs from
    # its teacher, the same model without the adapter; a zero adapter would give a zero gradient (KL at p = q)
    # and a test that passes on rounding noise alone.
    args = DistillationConfig(**{**online_args(tmp_path), "learning_rate": 1e-2, "lmbda": 1.0, "loss_top_k": 0,
                                 "max_steps": 6})
    trainer = DistillationTrainer("posttrain/tiny-qwen2", args=args, train_dataset=reverse(16),
                                  peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))
    assert trainer.teacher_model is None  # no second copy: the teacher is the student without its adapter
    changed_everything(trainer)  # every LoRA weight trained
    divergences = [e["divergence"] for e in trainer.state.log_history if "divergence" in e]
    assert divergences[0] > 1e-3  # the adapter makes another model than the one it is distilled from
    assert (divergences[-1] + divergences[-2]) / 2 < 0.85 * divergences[0]  # and training pulls it back


def test_streamed_dataset(tmp_path):
    stream = reverse(16).to_iterable_dataset()
    trainer = distillation(stream, output_dir=str(tmp_path), max_steps=3)
    changed_everything(trainer)


def test_two_processes_match_one(tmp_path):
    # DDP on 2 CPU processes (gloo): 1 process x 8 completions vs 2 x 4, completions of several lengths; the
    # token-mean denominator spans both processes, so the update is the same
    from tests.helpers.launch import free_port, run_launch

    script = os.path.join(os.path.dirname(__file__), "distributed_distillation.py")
    one, two = str(tmp_path / "one.json"), str(tmp_path / "two.json")
    run_launch([sys.executable, script, one, "8"], tmp_path, path=os.path.dirname(__file__))
    run_launch([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                str(free_port()), script, two, "4"], tmp_path, path=os.path.dirname(__file__))
    a, b = (json.load(open(p)) for p in (one, two))
    assert (a["processes"], b["processes"]) == (1, 2)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
    for name, value in a["weights"].items():
        assert b["weights"][name] == pytest.approx(value, rel=1e-5, abs=1e-5), name
