"""vLLM wherever the sampler goes: tools, environments and rollout functions with `use_vllm=True`.

vLLM keeps no KV cache between calls, so a multi-turn rollout over it (`multiturn.engine_turns`) sends each
row's next turn as a new request (prompt + completion so far + the fed tool turn) and relies on vLLM's
prefix cache. Checked here against the fakes of test_vllm_engine.py (a fake `vllm` module and a fake vLLM
server, both sampling with posttrain's own sampler): greedy rollouts equal the built-in sampler's multi-turn
rollout token for token, log-prob for log-prob; the trainers run tools, environments and rollout functions
through vLLM with the weights synced before each generation.
"""

import sys
import types

import pytest
import torch
from tests.helpers.online import online_args, train_and_check
from tests.rollout.test_multiturn import FED, Script
from tests.rollout.test_vllm_engine import FakeGroup, FakeLLM, FakeVllmServer, colocate_args, fake_vllm  # noqa: F401
from tests.rollout.test_vllm_engine import vllm_client
from tests.trainers.test_agentic import GO, FIND, _dataset, _model, fit_caller, ping

from posttrain.data.tokenize import encode_prompt
from posttrain.models.loading import load_tokenizer
from posttrain.rollout import vllm_engine
from posttrain.rollout.generate import SamplingConfig, generate
from posttrain.rollout.multiturn import engine_turns
from posttrain.rollout.vllm_engine import ColocateEngine, policy_weights
from posttrain.tasks.environments import GuessNumberEnv
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

TOOL_METRICS = ["tools/calls_per_completion", "tools/failure_rate", "tools/turns_per_episode"]


@pytest.fixture
def vllm_server():
    s = FakeVllmServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def caller():
    return fit_caller()


def _prompts_and_sampling(tok, max_new_tokens=40):
    prompts = [tok("add 12 7 =")["input_ids"], tok("a")["input_ids"], tok("reverse 3 1 2")["input_ids"]]
    # a quarter of the vocabulary ends a turn, so turns end within a few tokens and rows go on after FED
    stops = tuple(range(10, 200, 4))
    return prompts, SamplingConfig(max_new_tokens=max_new_tokens, num_generations=2, stop_token_ids=stops,
                                   do_sample=False)


def _same_rollout(mine, reference):
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "is_truncated"):
        assert torch.equal(getattr(mine, field), getattr(reference, field)), field
    torch.testing.assert_close(mine.logprobs, reference.logprobs, atol=1e-4, rtol=0)


def _reference(model, tok, max_new_tokens):
    prompts, sampling = _prompts_and_sampling(tok, max_new_tokens)
    script = Script()
    return generate(model, prompts, sampling, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                    continue_turn=script), script


# past: the completion budget, as tokens past the shortest first turn (None: 40, no row cut by it); 2: cut inside
# the fed ids; 5: the fed ids fill the budget exactly; 7: two tokens sampled after them
@pytest.mark.parametrize("past", [None, 2, 5, 7])
def test_colocate_turns_equal_the_samplers_multi_turn_rollout(model, tok, fake_vllm, tmp_path, past):
    engine = ColocateEngine("posttrain/tiny-qwen2", colocate_args(tmp_path), 1, 0, tok.pad_token_id, tok.eos_token_id)
    engine.load_weights(policy_weights(model))  # vLLM's copy of the policy
    max_new_tokens = 40
    if past is not None:
        max_new_tokens = min(n for _, n in _reference(model, tok, 40)[1].calls) + past
    prompts, sampling = _prompts_and_sampling(tok, max_new_tokens)
    reference, reference_script = _reference(model, tok, max_new_tokens)
    script = Script()
    mine = engine_turns(engine.generate, prompts, sampling, script, tok.pad_token_id, tok.eos_token_id)
    _same_rollout(mine, reference)
    assert sorted(script.calls) == sorted(reference_script.calls)  # the same turns ended, at the same lengths
    assert mine.tool_mask.sum() > 0
    # one request per turn: the first samples n=2 per prompt, each later one re-sends the row with its fed ids
    calls = FakeLLM.instances[0].calls
    assert calls[0][1]["n"] == 2 and [p["prompt_token_ids"] for p in calls[0][0]] == prompts
    for sent, fields in calls[1:]:
        assert fields["n"] == 1
        for request in sent:
            ids = request["prompt_token_ids"]
            prompt = next(p for p in prompts if ids[:len(p)] == p)
            assert ids[-len(FED):] == FED and fields["max_tokens"] == max_new_tokens - (len(ids) - len(prompt))
    if past is not None:
        assert mine.is_truncated.any()


def test_server_turns_equal_the_samplers_multi_turn_rollout(model, tok, vllm_server):
    engine = vllm_client(vllm_server)
    engine.load_weights(policy_weights(model))
    prompts, sampling = _prompts_and_sampling(tok)
    reference = generate(model, prompts, sampling, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         continue_turn=Script())
    mine = engine_turns(engine.generate, prompts, sampling, Script(), tok.pad_token_id, tok.eos_token_id)
    _same_rollout(mine, reference)
    assert vllm_server.paths().count("/v1/completions") > 1


def test_sampled_turns_keep_the_fed_ids_masked(model, tok, fake_vllm, tmp_path):
    """Sampling (not greedy): each row that went on has FED right after its first turn, masked, log-prob 0."""
    engine = ColocateEngine("posttrain/tiny-qwen2", colocate_args(tmp_path), 1, 0, tok.pad_token_id, tok.eos_token_id)
    engine.load_weights(policy_weights(model))
    prompts, sampling = _prompts_and_sampling(tok)
    sampling.do_sample = True
    script = Script()
    r = engine_turns(engine.generate, prompts, sampling, script, tok.pad_token_id, tok.eos_token_id)
    firsts = {}
    for row, length in script.calls:
        firsts.setdefault(row, length)
    assert len(firsts) >= 4  # rows whose first turn ended within the budget (the others were cut: no FED)
    for i in range(6):
        first = firsts.get(i, 40)
        fed = slice(first, min(first + len(FED), 40))  # FED, cut where the budget ends
        assert r.completion_ids[i, fed].tolist() == FED[:fed.stop - fed.start]
        assert r.tool_mask[i, fed].tolist() == [1] * (fed.stop - fed.start) == r.tool_mask[i].tolist()[fed]
        assert (r.logprobs[i, fed] == 0).all() and r.tool_mask[i].sum() == fed.stop - fed.start
        sampled = r.completion_mask[i].bool() & ~r.tool_mask[i].bool()
        assert (r.logprobs[i][sampled] < 0).all()


def test_tools_with_vllm_train_and_sync_before_each_generation(caller, tmp_path, fake_vllm):
    seen = []

    def answered(completions, **kwargs):
        seen.extend(completions)
        return [float(bool(c) and c[-1]["role"] == "assistant" and c[-1]["content"].strip() == "2")
                + 1e-3 * len(str(c)) for c in completions]

    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_completion_length=96,
                                    max_tool_calling_iterations=2), use_vllm=True)
    trainer = GRPOTrainer(_model(caller), answered, args=args, train_dataset=_dataset(GO), tools=[ping])
    FakeLLM.policy = trainer.policy
    llm = FakeLLM.instances[0]
    logged = train_and_check(trainer, metrics=TOOL_METRICS, reward_names=("answered",))
    assert max(logged["tools/calls_per_completion"]) > 0
    assert llm.in_sync and all(llm.in_sync)  # every turn sampled with the policy being trained
    assert llm.prefix_resets == 2  # one sync per optimizer step, not per turn
    turns = [fields["n"] for _, fields in llm.calls]
    assert turns.count(4) == 2 and turns.count(1) >= 1  # a first turn per step, then the rows' next turns
    episode = next(c for c in seen if len(c) >= 3 and c[0].get("tool_calls"))
    assert episode[0]["tool_calls"][0]["function"]["name"] == "ping" and episode[1]["role"] == "tool"


def test_tools_with_vllm_sampled_ahead_in_the_background(caller, tmp_path, fake_vllm):
    """max_staleness=1: the episodes (every turn, and the tool calls between them) run in the asynchronous
    sampler's thread, through the engine, which holds the weights of the step before the one that trains."""
    import threading

    def answered(completions, **kwargs):
        return [float(bool(c) and c[-1]["content"].strip() == "2") + 1e-3 * len(str(c)) for c in completions]

    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_completion_length=96, max_steps=3,
                                    max_tool_calling_iterations=2, max_staleness=1), use_vllm=True)
    trainer = GRPOTrainer(_model(caller), answered, args=args, train_dataset=_dataset(GO), tools=[ping])
    llm, threads = FakeLLM.instances[0], []
    generate = llm.generate
    llm.generate = lambda *a, **kw: threads.append(threading.current_thread().name) or generate(*a, **kw)
    logged = train_and_check(trainer, metrics=TOOL_METRICS + ["rollout/staleness"], reward_names=("answered",))
    assert logged["rollout/staleness"] == [0.0, 1.0, 1.0]
    assert max(logged["tools/calls_per_completion"]) > 0
    assert len(threads) > 3 and all(name.startswith("posttrain-rollouts") for name in threads)  # turns after the first
    assert llm.prefix_resets == 2  # step 0's snapshot (batches 0 and 1) and step 1's, not one per turn
    assert [fields["n"] for _, fields in llm.calls].count(4) == 3


def test_rollout_func_with_vllm_runs_in_the_background_sampler(tmp_path, fake_vllm):
    import threading

    tok = load_tokenizer("posttrain/tiny-qwen2")
    threads = []

    def rollout_func(prompts, trainer):
        threads.append(threading.current_thread().name)
        ids = [encode_prompt(tok, p) for p in prompts[::4]]
        r = trainer.sample_completions(ids)
        lengths = r.completion_mask.sum(1).tolist()
        return {"prompt_ids": [ids[i // 4] for i in range(len(prompts))],
                "completion_ids": [row[:n] for row, n in zip(r.completion_ids.tolist(), lengths)],
                "logprobs": [row[:n] for row, n in zip(r.logprobs.tolist(), lengths)]}

    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_steps=3, max_staleness=1), use_vllm=True,
                      vllm_importance_sampling_mode="token_truncate")
    trainer = GRPOTrainer("posttrain/tiny-qwen2", lambda completion_ids, **kw: [float(c[0] % 5) for c in completion_ids],
                          args=args, train_dataset=_dataset(GO), rollout_func=rollout_func)
    train_and_check(trainer, metrics=["reward", "rollout/staleness"], reward_names=("<lambda>",))
    assert len(threads) == 3 and all(name.startswith("posttrain-rollouts") for name in threads)
    assert FakeLLM.instances[0].prefix_resets == 2


@pytest.mark.slow  # a minute on a busy 2-core machine; the tools test above runs the same loop colocated
def test_environment_with_vllm_server(caller, tmp_path, vllm_server, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(vllm_engine, "cuda_available", lambda: True)
    monkeypatch.setattr(vllm_engine, "nccl_communicator", lambda host, port, rank, world, device: FakeGroup(
        vllm_server, host, port, rank, world))
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_completion_length=96), use_vllm=True,
                      vllm_mode="server", vllm_server_base_url=vllm_server.url)
    trainer = GRPOTrainer(_model(caller), args=args, train_dataset=_dataset(FIND, secret=1, low=1, high=1),
                          environment_factory=GuessNumberEnv)
    vllm_server.policy = trainer.policy
    logged = train_and_check(trainer, metrics=TOOL_METRICS, reward_names=("GuessNumberEnv",))
    assert max(logged["tools/calls_per_completion"]) > 0
    assert max(logged["rewards/GuessNumberEnv/mean"]) > 0  # some episodes found the number through the tool
    assert vllm_server.in_sync and all(vllm_server.in_sync)
    assert vllm_server.paths().count("/start_weight_update") == 2
    assert vllm_server.paths().count("/v1/completions") > 2  # later turns are requests of their own


def test_rollout_func_with_vllm_generates_through_the_synced_engine(tmp_path, fake_vllm):
    """A rollout_func calls `trainer.sample_completions` (TRL's rollout functions call its vLLM generation):
    the weights are synced first, and its log-probs are vLLM's, corrected by the importance weights."""
    tok = load_tokenizer("posttrain/tiny-qwen2")
    FakeLLM.logprob_shift = -0.2
    calls = []

    def rollout_func(prompts, trainer):
        ids = [encode_prompt(tok, p) for p in prompts[::4]]
        r = trainer.sample_completions(ids)
        calls.append(r)
        lengths = r.completion_mask.sum(1).tolist()
        return {"prompt_ids": [ids[i // 4] for i in range(len(prompts))],
                "completion_ids": [row[:n] for row, n in zip(r.completion_ids.tolist(), lengths)],
                "logprobs": [row[:n] for row, n in zip(r.logprobs.tolist(), lengths)]}

    # per-token weights e^0.2: TRL's default sequence_mask would mask every sequence of 6 tokens (e^1.2 > 3)
    args = GRPOConfig(**online_args(tmp_path, num_generations=4), use_vllm=True,
                      vllm_importance_sampling_mode="token_truncate")
    trainer = GRPOTrainer("posttrain/tiny-qwen2", lambda completion_ids, **kw: [float(c[0] % 5) for c in completion_ids],
                          args=args, train_dataset=_dataset(GO), rollout_func=rollout_func)
    FakeLLM.policy = trainer.policy
    train_and_check(trainer, metrics=["reward"], reward_names=("<lambda>",))
    llm = FakeLLM.instances[0]
    assert len(calls) == 2 and llm.in_sync == [True, True] and llm.prefix_resets == 2
    # the rollout's log-probs are vLLM's: kept apart for the importance weights
    batch = trainer.build_experience(calls[-1], torch.arange(8.0))[0]
    assert "vllm_logp" in batch


def test_tools_refuse_a_shared_colocated_engine(tmp_path, fake_vllm):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4), use_vllm=True, vllm_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="would make different numbers of them: use vllm_tensor_parallel_size=1"):
        GRPOTrainer("posttrain/tiny-qwen2", lambda completions, **kw: [0.0] * len(completions), args=args,
                    train_dataset=_dataset(GO), tools=[ping])
