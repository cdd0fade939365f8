"""vLLM generation for the online trainers (rollout/vllm_engine.py): the plumbing, checked on CPU.

No vLLM runs here. A fake `vllm` module stands in for it (`FakeLLM`: samples with posttrain's own
sampler and tiny model, and its `load_weights` really copies tensors into that model), and the server
mode talks to real HTTP servers in threads: one with the endpoints of vLLM's OpenAI-compatible server
that TRL 1.x's `trl vllm-serve` runs (`FakeVllmServer`), one with those of TRL 0.2x's own server
(`LegacyFakeServer`), each with a fake communicator in place of the NCCL broadcast (which needs a GPU
and vLLM). These tests check that
our side sends the right fields, reads the answers in the right order, syncs every weight at the
right time and weights the loss correctly; they say nothing about vLLM itself.
"""

import http.server
import json
import math
import os
import queue
import random
import sys
import threading
import types
import urllib.parse

import pytest
import torch
from tests.helpers.online import first_token_reward, online_args, prompts, train_and_check

from posttrain.core.policy_losses import truncated_importance_weights
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.rollout import vllm_engine
from posttrain.rollout.generate import SamplingConfig, generate
from posttrain.rollout.vllm_engine import (ColocateEngine, LegacyServerEngine, ServerEngine, make_engine,
                                           policy_weights, sampling_fields, speaks_openai)
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

TINY = "posttrain/tiny-qwen2"


# ---------------------------------------------------------------- the fake vllm module

class SamplingParams:
    def __init__(self, **fields):
        self.fields = fields


class FakeModel:
    """What `apply_model` hands over: a model with vLLM's `load_weights(iterable of (name, tensor))`."""

    def __init__(self, hf):
        self.hf, self.loaded = hf, []

    def load_weights(self, weights):
        state = self.hf.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                state[name].copy_(tensor)
                self.loaded.append(name)


class FakeLLM:
    """vllm.LLM's surface as the engine uses it; generation is posttrain's sampler on its own model copy.
    `logprob_shift` is added to every returned log-prob (a sampler whose numbers differ from the policy's)."""

    instances: list = []
    logprob_shift = 0.0
    policy = None  # set by a test: the trainer's policy, compared with this model at each generation

    def __init__(self, model, **kwargs):
        self.model_path, self.kwargs = model, kwargs
        self.model = FakeModel(load_causal_lm(TINY).eval())
        with torch.no_grad():  # start from other weights than the policy's, so a missing sync shows
            for p in self.model.hf.parameters():
                p.add_(0.5)
        self.tok = load_tokenizer(TINY)
        self.calls, self.prefix_resets, self.in_sync, self.sleeping = [], 0, [], False
        self.generator = torch.Generator().manual_seed(kwargs.get("seed", 0))
        FakeLLM.instances.append(self)

    def generate(self, prompts, params, use_tqdm=True):
        assert not self.sleeping
        self.calls.append((prompts, params.fields))
        if FakeLLM.policy is not None:
            policy = dict(FakeLLM.policy.state_dict())
            self.in_sync.append(all(torch.equal(t, policy[n]) for n, t in self.model.hf.state_dict().items()))
        f = params.fields
        sampling = SamplingConfig(max_new_tokens=f["max_tokens"], temperature=f["temperature"] or 1.0,
                                  do_sample=f["temperature"] > 0, top_p=f["top_p"], top_k=max(f["top_k"], 0),
                                  min_p=f["min_p"], repetition_penalty=f["repetition_penalty"], num_generations=f["n"],
                                  stop_token_ids=tuple(f["stop_token_ids"]), stop_strings=tuple(f["stop"]))
        ids = [p["prompt_token_ids"] for p in prompts]
        out = generate(self.model.hf, ids, sampling, pad_token_id=self.tok.pad_token_id,
                       eos_token_id=self.tok.eos_token_id, tokenizer=self.tok, generator=self.generator)
        n, results = f["n"], []
        for j, prompt in enumerate(ids):
            completions = []
            for k in range(n):
                row = j * n + k
                length = int(out.completion_mask[row].sum())
                tokens = out.completion_ids[row, :length].tolist()
                logprobs = [{t: types.SimpleNamespace(logprob=float(lp) + FakeLLM.logprob_shift)}
                            for t, lp in zip(tokens, out.logprobs[row, :length].tolist())]
                completions.append(types.SimpleNamespace(token_ids=tokens, logprobs=logprobs, finish_reason=(
                    "length" if out.is_truncated[row] else "stop")))
            results.append(types.SimpleNamespace(prompt_token_ids=list(prompt), outputs=completions))
        self.last = results
        return results

    def apply_model(self, fn):
        return [fn(self.model)]

    def reset_prefix_cache(self):
        self.prefix_resets += 1

    def sleep(self, level=1):
        self.sleeping = True

    def wake_up(self):
        self.sleeping = False


@pytest.fixture
def fake_vllm(monkeypatch):
    """The fake module, a GPU as far as the config check knows, and the environment restored afterwards
    (a one-process colocate engine sets RANK, WORLD_SIZE, ... for vLLM's external launcher)."""
    environment = dict(os.environ)
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeLLM, SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(vllm_engine, "cuda_available", lambda: True)
    FakeLLM.instances, FakeLLM.logprob_shift, FakeLLM.policy = [], 0.0, None
    yield module
    FakeLLM.policy = None
    os.environ.clear()
    os.environ.update(environment)


# ---------------------------------------------------------------- config-time errors

def test_use_vllm_refusals_say_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"vLLM is not installed: `pip install vllm` \(it needs a CUDA GPU\)"):
        GRPOConfig(output_dir=str(tmp_path), use_vllm=True)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(vllm_engine, "cuda_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server")
    with pytest.raises(ValueError, match=r"vllm_mode='remote' is unknown; choose one of \['colocate', 'server'\]"):
        GRPOConfig(output_dir=str(tmp_path), vllm_mode="remote")
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_mode='seq' is unknown; choose one of "
                       r"\['sequence_mask', 'sequence_truncate', 'token_mask', 'token_truncate'\]"):
        GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_mode="seq")
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_clip_min must be >= 0 and below "
                       r"vllm_importance_sampling_clip_max=3.0"):
        GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_clip_min=3.0)
    assert GRPOConfig(output_dir=str(tmp_path)).vllm_importance_sampling_mode == "sequence_mask"  # TRL's default
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_max must be > 0"):
        GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_clip_max=0.0)
    # TRL's older name of the cap is copied into the current one; without use_vllm nothing is checked
    assert GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_cap=2.0).vllm_importance_sampling_clip_max == 2.0
    assert GRPOConfig(output_dir=str(tmp_path)).vllm_importance_sampling_clip_max == 3.0


def test_generation_kwargs_beyond_the_sampler_go_to_vllm(tmp_path, fake_vllm):
    with pytest.raises(ValueError, match=r"generation_kwargs \['seed'\]"):
        GRPOConfig(output_dir=str(tmp_path), generation_kwargs={"seed": 1})
    args = GRPOConfig(**online_args(tmp_path, num_generations=4), use_vllm=True,
                      generation_kwargs={"seed": 1, "top_k": 3})
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(8))
    assert trainer.sampling.top_k == 3 and trainer.vllm.extra == {"seed": 1}
    trainer.sample_completions([[5, 6, 7]])
    assert FakeLLM.instances[0].calls[0][1]["seed"] == 1 and FakeLLM.instances[0].calls[0][1]["top_k"] == 3


# ---------------------------------------------------------------- colocate

def colocate_args(tmp_path, **overrides):
    return GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_gpu_memory_utilization=0.4,
                      vllm_tensor_parallel_size=1, vllm_model_impl="transformers", max_prompt_length=16,
                      max_completion_length=5, seed=11, report_to="none", **overrides)


def test_colocate_sends_prompts_and_sampling_fields(tmp_path, fake_vllm):
    tok = load_tokenizer(TINY)
    engine = ColocateEngine("some/path", colocate_args(tmp_path), 1, 0, tok.pad_token_id, tok.eos_token_id,
                            extra_sampling={"presence_penalty": 0.5})
    llm = FakeLLM.instances[0]
    assert llm.model_path == "some/path"
    assert llm.kwargs == {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.4, "enable_sleep_mode": False,
                          "model_impl": "transformers", "max_model_len": 21, "seed": 11,
                          "distributed_executor_backend": "external_launcher", "logprobs_mode": "processed_logprobs"}
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05,
                              repetition_penalty=1.1, num_generations=3, stop_token_ids=(9,), stop_strings=("ab",))
    prompt_ids = [[5, 6, 7], [8, 9], [10]]
    engine.generate(prompt_ids, sampling)
    sent, fields = llm.calls[0]
    assert sent == [{"prompt_token_ids": ids} for ids in prompt_ids]
    assert fields == {"n": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
                      "max_tokens": 4, "stop_token_ids": [9], "stop": ["ab"], "include_stop_str_in_output": True,
                      "presence_penalty": 0.5, "logprobs": 0}
    # off and greedy are spelled as vLLM spells them
    off = sampling_fields(SamplingConfig(top_k=0, do_sample=False))
    assert off["top_k"] == -1 and off["temperature"] == 0.0


def test_colocate_completions_come_back_prompt_major(tmp_path, fake_vllm):
    tok = load_tokenizer(TINY)
    engine = ColocateEngine(TINY, colocate_args(tmp_path), 1, 0, tok.pad_token_id, tok.eos_token_id)
    FakeLLM.logprob_shift = -0.25
    prompt_ids, n = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], 3
    rollout = engine.generate(prompt_ids, SamplingConfig(max_new_tokens=5, num_generations=n))
    outputs = FakeLLM.instances[0].last
    assert rollout.completion_ids.shape[0] == len(prompt_ids) * n
    for j, prompt in enumerate(prompt_ids):
        for k in range(n):
            row, c = j * n + k, outputs[j].outputs[k]
            length = int(rollout.completion_mask[row].sum())
            assert rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist() == prompt
            assert rollout.completion_ids[row, :length].tolist() == c.token_ids
            assert rollout.logprobs[row, :length].tolist() == pytest.approx([lp[t].logprob for lp, t in
                                                                             zip(c.logprobs, c.token_ids)])
            assert bool(rollout.is_truncated[row]) == (c.finish_reason == "length")


def test_sleep_mode_wakes_for_generation_and_sync(tmp_path, fake_vllm):
    tok = load_tokenizer(TINY)
    engine = ColocateEngine(TINY, colocate_args(tmp_path, vllm_enable_sleep_mode=True), 1, 0, tok.pad_token_id,
                            tok.eos_token_id)
    llm = FakeLLM.instances[0]
    assert llm.sleeping
    engine.load_weights(policy_weights(load_causal_lm(TINY)))  # awake for the sync and the generation after it
    assert not llm.sleeping and llm.prefix_resets == 1 and llm.model.loaded
    engine.generate([[5, 6]], SamplingConfig(max_new_tokens=2))  # FakeLLM.generate asserts it is awake
    assert llm.sleeping
    engine.generate([[5, 6]], SamplingConfig(max_new_tokens=2))
    assert llm.sleeping and len(llm.calls) == 2


def test_trainer_syncs_every_weight_before_each_generation(tmp_path, fake_vllm):
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, max_steps=3, beta=0.05), use_vllm=True)
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(16))
    llm = FakeLLM.instances[0]
    FakeLLM.policy = trainer.policy
    start = {n: t.clone() for n, t in trainer.policy.state_dict().items()}
    train_and_check(trainer)
    # one generation per optimizer step, each after a sync of every tensor of the state dict
    assert len(llm.calls) == 3 and llm.in_sync == [True, True, True] and llm.prefix_resets == 3
    assert llm.model.loaded == list(trainer.policy.state_dict()) * 3
    # and the weights it generated with last are the ones after two updates, not the starting ones
    moved = [n for n, t in llm.model.hf.state_dict().items() if not torch.equal(t, start[n])]
    assert moved == list(start)


def test_behaviour_logprobs_are_the_policys_when_it_moves(tmp_path, fake_vllm):
    """num_iterations=2: old_logp (read by the second pass) is the policy's forward, vLLM's numbers are kept
    apart as vllm_logp."""
    FakeLLM.logprob_shift = -0.3
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, num_iterations=2), use_vllm=True)
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(8))
    rollout = trainer.sample_completions([[5, 6, 7], [8, 9]])
    micro = trainer.build_experience(rollout, torch.arange(8.0))
    rows = torch.cat([mb["rollout_row"] for mb in micro[:2]])
    order = torch.argsort(rows)
    old = torch.cat([_pad(mb["old_logp"], rollout.logprobs.shape[1]) for mb in micro[:2]])[order]
    vllm_logp = torch.cat([_pad(mb["vllm_logp"], rollout.logprobs.shape[1]) for mb in micro[:2]])[order]
    mask = rollout.completion_mask.bool()
    assert torch.equal(vllm_logp[mask], rollout.logprobs[mask])
    # the fake sampled with the policy's weights (synced), so the policy's log-probs are vLLM's minus the shift
    torch.testing.assert_close(old[mask], rollout.logprobs[mask] + 0.3, atol=1e-4, rtol=0)


def _pad(x, width):
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


# ---------------------------------------------------------------- the importance weights

def test_truncated_importance_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    sampled = torch.tensor([[-1.5, -1.0, -3.0]])
    weights = truncated_importance_weights(old, sampled, cap=3.0)
    # exp(0.5), exp(-1), exp(2.5) = 12.18 capped at 3
    assert weights[0].tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 3.0])
    old.requires_grad_(True)
    assert not truncated_importance_weights(old, sampled, cap=3.0).requires_grad


@pytest.mark.parametrize("shift, factor", [(-0.5, math.exp(0.5)), (-2.0, 3.0), (0.4, math.exp(-0.4))])
def test_loss_is_weighted_by_the_truncated_ratio(tmp_path, fake_vllm, shift, factor):
    """vLLM's log-probs are the policy's plus `shift` everywhere, so every token's weight is
    min(exp(-shift), 3): the policy loss (no KL, no entropy) is that factor times the uncorrected one."""
    FakeLLM.logprob_shift = shift
    args = GRPOConfig(**online_args(tmp_path, num_generations=4), use_vllm=True,
                      vllm_importance_sampling_mode="token_truncate")
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(8))
    micro = trainer.build_experience(trainer.sample_completions([[5, 6, 7], [8, 9]]), torch.arange(8.0))
    mb = dict(micro[0])
    # a group's advantages sum to 0 (so would its loss at ratio 1): other advantages, not all equal
    mb["advantages"] = torch.linspace(0.5, 2.0, mb["advantages"].numel()).view_as(mb["advantages"])
    corrected = float(trainer.compute_loss(trainer.model, mb).detach())
    trainer.args.vllm_importance_sampling_correction = False
    plain = float(trainer.compute_loss(trainer.model, mb).detach())
    assert plain != 0.0
    assert corrected == pytest.approx(factor * plain, rel=1e-4)


@pytest.mark.parametrize("mode, clip_min, shift, factor", [
    ("token_mask", None, -0.5, math.exp(0.5)),  # each token's ratio e^0.5 < 3: kept as it is
    ("token_mask", None, -2.0, 0.0),  # e^2 > 3: every token masked
    ("token_mask", 0.8, 0.4, 0.0),  # e^-0.4 = 0.67 < 0.8: every token masked
    ("token_truncate", 0.8, 0.4, 0.8),  # ... or raised to the lower bound
    ("sequence_truncate", None, -2.0, 3.0),  # a sequence's ratio e^(2 n) > 3: capped
    ("sequence_mask", None, -2.0, 0.0),  # ... or masked
    ("sequence_mask", None, 0.0, 1.0),  # vLLM's numbers are the policy's: ratio 1
])
def test_each_mode_weights_the_loss(tmp_path, fake_vllm, mode, clip_min, shift, factor):
    """Every token (or sequence) of the batch gets the same weight here, so the policy loss (no KL, no entropy)
    is `factor` times the uncorrected one; the logged mean weight is that factor."""
    FakeLLM.logprob_shift = shift
    args = GRPOConfig(**online_args(tmp_path, num_generations=4), use_vllm=True, vllm_importance_sampling_mode=mode,
                      vllm_importance_sampling_clip_min=clip_min)
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(8))
    mb = dict(trainer.build_experience(trainer.sample_completions([[5, 6, 7], [8, 9]]), torch.arange(8.0))[0])
    mb["advantages"] = torch.linspace(0.5, 2.0, mb["advantages"].numel()).view_as(mb["advantages"])
    trainer._metrics["train"].clear()
    corrected = float(trainer.compute_loss(trainer.model, mb).detach())
    assert trainer.recorded_metrics()["sampling/importance_sampling_ratio/mean"] == [pytest.approx(factor, rel=1e-4)]
    trainer.args.vllm_importance_sampling_correction = False
    plain = float(trainer.compute_loss(trainer.model, mb).detach())
    assert plain != 0.0
    assert corrected == pytest.approx(factor * plain, rel=1e-4, abs=1e-7)


# ---------------------------------------------------------------- PEFT weights

def test_peft_policy_weights_are_merged_under_base_names():
    from peft import LoraConfig, get_peft_model

    base = load_causal_lm(TINY)
    names = list(base.state_dict())
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    x = torch.tensor([[5, 6, 7, 8]])
    before = model(input_ids=x).logits
    sent = {name: t.clone() for name, t in policy_weights(model)}
    assert list(sent) == names
    torch.testing.assert_close(model(input_ids=x).logits, before)  # unmerged again afterwards
    merged = model.merge_and_unload().state_dict()
    for name in names:
        torch.testing.assert_close(sent[name], merged[name])
    assert not torch.equal(sent["model.layers.0.self_attn.q_proj.weight"], load_causal_lm(TINY).state_dict()[
        "model.layers.0.self_attn.q_proj.weight"])


# ---------------------------------------------------------------- server mode, TRL 0.2x's server (legacy)

class JsonHandler(http.server.BaseHTTPRequestHandler):
    """A quiet request handler that answers JSON (both fake servers' base)."""

    def log_message(self, *args):
        pass

    def _reply(self, payload, code=200):
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class LegacyFakeServer:
    """TRL 0.2x's `trl vllm-serve` endpoints over real HTTP, in a thread; /generate/ samples with a tiny model that the
    weight broadcast writes into (through `FakeCommunicator`)."""

    def __init__(self):
        self.model, self.tok = load_causal_lm(TINY).eval(), load_tokenizer(TINY)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.5)
        self.requests, self.announced, self.received, self.barriers = [], [], {}, 0
        self.policy, self.in_sync, self.legacy = None, [], False
        server = self

        class Handler(JsonHandler):

            def do_GET(self):
                server.requests.append((self.path, None))
                if self.path == "/health/":
                    return self._reply({"status": "ok"})
                if self.path == "/get_world_size/" and not server.legacy:
                    return self._reply({"world_size": 1})
                if self.path == "/get_tensor_parallel_size/":
                    return self._reply({"tensor_parallel_size": 2})
                self._reply({"detail": "Not Found"}, 404)

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                server.requests.append((self.path, payload))
                if self.path == "/generate/":
                    return self._reply(server.generate(payload))
                if self.path == "/update_named_param/":
                    server.announced.append(payload)
                if self.path in ("/init_communicator/", "/update_named_param/", "/reset_prefix_cache/",
                                 "/close_communicator/"):
                    return self._reply({"message": "ok"})
                self._reply({"detail": "Not Found"}, 404)

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def generate(self, request):
        if self.policy is not None:
            policy = dict(self.policy.state_dict())
            self.in_sync.append(all(torch.equal(t, policy[n]) for n, t in self.model.state_dict().items()))
        kwargs = request["generation_kwargs"]
        sampling = SamplingConfig(max_new_tokens=request["max_tokens"], temperature=request["temperature"],
                                  top_p=request["top_p"], top_k=max(request["top_k"], 0), min_p=request["min_p"],
                                  repetition_penalty=request["repetition_penalty"], num_generations=request["n"],
                                  stop_token_ids=tuple(kwargs["stop_token_ids"]), stop_strings=tuple(kwargs["stop"]))
        out = generate(self.model, request["prompts"], sampling, pad_token_id=self.tok.pad_token_id,
                       eos_token_id=self.tok.eos_token_id, tokenizer=self.tok, generator=torch.Generator().manual_seed(0))
        lengths = out.completion_mask.sum(1).tolist()
        return {"prompt_ids": request["prompts"],
                "completion_ids": [row[:n] for row, n in zip(out.completion_ids.tolist(), lengths)],
                "logprobs": [row[:n] for row, n in zip(out.logprobs.tolist(), lengths)]}

    def close(self):
        self.http.shutdown()
        self.http.server_close()


class FakeCommunicator:
    """Stands in for PyNcclCommunicator: the 'broadcast' lands the tensor in the fake server's model under
    the name /update_named_param/ announced just before (the real one needs CUDA and NCCL)."""

    def __init__(self, server, host, port, rank, world_size):
        self.server, self.args = server, (host, port, rank, world_size)
        self.group = types.SimpleNamespace(barrier=self._barrier)

    def broadcast(self, tensor, src):
        assert src == self.args[2]
        last = self.server.announced[-1]
        assert last["dtype"] == str(tensor.dtype) and last["shape"] == list(tensor.shape)
        self.server.received[last["name"]] = tensor.clone()
        with torch.no_grad():
            self.server.model.state_dict()[last["name"]].copy_(tensor)

    def _barrier(self):
        self.server.barriers += 1


@pytest.fixture
def server():
    s = LegacyFakeServer()
    yield s
    s.close()


def client(server, **kw):
    tok = load_tokenizer(TINY)
    return LegacyServerEngine(server.url, 5.0, 51299, tok.pad_token_id, tok.eos_token_id,
                        communicator_factory=lambda host, port, rank, world, device: FakeCommunicator(
                            server, host, port, rank, world), **kw)


def test_server_generate_request_and_answer(server):
    engine = client(server, extra_sampling={"seed": 7})
    prompt_ids = [[5, 6, 7], [8, 9]]
    sampling = SamplingConfig(max_new_tokens=4, temperature=0.8, top_k=0, num_generations=3, stop_token_ids=(9,),
                              stop_strings=("zz",))
    rollout = engine.generate(prompt_ids, sampling)
    path, request = server.requests[-1]
    assert path == "/generate/"
    assert request == {"prompts": prompt_ids, "n": 3, "temperature": 0.8, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                       "repetition_penalty": 1.0, "max_tokens": 4,
                       "generation_kwargs": {"stop_token_ids": [9], "stop": ["zz"], "include_stop_str_in_output": True,
                                             "seed": 7}}
    answer = server.generate(request)  # the same seed: the same completions
    stops = {engine.eos_token_id, 9}
    for row, completion in enumerate(answer["completion_ids"]):
        length = int(rollout.completion_mask[row].sum())
        assert rollout.completion_ids[row, :length].tolist() == completion
        assert rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist() == prompt_ids[row // 3]
        assert rollout.logprobs[row, :length].tolist() == pytest.approx(answer["logprobs"][row])
        assert bool(rollout.is_truncated[row]) == (len(completion) == 4 and completion[-1] not in stops)


def test_server_weight_sync_sends_every_tensor(server):
    engine = client(server)
    policy = load_causal_lm(TINY)
    engine.load_weights(policy_weights(policy))
    paths = [p for p, _ in server.requests]
    init = server.requests[paths.index("/init_communicator/")][1]
    assert init == {"host": "0.0.0.0", "port": 51299, "world_size": 2}  # one server worker + this client
    assert engine.communicator.args == ("127.0.0.1", 51299, 1, 2)
    state = policy.state_dict()
    assert [a["name"] for a in server.announced] == list(state) and server.barriers == len(state)
    for name, tensor in state.items():
        assert torch.equal(server.received[name], tensor)
    assert paths[-1] == "/reset_prefix_cache/"
    engine.close()
    assert server.requests[-1][0] == "/close_communicator/"


def test_server_world_size_of_an_older_server(server):
    """TRL 0.17's server has no /get_world_size/, only /get_tensor_parallel_size/."""
    server.legacy = True
    engine = client(server)
    engine.init_communicator()
    assert engine.communicator.args[2:] == (2, 3)


def test_server_not_main_process_sends_nothing(server):
    engine = client(server, is_main=False)
    engine.load_weights(policy_weights(load_causal_lm(TINY)))
    assert [p for p, _ in server.requests] == ["/health/"] and engine.communicator is None


def test_server_health_check_times_out_with_a_clear_error():
    with pytest.raises(ConnectionError, match=r"no vLLM server answered at http://127.0.0.1:9/health/ within "
                                              r"vllm_server_timeout=0.3 s"):
        LegacyServerEngine("http://127.0.0.1:9", 0.3, 51216, 0, 1)
    with pytest.raises(ConnectionError, match=r"no vLLM server answered at http://127.0.0.1:9/v1/models within "
                                              r"vllm_server_timeout=0.3 s; start one with `trl vllm-serve"):
        speaks_openai("http://127.0.0.1:9", 0.3)


def test_trainer_in_server_mode_syncs_and_trains(tmp_path, server, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(vllm_engine, "cuda_available", lambda: True)
    monkeypatch.setattr(vllm_engine, "nccl_communicator", lambda host, port, rank, world, device: FakeCommunicator(
        server, host, port, rank, world))
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, beta=0.05), use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=server.url)
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(16))
    # no GET /v1/models on this server: the legacy protocol is chosen
    assert isinstance(trainer.vllm, LegacyServerEngine) and ("/v1/models", None) in server.requests
    server.policy = trainer.policy
    train_and_check(trainer)
    assert server.in_sync == [True, True]
    assert [p for p, _ in server.requests].count("/reset_prefix_cache/") == 2


# ---------------------------------------------------------------- server mode, vLLM's own server (TRL 1.x)

class FakeVllmServer:
    """The endpoints of vLLM's OpenAI-compatible server that TRL 1.x's `trl vllm-serve` runs, over real HTTP in a
    thread. /v1/completions samples from token-id prompts with a tiny model; as vLLM's workers do,
    /init_weight_transfer_engine answers once the client has joined the group (`FakeGroup`), and /update_weights
    receives each announced tensor from the client's broadcast, made meanwhile, and loads it into that model."""

    def __init__(self, workers: int = 2):
        self.model, self.tok = load_causal_lm(TINY).eval(), load_tokenizer(TINY)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.5)
        self.workers, self.requests, self.answers, self.loaded = workers, [], [], []
        self.policy, self.in_sync, self.shuffle, self.updating = None, [], False, False
        self.weight_transfer_config, self.logprobs_mode, self.dev_mode = {"backend": "nccl"}, "processed_logprobs", True
        self.in_init, self.joined = threading.Event(), threading.Event()
        self.wire, self.acks = queue.Queue(), queue.Queue()  # the broadcast: a tensor, then the receiver's ack
        server = self

        class Handler(JsonHandler):

            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                server.requests.append((self.path, None))
                if url.path == "/health":
                    return self._reply({})
                if url.path == "/v1/models":
                    return self._reply({"object": "list", "data": [{"id": "served/tiny", "object": "model"}]})
                if url.path == "/get_world_size":
                    return self._reply({"world_size": server.workers})
                if url.path == "/server_info" and url.query == "config_format=json" and server.dev_mode:
                    return self._reply({"vllm_config": {"weight_transfer_config": server.weight_transfer_config,
                                                        "model_config": {"logprobs_mode": server.logprobs_mode}}})
                self._reply({"detail": "Not Found"}, 404)

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                server.requests.append((self.path, payload))
                try:
                    answer = server.post(self.path, payload)
                except (AssertionError, queue.Empty) as e:  # what vLLM would refuse, or a transfer that never came
                    return self._reply({"error": repr(e)}, 400)
                if answer is None:
                    return self._reply({"detail": "Not Found"}, 404)
                self._reply(answer)

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def post(self, path, payload):
        if path == "/v1/completions":
            return self.complete(payload)
        if path == "/init_weight_transfer_engine":
            self.in_init.set()
            assert self.joined.wait(5), "the client did not join the group while the server waited in it"
            return {}
        if path == "/start_weight_update":
            assert not self.updating, "start_weight_update twice"
            self.updating = True
            return {}
        if path == "/update_weights":
            assert self.updating, "update_weights outside start_weight_update .. finish_weight_update"
            info = payload["update_info"]
            state = self.model.state_dict()
            for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
                tensor = self.wire.get(timeout=5)  # what the client broadcasts meanwhile
                assert tensor.dtype == getattr(torch, dtype) and list(tensor.shape) == shape, name
                with torch.no_grad():
                    state[name].copy_(tensor)
                self.loaded.append(name)
                self.acks.put(name)
            return {}
        if path == "/finish_weight_update":
            assert self.updating, "finish_weight_update without start_weight_update"
            self.updating = False
            return {}
        if path == "/reset_prefix_cache":
            return {"success": True}
        return None

    def complete(self, request):
        if self.policy is not None:
            policy = dict(self.policy.state_dict())
            self.in_sync.append(all(torch.equal(t, policy[n]) for n, t in self.model.state_dict().items()))
        t, n = request["temperature"], request["n"]
        sampling = SamplingConfig(max_new_tokens=request["max_tokens"], temperature=t or 1.0, do_sample=t > 0,
                                  top_p=request["top_p"], top_k=max(request["top_k"], 0), min_p=request["min_p"],
                                  repetition_penalty=request["repetition_penalty"], num_generations=n,
                                  stop_token_ids=tuple(request["stop_token_ids"]), stop_strings=tuple(request["stop"]))
        out = generate(self.model, request["prompt"], sampling, pad_token_id=self.tok.pad_token_id,
                       eos_token_id=self.tok.eos_token_id, tokenizer=self.tok,
                       generator=torch.Generator().manual_seed(request.get("seed", 0)))
        choices = []
        for row, length in enumerate(out.completion_mask.sum(1).tolist()):
            tokens, logprobs = out.completion_ids[row, :length].tolist(), out.logprobs[row, :length].tolist()
            choices.append({"index": row, "text": self.tok.decode(tokens), "token_ids": tokens,
                            "prompt_token_ids": request["prompt"][row // n],
                            "logprobs": {"tokens": [f"token_id:{x}" for x in tokens], "token_logprobs": logprobs,
                                         "top_logprobs": [{f"token_id:{x}": lp} for x, lp in zip(tokens, logprobs)],
                                         "text_offset": list(range(length))},
                            "finish_reason": "length" if out.is_truncated[row] else "stop", "stop_reason": None})
        self.answers.append([dict(c) for c in choices])
        if self.shuffle:  # the client must go by each choice's index, not by the order of the list
            random.Random(0).shuffle(choices)
        return {"id": "cmpl-0", "object": "text_completion", "model": request["model"], "choices": choices}

    def paths(self):
        return [urllib.parse.urlparse(p).path for p, _ in self.requests]

    def close(self):
        self.http.shutdown()
        self.http.server_close()


class FakeGroup:
    """Stands in for the NCCL group of vLLM's weight-transfer engine. As with NCCL, joining needs the server's
    workers to be joining too (inside /init_weight_transfer_engine), and a broadcast from rank 0 completes only
    when the server, inside /update_weights, receives it: a client that did these one after the other, instead of
    at the same time, would time out here."""

    def __init__(self, server, host, port, rank, world_size):
        self.server, self.args = server, (host, port, rank, world_size)
        assert server.in_init.wait(5), "joined the group while the server was not in /init_weight_transfer_engine"
        server.joined.set()

    def broadcast(self, tensor, src):
        assert src == 0 and tensor.is_contiguous()
        self.server.wire.put(tensor.clone())
        self.server.acks.get(timeout=5)


@pytest.fixture
def vllm_server():
    s = FakeVllmServer()
    yield s
    s.close()


def vllm_client(server, **kw):
    tok = load_tokenizer(TINY)
    return ServerEngine(server.url, 5.0, 51300, tok.pad_token_id, tok.eos_token_id,
                        communicator_factory=lambda host, port, rank, world, device: FakeGroup(
                            server, host, port, rank, world), **kw)


def test_vllm_server_completion_request_fields(vllm_server):
    engine = vllm_client(vllm_server, extra_sampling={"seed": 7, "presence_penalty": 0.5})
    assert engine.model == "served/tiny"  # from GET /v1/models
    prompt_ids = [[5, 6, 7], [8, 9]]
    engine.generate(prompt_ids, SamplingConfig(max_new_tokens=4, temperature=0.8, top_p=0.9, top_k=5, min_p=0.05,
                                               repetition_penalty=1.1, num_generations=3, stop_token_ids=(9,),
                                               stop_strings=("zz",)))
    path, request = vllm_server.requests[-1]
    assert path == "/v1/completions"
    assert request == {"model": "served/tiny", "prompt": prompt_ids, "n": 3, "temperature": 0.8, "top_p": 0.9,
                       "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 4, "stop_token_ids": [9],
                       "stop": ["zz"], "include_stop_str_in_output": True, "seed": 7, "presence_penalty": 0.5,
                       "logprobs": 0, "return_token_ids": True}
    # greedy and no top-k, as vLLM spells them
    engine.generate([[5]], SamplingConfig(max_new_tokens=2, do_sample=False))
    request = vllm_server.requests[-1][1]
    assert request["temperature"] == 0.0 and request["top_k"] == -1 and request["n"] == 1


def test_vllm_server_completions_come_back_prompt_major(vllm_server):
    """Each row is the choice with index prompt * n + sample, whatever the order of the answer's list; its token
    ids, log-probs and truncation flag (finish_reason) are read back."""
    engine = vllm_client(vllm_server)
    vllm_server.shuffle = True
    prompt_ids, n, max_tokens = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], 3, 4
    stops = tuple(range(3, 1024, 7))  # about one token in seven stops a completion: some stop, some run out
    rollout = engine.generate(prompt_ids, SamplingConfig(max_new_tokens=max_tokens, num_generations=n,
                                                         stop_token_ids=stops))
    choices = vllm_server.answers[-1]
    assert [c["index"] for c in choices] == list(range(len(prompt_ids) * n))
    reasons = [c["finish_reason"] for c in choices]
    assert "length" in reasons and "stop" in reasons
    for row, choice in enumerate(choices):
        length = int(rollout.completion_mask[row].sum())
        assert rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist() == prompt_ids[row // n]
        assert rollout.completion_ids[row, :length].tolist() == choice["token_ids"]
        assert rollout.logprobs[row, :length].tolist() == pytest.approx(choice["logprobs"]["token_logprobs"])
        assert bool(rollout.is_truncated[row]) == (choice["finish_reason"] == "length")
        if choice["finish_reason"] == "stop":
            assert choice["token_ids"][-1] in stops or choice["token_ids"][-1] == engine.eos_token_id


def test_vllm_server_answer_without_token_ids_is_refused(vllm_server, monkeypatch):
    engine = vllm_client(vllm_server)
    real = vllm_server.complete
    monkeypatch.setattr(vllm_server, "complete", lambda request: {"choices": [
        {k: v for k, v in c.items() if k != "token_ids"} for c in real(request)["choices"]]})
    with pytest.raises(RuntimeError, match="no token_ids or logprobs: posttrain needs a vLLM whose OpenAI server "
                                           "honours return_token_ids"):
        engine.generate([[5, 6]], SamplingConfig(max_new_tokens=2, num_generations=2))


def test_vllm_server_weight_updates(vllm_server):
    """The group is opened once; each sync is start, /update_weights per chunk (every tensor announced with its
    name, dtype and shape, then broadcast), finish, and a prefix-cache reset."""
    engine = vllm_client(vllm_server, weight_chunk_bytes=64 << 10)
    policy = load_causal_lm(TINY)
    state = policy.state_dict()
    for step in range(2):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01 * (step + 1))
        engine.load_weights(policy_weights(policy))
        for name, tensor in policy.state_dict().items():
            assert torch.equal(vllm_server.model.state_dict()[name], tensor), name
    paths = vllm_server.paths()
    assert paths.count("/init_weight_transfer_engine") == 1 and paths.count("/get_world_size") == 1
    init = vllm_server.requests[paths.index("/init_weight_transfer_engine")][1]["init_info"]
    assert init == {"master_address": "127.0.0.1", "master_port": 51300, "rank_offset": 1, "world_size": 3}
    assert engine.communicator.args == ("127.0.0.1", 51300, 0, 3)  # this process is rank 0 of 1 + 2 workers
    syncs = paths[paths.index("/init_weight_transfer_engine") + 1:]
    first = syncs[:syncs.index("/reset_prefix_cache") + 1]
    assert syncs == first * 2
    chunks = first.count("/update_weights")
    assert first == ["/start_weight_update"] + ["/update_weights"] * chunks + ["/finish_weight_update",
                                                                             "/reset_prefix_cache"]
    infos = [p["update_info"] for path, p in vllm_server.requests if path == "/update_weights"]
    # a chunk closes at the tensor that takes it to 64 KiB or more
    sizes = [[state[name].numel() * 4 for name in info["names"]] for info in infos[:chunks]]
    assert chunks > 2 and all(sum(c) >= 64 << 10 > sum(c[:-1]) for c in sizes[:-1]) and sum(sizes[-1][:-1]) < 64 << 10
    announced = [(n, d, s) for info in infos for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"])]
    assert announced == [(n, "float32", list(t.shape)) for n, t in state.items()] * 2
    assert vllm_server.loaded == list(state) * 2


def test_vllm_server_not_set_up_for_training_says_how_to_start_it(vllm_server):
    policy = load_causal_lm(TINY)
    vllm_server.dev_mode = False
    with pytest.raises(RuntimeError, match="does not expose its development endpoints, which the weight sync uses: "
                                           "start it with VLLM_SERVER_DEV_MODE=1"):
        vllm_client(vllm_server).load_weights(policy_weights(policy))
    vllm_server.dev_mode, vllm_server.weight_transfer_config = True, None
    with pytest.raises(RuntimeError, match=r"""no weight-transfer engine: start it with --weight-transfer-config """
                                           r"""'\{"backend": "nccl"\}'"""):
        vllm_client(vllm_server).load_weights(policy_weights(policy))
    assert "/init_weight_transfer_engine" not in vllm_server.paths()
    # log-probs before temperature would skew the importance weights: a warning, and the sync goes on
    vllm_server.weight_transfer_config, vllm_server.logprobs_mode = {"backend": "nccl"}, "raw_logprobs"
    with pytest.warns(UserWarning, match="returns 'raw_logprobs' log-probs.*--logprobs-mode processed_logprobs"):
        vllm_client(vllm_server).load_weights(policy_weights(policy))
    assert vllm_server.loaded == list(policy.state_dict())


def test_vllm_server_not_main_process_sends_nothing(vllm_server):
    engine = vllm_client(vllm_server, is_main=False)
    sent = []
    engine.load_weights((sent.append(name) or (name, t)) for name, t in load_causal_lm(TINY).state_dict().items())
    assert len(sent) == 27  # iterated (a sharded policy gathers collectively), but nothing sent
    assert vllm_server.paths() == ["/health", "/v1/models"] and engine.communicator is None


def test_server_protocol_is_probed(vllm_server, server):
    assert speaks_openai(vllm_server.url, 5.0) and not speaks_openai(server.url, 5.0)
    args = types.SimpleNamespace(vllm_mode="server", vllm_server_base_url=None, vllm_server_host="127.0.0.1",
                                 vllm_server_timeout=5.0, vllm_group_port=51301)
    accelerator = types.SimpleNamespace(is_main_process=True, device=torch.device("cpu"))
    for fake, engine_class in ((vllm_server, ServerEngine), (server, LegacyServerEngine)):
        args.vllm_server_port = int(fake.url.rsplit(":", 1)[1])
        engine = make_engine(args, TINY, accelerator, 0, 2)
        assert type(engine) is engine_class and engine.base_url == fake.url


def test_trainer_with_vllm_server_syncs_and_trains(tmp_path, vllm_server, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(vllm_engine, "cuda_available", lambda: True)
    monkeypatch.setattr(vllm_engine, "nccl_communicator", lambda host, port, rank, world, device: FakeGroup(
        vllm_server, host, port, rank, world))
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, beta=0.05), use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=vllm_server.url)
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(16))
    assert isinstance(trainer.vllm, ServerEngine)
    vllm_server.policy = trainer.policy
    train_and_check(trainer)
    # two generations, each after a sync of every weight: the server sampled with the policy being trained
    assert vllm_server.in_sync == [True, True]
    paths = vllm_server.paths()
    assert paths.count("/init_weight_transfer_engine") == 1 and paths.count("/start_weight_update") == 2
    assert paths.count("/finish_weight_update") == 2 and paths.count("/reset_prefix_cache") == 2
    assert vllm_server.loaded == list(trainer.policy.state_dict()) * 2
