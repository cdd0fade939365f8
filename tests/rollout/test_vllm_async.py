"""Asynchronous rollouts (max_staleness > 0, trainers/online_async.py) with vLLM, against the fakes of
test_vllm_engine.py: the background worker generates through the engine, the weights it samples with are
published with the engine's sync (colocated: `load_weights`; server: the weight-transfer endpoints) from the
worker's copy, one sync per optimizer step's snapshot, and vLLM's log-probs are the behaviour log-probs that
the importance weights take."""

import sys
import threading
import types

import pytest
import torch
from tests.helpers.online import first_token_reward, online_args, prompts, train_and_check
from tests.rollout.test_vllm_engine import FakeGroup, FakeLLM, FakeVllmServer, fake_vllm  # noqa: F401
from transformers import TrainerCallback

from posttrain.rollout import vllm_engine
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

TINY = "posttrain/tiny-qwen2"


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Snapshots(TrainerCallback):
    """The policy's weights at the start of each optimizer step."""

    def __init__(self, trainer):
        self.trainer, self.at = trainer, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.at[state.global_step] = _weights(self.trainer.policy)


def _by_step(trainer, key: str) -> list[float]:
    return [e[key] for e in trainer.state.log_history if key in e]


def test_colocated_vllm_samples_ahead_with_the_published_weights(tmp_path, fake_vllm):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_steps=3, learning_rate=1e-2, max_staleness=1,
                                    beta=0.05),
                      use_vllm=True, vllm_importance_sampling_mode="token_truncate")
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(16))
    assert trainer.rollouts is not None and trainer.vllm is not None
    llm = FakeLLM.instances[0]
    sampled_with, threads = [], []
    generate = llm.generate

    def recording(prompts_, params, use_tqdm=True):  # the weights vLLM holds at each generation, and the thread
        sampled_with.append(_weights(llm.model.hf))
        threads.append(threading.current_thread().name)
        return generate(prompts_, params, use_tqdm)

    llm.generate = recording
    snapshots = _Snapshots(trainer)
    trainer.add_callback(snapshots)
    train_and_check(trainer)
    assert _by_step(trainer, "rollout/staleness") == [0.0, 1.0, 1.0]
    # batch g was sampled by the weights of step max(g - 1, 0), in the worker thread, through the engine
    assert len(sampled_with) == 3 and all(name.startswith("posttrain-rollouts") for name in threads)
    for g, weights in enumerate(sampled_with):
        expected = snapshots.at[max(g - 1, 0)]
        assert all(torch.equal(t, expected[n]) for n, t in weights.items()), g
    assert not all(torch.equal(t, snapshots.at[2][n]) for n, t in sampled_with[2].items())  # not the trained ones
    # one sync per published snapshot (batches 0 and 1 share step 0's), each followed by a prefix-cache reset
    assert llm.prefix_resets == 2 and llm.model.loaded == list(trainer.policy.state_dict()) * 2
    # vLLM's log-probs are the behaviour log-probs: old_logp (the policy's when the batch starts training) equals
    # them for the batch sampled by the same weights, and differs for the ones sampled a step before
    gap = _by_step(trainer, "sampling/sampling_logp_difference/mean")
    assert gap[0] < 1e-4 and min(gap[1:]) > 1e-3, gap
    ratio = _by_step(trainer, "sampling/importance_sampling_ratio/mean")
    assert ratio[0] == pytest.approx(1.0, abs=1e-3) and all(abs(r - 1.0) > 1e-4 for r in ratio[1:]), ratio


def test_evaluation_syncs_the_current_policy_between_background_syncs(tmp_path, fake_vllm):
    """The main thread's generations (evaluation) sync the policy being trained, and the worker's next job
    publishes its own weights again after them."""
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_steps=2, learning_rate=1e-2, max_staleness=1,
                                    eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4),
                      use_vllm=True)
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(16), eval_dataset=prompts(4))
    llm = FakeLLM.instances[0]
    FakeLLM.policy = trainer.policy
    checked = []
    generate = llm.generate

    def recording(prompts_, params, use_tqdm=True):
        out = generate(prompts_, params, use_tqdm)
        checked.append((threading.current_thread().name.startswith("posttrain-rollouts"), llm.in_sync[-1]))
        return out

    llm.generate = recording
    trainer.train()
    evaluations = [in_sync for background, in_sync in checked if not background]
    assert evaluations and all(evaluations)  # every evaluation generated with the current weights
    assert any(background for background, _ in checked)


def test_server_mode_publishes_each_snapshot_once(tmp_path, monkeypatch):
    server = FakeVllmServer()
    try:
        monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
        monkeypatch.setattr(vllm_engine, "cuda_available", lambda: True)
        monkeypatch.setattr(vllm_engine, "nccl_communicator", lambda host, port, rank, world, device: FakeGroup(
            server, host, port, rank, world))
        args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_steps=3, max_staleness=1, beta=0.05),
                          use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url)
        trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(16))
        train_and_check(trainer)
        assert server.paths().count("/start_weight_update") == 2  # step 0's weights (batches 0, 1), step 1's
        assert server.paths().count("/v1/completions") == 3
        assert _by_step(trainer, "rollout/staleness") == [0.0, 1.0, 1.0]
    finally:
        server.close()


def test_a_rollout_func_without_vllm_is_refused(tmp_path):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_staleness=1))
    with pytest.raises(ValueError, match="without use_vllm a rollout_func samples with the trainer's policy"):
        GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(8),
                    rollout_func=lambda prompts, trainer: None)
