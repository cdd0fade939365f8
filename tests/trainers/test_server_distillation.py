"""ServerDistillationTrainer and AsyncDistillationTrainer against real tiny teachers served on 127.0.0.1: the async
trainer with max_staleness=0 is the server trainer; with max_staleness=1 the teacher requests run in the background
sampler's thread, every parameter trains and resume is bit-identical (the answers in flight are checkpointed);
several teachers each score the rows that name them (MOPD); bad settings get clear errors."""

import threading

import pytest
import torch
from tests.helpers.online import online_args
from tests.helpers.resume import assert_resumes_identically, trained_state
from tests.trainers.test_distillation import changed_everything, reverse
from tests.trainers.test_distillation_family import Served, tiny_teacher  # noqa: F401 (a fixture)

from posttrain.trainers.server_distillation import (
    AsyncDistillationConfig,
    AsyncDistillationTrainer,
    ServerDistillationConfig,
    ServerDistillationTrainer,
)


def fields(tmp_path, **more):
    return {**online_args(tmp_path), "learning_rate": 1e-2, "top_p": 1.0, "beta": 0.5, "max_steps": 2, **more}


def async_trainer(urls, dataset=None, **more):
    args = AsyncDistillationConfig(**fields(more.pop("output_dir", "unused"), teacher_server_urls=urls, **more))
    trainer = AsyncDistillationTrainer("posttrain/tiny-qwen2", args=args,
                                       train_dataset=reverse(16) if dataset is None else dataset)
    for server in trainer.teacher_servers.values():
        server.backoff = 0.01
    return trainer


def test_async_without_staleness_is_server_distillation(tmp_path, tiny_teacher):  # noqa: F811
    with Served(tiny_teacher) as served:
        server = ServerDistillationTrainer("posttrain/tiny-qwen2", args=ServerDistillationConfig(
            **fields(tmp_path / "server", teacher_model_server_url=served.url)), train_dataset=reverse(16))
        server.train()
        asynchronous = async_trainer(served.url, output_dir=tmp_path / "async", max_staleness=0)
        asynchronous.train()
    want, got = trained_state(server), trained_state(asynchronous)
    assert all(torch.allclose(got[k], v, rtol=1e-6, atol=1e-7) for k, v in want.items())


def test_async_requests_overlap_training_and_train_every_parameter(tmp_path, tiny_teacher):  # noqa: F811
    with Served(tiny_teacher) as served:
        trainer = async_trainer({"default": served.url}, output_dir=tmp_path, max_staleness=1, max_steps=3)
        threads, request = [], trainer.teacher_servers["default"].sequence_logprobs
        trainer.teacher_servers["default"].sequence_logprobs = lambda *a: threads.append(
            threading.current_thread().name) or request(*a)
        last = changed_everything(trainer)
    # every batch is sampled and scored by the background sampler (batch g + 1 while batch g trains)
    assert len(threads) == 3 and all(name.startswith("posttrain-rollouts") for name in threads)
    assert last["teacher/request_time"] >= 0 and last["divergence"] > 0


def test_async_resumes_identically_with_answers_in_flight(tmp_path, tiny_teacher):  # noqa: F811
    with Served(tiny_teacher) as served:
        assert_resumes_identically(lambda **f: async_trainer(served.url, max_staleness=1, **f), tmp_path,
                                   max_steps=3, stop_at=2)


def test_each_teacher_scores_the_rows_that_name_it(tmp_path, tiny_teacher):  # noqa: F811
    from datasets import Dataset

    from posttrain.models.loading import load_causal_lm

    data = Dataset.from_list([{**row, "teacher_id": "math" if i % 3 else "code"}
                              for i, row in enumerate(reverse(16))])
    owner = {row["prompt"]: row["teacher_id"] for row in data}
    other = load_causal_lm("posttrain/tiny-qwen2").eval()
    with Served(tiny_teacher) as math, Served(other) as code:
        trainer = async_trainer({"math": math.url, "code": code.url}, data, output_dir=tmp_path, max_staleness=0)
        seen = prompts_each_teacher_sees(trainer)
        changed_everything(trainer)
    assert set(seen) == {"math", "code"}
    assert all(owner[prompt] == name for name, prompts in seen.items() for prompt in prompts)


def prompts_each_teacher_sees(trainer) -> dict:
    """teacher_id -> the decoded prompts its server is asked about, filled in as the trainer asks."""
    seen = {}
    for name, server in trainer.teacher_servers.items():
        def spy(sequences, lengths, *a, _name=name, _request=server.sequence_logprobs):
            seen.setdefault(_name, []).extend(trainer.processing_class.decode(s[:n]) for s, n in zip(sequences, lengths))
            return _request(sequences, lengths, *a)
        server.sequence_logprobs = spy
    return seen


def test_evaluate_scores_against_every_teacher(tmp_path, tiny_teacher):  # noqa: F811
    from datasets import Dataset

    from posttrain.models.loading import load_causal_lm

    named = Dataset.from_list([{**row, "teacher_id": "math" if i % 3 else "code"} for i, row in enumerate(reverse(8))])
    other = load_causal_lm("posttrain/tiny-qwen2").eval()
    with Served(tiny_teacher) as math, Served(other) as code, Served(tiny_teacher) as math_again:
        trainer = async_trainer({"math": math.url, "code": code.url, "same": math_again.url}, named,
                                output_dir=tmp_path, max_staleness=0)
        seen = prompts_each_teacher_sees(trainer)
        by_row = trainer.evaluate(named)  # each row against the teacher it names
        owner = {row["prompt"]: row["teacher_id"] for row in named}
        assert set(seen) == {"math", "code"} and all(owner[p] == name for name, ps in seen.items() for p in ps)
        assert by_row["eval_teacher_token_frac/same"] == 0.0 and by_row["eval_teacher_loss/same"] != \
            by_row["eval_teacher_loss/same"]  # NaN: no row names it
        fracs = [by_row[f"eval_teacher_token_frac/{t}"] for t in ("math", "code")]
        assert sum(fracs) == pytest.approx(1.0) and min(fracs) > 0
        assert by_row["eval_loss"] == pytest.approx(sum(f * by_row[f"eval_teacher_loss/{t}"]
                                                        for f, t in zip(fracs, ("math", "code"))), rel=1e-6)
        seen.clear()
        every = trainer.evaluate(named.remove_columns("teacher_id"))  # no teacher_id: every teacher, every row
        assert all(sorted(ps) == sorted(owner) for ps in seen.values()) and set(seen) == {"math", "code", "same"}
    assert every["eval_teacher_loss/math"] == pytest.approx(every["eval_teacher_loss/same"], rel=1e-6)
    # "code" serves the student's own initial weights: next to no divergence, unlike tiny-llama's
    assert every["eval_teacher_loss/code"] < 0.01 * every["eval_teacher_loss/math"]
    assert all(every[f"eval_teacher_token_frac/{t}"] == pytest.approx(1 / 3) for t in ("math", "code", "same"))


def test_bad_teacher_ids_and_settings_are_refused(tmp_path, tiny_teacher):  # noqa: F811
    from datasets import Dataset

    data = Dataset.from_list([{**row, "teacher_id": "physics"} for row in reverse(16)])
    with Served(tiny_teacher) as served:
        with pytest.raises(ValueError, match="teacher_id 'physics' is not one of"):
            async_trainer({"math": served.url}, data, output_dir=tmp_path / "a", max_staleness=0).train()
        with pytest.raises(ValueError, match="needs a 'teacher_id' column"):
            async_trainer({"math": served.url, "code": served.url}, output_dir=tmp_path / "b",
                          max_staleness=0).train()
    with pytest.raises(ValueError, match="use_teacher_server must stay True"):
        ServerDistillationConfig(output_dir=str(tmp_path), use_teacher_server=False)
    with pytest.raises(ValueError, match="needs teacher_model_server_url"):
        ServerDistillationConfig(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="weight_sync_steps=2"):
        AsyncDistillationConfig(output_dir=str(tmp_path), weight_sync_steps=2)
    config = AsyncDistillationConfig(output_dir=str(tmp_path), teacher_server_urls='{"a": "http://127.0.0.1:1"}')
    assert config.teacher_server_urls == {"a": "http://127.0.0.1:1"} and config.loss_top_k == config.teacher_top_k


def test_cli(tmp_path, tiny_teacher):  # noqa: F811
    from posttrain import cli

    with Served(tiny_teacher) as served:
        run = cli.run(["async_distillation", "--model_name_or_path", "posttrain/tiny-qwen2", "--dataset_name",
                       "reverse", "--teacher_server_urls", served.url, "--output_dir", str(tmp_path / "a"),
                       "--max_steps", "2", "--max_staleness", "1", "--per_device_train_batch_size", "4",
                       "--max_completion_length", "4", "--disable_tqdm", "true"])
    assert run.state.global_step == 2 and type(run).__name__ == "AsyncDistillationTrainer"
