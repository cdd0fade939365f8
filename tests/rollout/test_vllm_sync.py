"""vLLM weight sync beyond full weights: deadlines on every server call, group join and transfer (a dead peer
gives a TimeoutError naming what hung, not a hang), and LoRA adapters synced alone, unmerged
(`vllm_sync_strategy="lora_adapter"`), colocated and on a server. Against the fakes of test_vllm_engine.py.
"""

import copy
import sys
import threading
import time
import types

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from tests.helpers.online import first_token_reward, online_args, prompts, train_and_check
from tests.rollout.test_vllm_engine import (TINY, FakeCommunicator, FakeGroup, FakeLLM, FakeVllmServer,
                                            LegacyFakeServer, client, fake_vllm, vllm_client)  # noqa: F401

from posttrain.models.loading import load_causal_lm
from posttrain.rollout import vllm_engine
from posttrain.rollout.generate import SamplingConfig
from posttrain.rollout.vllm_engine import lora_rank, make_engine, policy_weights
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

STUCK = threading.Event()  # what the hanging fakes wait on; set at each test's end so their threads finish


@pytest.fixture(autouse=True)
def release_stuck():
    STUCK.clear()
    yield
    STUCK.set()


# ---------------------------------------------------------------- deadlines

class SilentServer(FakeVllmServer):
    """vLLM's server whose `stuck` endpoints never answer (a server or worker that died mid-call)."""

    def __init__(self, stuck=()):
        super().__init__()
        self.stuck = set(stuck)

    def post(self, path, payload):
        if path in self.stuck:
            STUCK.wait(30)
            return {}
        return super().post(path, payload)


class SilentGroup(FakeGroup):
    """An NCCL group whose broadcast never completes (the receiving workers are gone)."""

    def broadcast(self, tensor, src):
        STUCK.wait(30)


def _silent(**kw):
    server = SilentServer(**kw)
    return server


def test_a_generation_the_server_never_answers_times_out_naming_it():
    server = _silent(stuck={"/v1/completions"})
    engine = vllm_client(server, request_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not answer POST /v1/completions within vllm_request_timeout=0.5 s"):
        engine.generate([[5, 6]], SamplingConfig(max_new_tokens=2))
    assert time.monotonic() - start < 5
    server.close()


def test_a_group_join_without_the_workers_times_out_naming_it():
    server = FakeVllmServer()
    tok_pad, eos = 0, 1
    engine = vllm_engine.ServerEngine(server.url, 5.0, 51302, tok_pad, eos, request_timeout=0.5,
                                      communicator_factory=lambda *args: STUCK.wait(30))
    with pytest.raises(TimeoutError, match=r"joining the NCCL weight-transfer group at 127.0.0.1:51302 with the "
                                           r"server's workers did not finish within vllm_request_timeout=0.5 s"):
        engine.load_weights(policy_weights(load_causal_lm(TINY)))
    server.close()


def test_a_broadcast_nobody_receives_times_out_naming_it():
    server = FakeVllmServer()
    engine = vllm_engine.ServerEngine(server.url, 5.0, 51303, 0, 1, request_timeout=0.5,
                                      communicator_factory=lambda host, port, rank, world, device: SilentGroup(
                                          server, host, port, rank, world))
    with pytest.raises(TimeoutError, match=r"broadcasting \d+ weights \(model.embed_tokens.weight \.\.\.\) to the "
                                           r"server's workers did not finish within vllm_request_timeout=0.5 s"):
        engine.load_weights(policy_weights(load_causal_lm(TINY)))
    server.close()


def test_an_update_the_server_never_confirms_times_out_naming_it():
    server = _silent(stuck={"/update_weights"})

    class Fire(FakeGroup):  # the tensors leave; the server never says it loaded them
        def broadcast(self, tensor, src):
            pass

    engine = vllm_engine.ServerEngine(server.url, 5.0, 51304, 0, 1, request_timeout=0.5,
                                      communicator_factory=lambda host, port, rank, world, device: Fire(
                                          server, host, port, rank, world))
    # the request's own socket deadline or the wait for its answer: whichever fires first names the endpoint
    with pytest.raises(TimeoutError, match=r"(POST http://127.0.0.1:\d+/update_weights did not finish|did not answer "
                                           r"POST /update_weights) within vllm_request_timeout=0.5 s"):
        engine.load_weights(policy_weights(load_causal_lm(TINY)))
    server.close()


def test_legacy_server_calls_have_deadlines_too():
    server = LegacyFakeServer()

    class Stuck(FakeCommunicator):
        def _barrier(self):
            STUCK.wait(30)

    engine = client(server, request_timeout=0.5)
    engine.communicator_factory = lambda host, port, rank, world, device: Stuck(server, host, port, rank, world)
    with pytest.raises(TimeoutError, match=r"broadcasting model.embed_tokens.weight to the server's workers did not "
                                           r"finish within vllm_request_timeout=0.5 s"):
        engine.load_weights(policy_weights(load_causal_lm(TINY)))
    server.close()


def test_request_timeout_comes_from_the_config(tmp_path):
    server = FakeVllmServer()
    args = types.SimpleNamespace(vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=5.0,
                                 vllm_group_port=51305, vllm_request_timeout=2.5)
    accelerator = types.SimpleNamespace(is_main_process=True, device=torch.device("cpu"))
    assert make_engine(args, TINY, accelerator, 0, 1).request_timeout == 2.5
    server.close()
    with pytest.raises(ValueError, match=r"vllm_request_timeout must be > 0 seconds \(or None: no deadline\)"):
        GRPOConfig(output_dir=str(tmp_path), vllm_request_timeout=0)
    with pytest.raises(ValueError, match="vllm_sync_strategy='merged' is unknown"):
        GRPOConfig(output_dir=str(tmp_path), vllm_sync_strategy="merged")


# ---------------------------------------------------------------- LoRA adapters, unmerged

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def test_lora_rank_and_what_cannot_go_as_an_adapter():
    base = load_causal_lm(TINY)
    with pytest.raises(ValueError, match="syncs a LoRA adapter, and this policy has none"):
        lora_rank(base)
    assert lora_rank(get_peft_model(load_causal_lm(TINY), LoraConfig(**LORA))) == 8
    assert lora_rank(get_peft_model(load_causal_lm(TINY), LoraConfig(**{**LORA, "r": 20}))) == 32
    with pytest.raises(ValueError, match="vLLM loads plain LoRA adapters only, this one is LORA with DoRA"):
        lora_rank(get_peft_model(load_causal_lm(TINY), LoraConfig(**LORA, use_dora=True)))
    with pytest.raises(ValueError, match=r"modules_to_save=.*lm_head.* are trained whole"):
        lora_rank(get_peft_model(load_causal_lm(TINY), LoraConfig(**LORA, modules_to_save=["lm_head"])))


def _adapter_in_sync(folder, policy) -> bool:
    """Whether the adapter saved in `folder` is the policy's adapter now, tensor for tensor."""
    saved, current = load_file(f"{folder}/adapter_model.safetensors"), get_peft_model_state_dict(policy)
    return saved.keys() == current.keys() and all(torch.equal(saved[k], current[k].cpu()) for k in saved)


def _with_adapter(base, folder):
    """vLLM's view of base + adapter: the checkpoint's weights with the saved adapter merged."""
    return PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload().eval()


class LoraLLM(FakeLLM):
    """vllm.LLM with enable_lora: its weights are the base checkpoint's, never written; each generation samples
    with the adapter its LoRA request names, loaded from that folder."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self.base, self.requests = load_causal_lm(TINY).eval(), []

    def generate(self, prompts, params, use_tqdm=True, lora_request=None):
        self.requests.append(lora_request)
        self.model.hf = _with_adapter(self.base, lora_request.lora_path)
        self.in_sync.append(_adapter_in_sync(lora_request.lora_path, LoraLLM.lora_policy))
        return super().generate(prompts, params, use_tqdm)


class LoRARequest:
    def __init__(self, lora_name, lora_int_id, lora_path):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path


def test_colocate_generates_with_the_adapter_alone(tmp_path, fake_vllm, monkeypatch):
    fake_vllm.LLM = LoraLLM
    lora_module = types.ModuleType("vllm.lora.request")
    lora_module.LoRARequest = LoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora_module)
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, beta=0.05), use_vllm=True,
                      vllm_sync_strategy="lora_adapter")
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(16),
                          peft_config=LoraConfig(**LORA))
    llm = FakeLLM.instances[0]
    LoraLLM.lora_policy = trainer.policy
    assert {k: llm.kwargs[k] for k in ("enable_lora", "max_lora_rank", "max_loras")} == {
        "enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    train_and_check(trainer)
    assert llm.model.loaded == [] and llm.prefix_resets == 0  # no weight was sent, nothing merged
    assert [(r.lora_name, r.lora_int_id) for r in llm.requests] == [("posttrain-policy-1", 1), ("posttrain-policy-2", 2)]
    assert llm.in_sync == [True, True]  # each generation used the adapter of the policy at that step
    folder = llm.requests[-1].lora_path
    assert folder == str(tmp_path / "vllm_adapter" / "process-0" / "sync-2")
    assert all("lora_" in k for k in load_file(f"{folder}/adapter_model.safetensors"))  # the adapter, no base weight


class LoraServer(FakeVllmServer):
    """vLLM's server run with --enable-lora and runtime LoRA updating: /v1/load_lora_adapter loads a folder under a
    name, /v1/unload_lora_adapter drops it, and a completion whose model is an adapter's name samples with it."""

    def __init__(self):
        super().__init__()
        self.base, self.adapters, self.lora_policy = load_causal_lm(TINY).eval(), {}, None

    def post(self, path, payload):
        if path == "/v1/load_lora_adapter":
            assert payload["lora_name"] not in self.adapters
            self.adapters[payload["lora_name"]] = payload["lora_path"]
            return {}
        if path == "/v1/unload_lora_adapter":
            del self.adapters[payload["lora_name"]]
            return {}
        return super().post(path, payload)

    def complete(self, request):
        folder = self.adapters[request["model"]]
        self.model = _with_adapter(self.base, folder)
        self.policy = None
        self.in_sync.append(_adapter_in_sync(folder, self.lora_policy))
        return super().complete(request)


def test_server_loads_each_adapter_and_unloads_the_last(tmp_path, monkeypatch):
    server = LoraServer()
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(vllm_engine, "cuda_available", lambda: True)
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, beta=0.05), use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=server.url, vllm_sync_strategy="lora_adapter")
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(16),
                          peft_config=LoraConfig(**LORA))
    server.lora_policy = trainer.policy
    train_and_check(trainer)
    paths = server.paths()
    assert "/init_weight_transfer_engine" not in paths and "/update_weights" not in paths  # no NCCL at all
    loads = [p for path, p in server.requests if path == "/v1/load_lora_adapter"]
    assert [p["lora_name"] for p in loads] == ["posttrain-policy-1", "posttrain-policy-2"]
    assert loads[1]["lora_path"] == str(tmp_path / "vllm_adapter" / "sync-2")
    assert [p for path, p in server.requests if path == "/v1/unload_lora_adapter"] == [{"lora_name": "posttrain-policy-1"}]
    models = [p["model"] for path, p in server.requests if path == "/v1/completions"]
    assert models == ["posttrain-policy-1", "posttrain-policy-2"] and server.in_sync == [True, True]
    server.close()


def test_legacy_server_and_sharded_policies_refuse_adapter_sync(tmp_path, monkeypatch):
    server = LegacyFakeServer()
    args = types.SimpleNamespace(vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=5.0,
                                 vllm_group_port=51306, vllm_request_timeout=5.0, vllm_sync_strategy="lora_adapter",
                                 output_dir=str(tmp_path))
    accelerator = types.SimpleNamespace(is_main_process=True, device=torch.device("cpu"))
    policy = get_peft_model(load_causal_lm(TINY), LoraConfig(**LORA))
    monkeypatch.setattr("posttrain.models.loading.shards_weights", lambda acc: None)
    with pytest.raises(ValueError, match=r"TRL 0.2x's `trl vllm-serve`, which has no such endpoint"):
        make_engine(args, TINY, accelerator, 0, 1, policy=policy)
    monkeypatch.setattr("posttrain.models.loading.shards_weights", lambda acc: "zero3")
    with pytest.raises(ValueError, match="with ZeRO-3 / FSDP sharded weights use vllm_sync_strategy='weights'"):
        make_engine(args, TINY, accelerator, 0, 1, policy=policy)
    server.close()


def test_server_adapters_sampled_ahead_are_the_published_snapshots(tmp_path, monkeypatch):
    """max_staleness=1 with vllm_sync_strategy="lora_adapter": the background sampler saves and loads the adapter
    of each published snapshot (step 0's for batches 0 and 1, step 1's for batch 2), from its own copy."""
    from transformers import TrainerCallback

    class Adapters(TrainerCallback):
        def __init__(self):
            self.at = {}

        def on_step_begin(self, args, state, control, **kwargs):
            self.at[state.global_step] = {k: v.clone() for k, v in get_peft_model_state_dict(trainer.policy).items()}

    server = LoraServer()
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setattr(vllm_engine, "cuda_available", lambda: True)
    args = GRPOConfig(**online_args(tmp_path, num_generations=4, beta=0.05, max_steps=3, max_staleness=1),
                      use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url,
                      vllm_sync_strategy="lora_adapter")
    trainer = GRPOTrainer(TINY, first_token_reward, args=args, train_dataset=prompts(16),
                          peft_config=LoraConfig(**LORA))
    server.lora_policy = copy.deepcopy(trainer.policy)  # (its in_sync is not read: the policy trains meanwhile)
    adapters = Adapters()
    trainer.add_callback(adapters)
    train_and_check(trainer)
    loads = [p for path, p in server.requests if path == "/v1/load_lora_adapter"]
    assert [p["lora_name"] for p in loads] == ["posttrain-policy-1", "posttrain-policy-2"]
    models = [p["model"] for path, p in server.requests if path == "/v1/completions"]
    assert models == ["posttrain-policy-1", "posttrain-policy-1", "posttrain-policy-2"]
    for folder, step in ((loads[0]["lora_path"], 0), (loads[1]["lora_path"], 1)):
        saved = load_file(f"{folder}/adapter_model.safetensors")
        assert saved.keys() == adapters.at[step].keys()
        assert all(torch.equal(saved[k], adapters.at[step][k]) for k in saved), step
    server.close()
