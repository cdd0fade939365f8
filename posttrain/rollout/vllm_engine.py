"""Generation with vLLM for the online trainers (`use_vllm=True`), in TRL's two modes.

vLLM samples whole completions, so it does not fit the sampler's per-token `SamplerBackend`
interface (docs/sampler.md): it stands where a `rollout_func` stands, taking each process's prompt
ids and returning `num_generations` completions per prompt, prompt-major, with each sampled
token's log-prob, as a `Rollout` (`to_rollout`).

- `ColocateEngine` (`vllm_mode="colocate"`): a `vllm.LLM` in the training process, sharing its GPU
  (`vllm_gpu_memory_utilization`). Weights are loaded into it by reference through
  `LLM.apply_model(model.load_weights)`, then its prefix cache is reset.
- Server mode (`vllm_mode="server"`): a client of a vLLM server on other GPUs, of whichever protocol it speaks
  (`speaks_openai` probes GET /v1/models). `ServerEngine`: vLLM's OpenAI-compatible server, which TRL 1.x's
  `trl vllm-serve` runs (`vllm serve` with its development endpoints): /v1/completions from token ids, weights
  through vLLM's weight-transfer engine (/init_weight_transfer_engine, /start_weight_update, /update_weights,
  /finish_weight_update), the tensors broadcast over NCCL from this process as rank 0. `LegacyServerEngine`:
  the server TRL 0.18-0.2x's `trl vllm-serve` ran (/generate/, /init_communicator/, /update_named_param/, ...),
  the tensors broadcast from this process as the last rank. Both use vLLM's `PyNcclCommunicator` on a
  `StatelessProcessGroup`, built by an injectable `communicator_factory`.

What is synced and when: the trainer calls the engine's `sync(policy)` before a generation whenever an
optimizer step has happened since the last one (and before the first): by default `load_weights(policy_weights
(policy))`, every tensor of the policy's state dict under its Hugging Face name, PEFT adapters merged in,
sharded weights gathered; with `vllm_sync_strategy="lora_adapter"` the LoRA adapter alone, saved to a folder
(`AdapterFolders`) that vLLM loads as a LoRA adapter (colocate: a `LoRARequest` on every generation; server:
/v1/load_lora_adapter, then the adapter's name as the request's model). Multi-turn rollouts (tools,
environments) call `generate` once per turn (`multiturn.engine_turns`).

Deadlines (server mode): every HTTP request, the join of the NCCL group and each chunk's broadcast run under
`vllm_request_timeout`; a server or worker that stops answering raises a TimeoutError naming the call.

vLLM's log-probs are not the trainer's (other kernels, maybe another dtype): the trainer
recomputes the behaviour log-probs with the policy where they are used and weights each token's
policy loss by the `vllm_importance_sampling_mode` correction of `core.importance` (TRL's
`vllm_importance_sampling_correction`).

Only the plumbing is tested here, against a fake `vllm` module and local HTTP servers of both protocols
(tests/rollout/test_vllm_engine.py); vLLM itself and NCCL need a CUDA machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # the config's check imports this module: keep that import light
    from posttrain.rollout.generate import Rollout, SamplingConfig

VLLM_MODES = ("colocate", "server")
# the sampling fields of the legacy server's /generate/ request; it passes its generation_kwargs to SamplingParams
SERVER_REQUEST_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


# ---------------------------------------------------------------- availability (config time)

def vllm_installed() -> bool:
    return sys.modules.get("vllm") is not None or importlib.util.find_spec("vllm") is not None


def cuda_available() -> bool:
    return torch.cuda.is_available()


def check_vllm(mode: str, use_vllm: bool = True) -> None:
    """Raise a ValueError naming what is wrong: an unknown `mode`; with `use_vllm`, vLLM or a CUDA GPU missing."""
    if mode not in VLLM_MODES:
        raise ValueError(f"vllm_mode={mode!r} is unknown; choose one of {list(VLLM_MODES)}")
    if not use_vllm:
        return
    if not vllm_installed():
        raise ValueError("use_vllm=True, but vLLM is not installed: `pip install vllm` (it needs a CUDA GPU), or "
                         "set use_vllm=False to sample with posttrain's own sampler")
    if not cuda_available():
        raise ValueError("use_vllm=True, but no CUDA GPU is available: vLLM generates on a GPU (and its weight sync "
                         "uses NCCL); set use_vllm=False to sample with posttrain's own sampler")


# ---------------------------------------------------------------- what both modes share

def sampling_fields(sampling: SamplingConfig, extra: dict | None = None) -> dict:
    """The keywords of vLLM's `SamplingParams` (and of the servers' /v1/completions and /generate/ requests) for `sampling`;
    `extra`: generation_kwargs keys the built-in sampler does not know, passed on unchanged."""
    return {"n": sampling.num_generations, "temperature": sampling.temperature if sampling.do_sample else 0.0,
            "top_p": sampling.top_p, "top_k": sampling.top_k or -1, "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty, "max_tokens": sampling.max_new_tokens,
            "stop_token_ids": list(sampling.stop_token_ids), "stop": list(sampling.stop_strings),
            # the stop string stays in the completion, as posttrain's sampler keeps it
            "include_stop_str_in_output": True, **(extra or {})}


def to_rollout(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
               logprobs: Sequence[Sequence[float]], truncated: Sequence[bool], pad_token_id: int,
               eos_token_id) -> Rollout:
    """A `Rollout` from N completions (prompt-major; prompt_ids one per completion); `truncated`: no stop
    (EOS, stop token or stop string) ended the completion."""
    from posttrain.rollout.multiturn import rollout_from_func

    rollout, _ = rollout_from_func({"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs},
                                   len(completion_ids), pad_token_id, eos_token_id)
    rollout.is_truncated = torch.tensor([bool(t) for t in truncated])
    return rollout


def policy_weights(model) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, tensor) for each entry of the policy's state dict, as vLLM's `load_weights`
    reads a checkpoint. A PEFT model is merged for the duration (its base names, adapters left out);
    FSDP2 DTensors are gathered (`full_tensor`, every process must iterate); ZeRO-3 parameters are gathered
    one at a time and copied (every process must iterate)."""
    from posttrain.models.loading import is_peft_model, zero3_partitioned

    peft, zero3 = is_peft_model(model), zero3_partitioned(model)
    if peft:
        model.merge_adapter()
    try:
        if zero3:
            import deepspeed

            for name, param in model.named_parameters():
                with deepspeed.zero.GatheredParameters([param]):
                    clean = _hf_name(name, peft)
                    if clean is not None:  # a copy: the server engine keeps a chunk of tensors after they are yielded
                        yield clean, param.data.clone()
            return
        for name, tensor in model.state_dict().items():
            clean = _hf_name(name, peft)
            if clean is not None:
                yield clean, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    finally:
        if peft:
            model.unmerge_adapter()


def _hf_name(name: str, peft: bool) -> str | None:
    """The base model's name of a state-dict entry; None for what vLLM must not get (LoRA factors, the copy of
    a module PEFT trains separately)."""
    if not peft:
        return name
    if "lora_" in name or ".original_module." in name:
        return None
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return name.replace(".modules_to_save.default.", ".")


# LoRA ranks vLLM accepts as max_lora_rank
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank(policy) -> int:
    """The `max_lora_rank` vLLM needs for this policy's adapter (`vllm_sync_strategy="lora_adapter"`); a
    ValueError where the adapter cannot go to vLLM alone (no PEFT, not LoRA, DoRA, trained whole modules)."""
    from posttrain.models.loading import is_peft_model

    fix = "or set vllm_sync_strategy='weights' (the adapter merged into the weights sent)"
    if not is_peft_model(policy):
        raise ValueError(f"vllm_sync_strategy='lora_adapter' syncs a LoRA adapter, and this policy has none: give "
                         f"peft_config=LoraConfig(...), {fix}")
    config = policy.peft_config[policy.active_adapter]
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind != "LORA" or getattr(config, "use_dora", False):
        raise ValueError(f"vllm_sync_strategy='lora_adapter': vLLM loads plain LoRA adapters only, this one is "
                         f"{kind}{' with DoRA' if getattr(config, 'use_dora', False) else ''}; {fix}")
    if config.modules_to_save:
        raise ValueError(f"vllm_sync_strategy='lora_adapter': modules_to_save={config.modules_to_save} are trained "
                         f"whole, which a vLLM LoRA adapter cannot carry; {fix}")
    rank = max([config.r, *(config.rank_pattern or {}).values()])
    if rank > VLLM_LORA_RANKS[-1]:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}; {fix}")
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


class AdapterFolders:
    """Where each sync's adapter is saved (`vllm_sync_strategy="lora_adapter"`): a new folder per sync,
    `root/sync-K`, so vLLM never reads files being rewritten; the one before the previous is removed."""

    def __init__(self, root: str):
        self.root, self.count = os.path.abspath(root), 0

    def save(self, policy) -> tuple[str, int, str]:
        """(name, id >= 1, folder) of the adapter just saved (PEFT's adapter_config.json and weights)."""
        import shutil

        self.count += 1
        folder = os.path.join(self.root, f"sync-{self.count}")
        policy.save_pretrained(folder)  # a PeftModel saves its adapter only
        shutil.rmtree(os.path.join(self.root, f"sync-{self.count - 2}"), ignore_errors=True)
        return f"posttrain-policy-{self.count}", self.count, folder


# ---------------------------------------------------------------- colocate

class ColocateEngine:
    """vLLM in the training process (`vllm.LLM`). With several processes each runs its own engine under
    `external_launcher` (one engine per `vllm_tensor_parallel_size` processes, which then generate the prompts
    of all of them together); a single process uses the same in-process executor, so that weights are
    loaded by reference, never serialised."""

    def __init__(self, model: str, args, num_processes: int, process_index: int, pad_token_id: int, eos_token_id,
                 extra_sampling: dict | None = None, lora_rank: int | None = None, adapter_root: str | None = None):
        import vllm

        tp = args.vllm_tensor_parallel_size
        if num_processes % tp:
            raise ValueError(f"vllm_tensor_parallel_size={tp} must divide the number of processes ({num_processes})")
        self.tp, self.pad_token_id, self.eos_token_id = tp, pad_token_id, eos_token_id
        self.extra, self.sleeps, self.asleep = dict(extra_sampling or {}), args.vllm_enable_sleep_mode, False
        self.group = None
        if tp > 1:  # the processes of one tensor-parallel group generate one batch: their prompts, gathered
            self.group, _ = torch.distributed.new_subgroups(group_size=tp)
        if num_processes == 1:  # external_launcher reads the torch.distributed rendezvous from the environment
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "localhost")):
                os.environ.setdefault(key, value)
            if "MASTER_PORT" not in os.environ:
                with socket.socket() as probe:  # a free port
                    probe.bind(("localhost", 0))
                    os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
        max_len = args.vllm_max_model_length
        if max_len is None and args.max_prompt_length:
            max_len = args.max_prompt_length + args.max_completion_length
        # lora_rank: the policy's LoRA adapter goes to vLLM alone, as a LoRA request, each process its own folder
        lora = {} if lora_rank is None else {"enable_lora": True, "max_lora_rank": lora_rank, "max_loras": 1}
        self.adapters = None if lora_rank is None else AdapterFolders(os.path.join(adapter_root, f"process-{process_index}"))
        self.lora_request = None
        self.llm = vllm.LLM(model=model, tensor_parallel_size=tp, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                            enable_sleep_mode=args.vllm_enable_sleep_mode, model_impl=args.vllm_model_impl,
                            max_model_len=max_len, seed=args.seed + process_index // tp,
                            distributed_executor_backend="external_launcher",
                            # log-probs after temperature: the distribution the trainer's log-probs are taken under
                            logprobs_mode="processed_logprobs", **lora)
        self.SamplingParams = vllm.SamplingParams
        self._sleep()

    # Sleep mode: vLLM's weights go to CPU memory and its KV cache is freed while the policy trains; it wakes
    # for a weight sync (always followed by a generation) and sleeps again after the generation.
    def _sleep(self):
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def _wake(self):
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> Rollout:
        mine = len(prompt_ids)
        if self.group is not None:
            parts = [None] * self.tp
            torch.distributed.all_gather_object(parts, prompt_ids, group=self.group)
            offset = sum(map(len, parts[:torch.distributed.get_rank(self.group)]))
            prompt_ids = [ids for part in parts for ids in part]
        self._wake()
        params = self.SamplingParams(**sampling_fields(sampling, self.extra), logprobs=0)
        lora = {} if self.lora_request is None else {"lora_request": self.lora_request}
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], params, use_tqdm=False,
                                    **lora)
        self._sleep()
        if self.group is not None:
            outputs = outputs[offset:offset + mine]
        rows = [(list(out.prompt_token_ids), list(c.token_ids),
                 [lp[tok].logprob for lp, tok in zip(c.logprobs, c.token_ids)], c.finish_reason == "length")
                for out in outputs for c in out.outputs]
        return to_rollout(*zip(*rows), self.pad_token_id, self.eos_token_id)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy the policy's weights into vLLM's model, then drop the KV blocks computed with the old ones."""
        self._wake()
        for name, tensor in weights:  # one at a time: a ZeRO-3 parameter is whole only while it is yielded
            self.llm.apply_model(lambda model, item=(name, tensor): model.load_weights([item]))
        self.llm.reset_prefix_cache()

    def sync(self, policy, group=None) -> None:
        """The policy into vLLM: its weights, or (`vllm_sync_strategy="lora_adapter"`) its LoRA adapter alone,
        saved and named in the LoRA request of the generations that follow (a new id: vLLM loads it afresh,
        and its prefix cache keys blocks by adapter, so nothing computed with the old one is reused). `group`:
        unused here (each process syncs its own engine)."""
        if self.adapters is None:
            return self.load_weights(policy_weights(policy))
        from vllm.lora.request import LoRARequest

        self.lora_request = LoRARequest(*self.adapters.save(policy))


# ---------------------------------------------------------------- server: HTTP plumbing both protocols share

class ServerError(RuntimeError):
    """The vLLM server answered with an HTTP error (`code`: its status)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _http(base_url: str, path: str, payload: dict | None = None, method: str = "POST", timeout: float | None = 1800.0):
    """JSON over HTTP with the standard library; an error answer raises ServerError, a server silent for
    `timeout` seconds a TimeoutError naming the endpoint."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(f"{base_url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as e:
        raise ServerError(f"vLLM server {base_url}{path} answered {e.code}: "
                          f"{e.read().decode(errors='replace')[:500]}", e.code) from e
    except (TimeoutError, urllib.error.URLError) as e:
        if not isinstance(getattr(e, "reason", e), TimeoutError):
            raise
        raise TimeoutError(f"the vLLM server at {base_url} did not answer {method} {path} within "
                           f"vllm_request_timeout={timeout} s: it or one of its workers is stuck or gone") from e
    return json.loads(body) if body else {}


def _wait_for(base_url: str, path: str, timeout: float):
    """GET `path` until the server answers it (retrying while nothing listens, or it answers 5xx while it
    starts); its answer. A 4xx answer raises ServerError at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _http(base_url, path, method="GET", timeout=5.0)
        except ServerError as e:
            if e.code < 500:
                raise
            error = e
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            error = e
        if time.monotonic() >= deadline:
            raise ConnectionError(f"no vLLM server answered at {base_url}{path} within vllm_server_timeout={timeout} "
                                  "s; start one with `trl vllm-serve --model <the policy>` or set vllm_server_base_url "
                                  f"/ vllm_server_host / vllm_server_port ({error})") from error
        time.sleep(min(2.0, max(deadline - time.monotonic(), 0.0)))


def speaks_openai(base_url: str, timeout: float) -> bool:
    """Whether the server at `base_url` is vLLM's OpenAI-compatible server (it answers GET /v1/models), which
    TRL 1.x's `trl vllm-serve` runs, rather than the server of TRL 0.18-0.2x's `trl vllm-serve` (404 there).
    Waits up to `timeout` seconds for a server to answer at all."""
    try:
        _wait_for(base_url.rstrip("/"), "/v1/models", timeout)
        return True
    except ServerError as e:
        if e.code == 404:
            return False
        raise


class _Background:
    """fn(*args) in a daemon thread: an HTTP request that the server answers only once the NCCL transfer it waits
    for is done, so this process must run its side of the transfer meanwhile; or a transfer watched by a
    deadline. `result(timeout, what)` waits (at most `timeout` seconds, then a TimeoutError naming `what`)
    and re-raises."""

    def __init__(self, fn, *args):
        self._out: dict = {}
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args):
        try:
            self._out["value"] = fn(*args)
        except BaseException as e:  # re-raised in the caller's thread by result()
            self._out["error"] = e

    def result(self, timeout: float | None = None, what: str = "a call to vLLM"):
        self._thread.join(timeout)
        if self._thread.is_alive():  # left running: a thread blocked in NCCL or a socket cannot be stopped
            raise TimeoutError(f"{what} did not finish within vllm_request_timeout={timeout} s: the vLLM server or "
                               "one of its workers is stuck or gone (nothing is retried; restart the server)")
        if "error" in self._out:
            raise self._out["error"]
        return self._out.get("value")


class _ServerClient:
    """What both server protocols share: the URL, the health check, which process sends weights, and the
    communicator that carries them.

    communicator_factory(host, port, rank, world_size, device) -> an object with `broadcast(tensor, src)` (and,
    for the legacy protocol, `group.barrier()`); by default vLLM's `PyNcclCommunicator` on a
    `StatelessProcessGroup` (`nccl_communicator`; needs CUDA)."""

    health_path = "/health"

    def __init__(self, base_url: str, timeout: float, group_port: int, pad_token_id: int, eos_token_id,
                 is_main: bool = True, device=None, extra_sampling: dict | None = None, communicator_factory=None,
                 request_timeout: float | None = 1800.0):
        self.base_url, self.group_port, self.device = base_url.rstrip("/"), group_port, device
        self.request_timeout = request_timeout  # the deadline of every request, group join and transfer
        self.pad_token_id, self.eos_token_id, self.is_main = pad_token_id, eos_token_id, is_main
        self.extra, self.communicator_factory = dict(extra_sampling or {}), communicator_factory or nccl_communicator
        self.communicator = None
        self.adapters, self.adapter_name = None, None  # vllm_sync_strategy="lora_adapter" (ServerEngine)
        self.wait_until_healthy(timeout)

    def _request(self, path: str, payload: dict | None = None, method: str = "POST", timeout: float | None = None):
        return _http(self.base_url, path, payload, method, timeout or self.request_timeout)

    def _within(self, what: str, fn, *args):
        """fn(*args) under the deadline (NCCL calls and joins block without one of their own)."""
        return _Background(fn, *args).result(self.request_timeout, what)

    def _broadcast(self, tensors: list[Tensor], src: int, barrier: bool = False) -> None:
        for tensor in tensors:  # NCCL sends numel elements from data_ptr(): a view must be made contiguous
            tensor = tensor.contiguous()
            self.communicator.broadcast(tensor, src=src)
            if tensor.is_cuda:  # NCCL returns once the transfer is queued: wait for it here, under the deadline
                torch.cuda.current_stream(tensor.device).synchronize()
        if barrier:
            self.communicator.group.barrier()

    def wait_until_healthy(self, timeout: float) -> None:
        _wait_for(self.base_url, self.health_path, timeout)

    def sync(self, policy, group=None) -> None:
        """The policy to the server: every weight, or (`vllm_sync_strategy="lora_adapter"`, ServerEngine) its
        LoRA adapter alone (`load_adapter`). `group`: the process group of the adapter name's broadcast (None:
        the default one; the asynchronous sampler's thread passes its own)."""
        if self.adapters is None:
            return self.load_weights(policy_weights(policy))
        self.load_adapter(policy, group)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Send every weight (main process only; the others must still iterate `weights`, which may gather
        sharded parameters collectively), then reset the server's prefix cache."""
        if not self.is_main:
            for _ in weights:
                pass
            return
        self._send_weights(weights)


# ---------------------------------------------------------------- server: vLLM's own server (TRL 1.x)

# the most bytes of tensors announced by one /update_weights request (and held at once while they are sent)
WEIGHT_CHUNK_BYTES = 256 << 20


class ServerEngine(_ServerClient):
    """A client of vLLM's OpenAI-compatible server with its development endpoints, as TRL 1.x's `trl vllm-serve`
    runs it (`VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "nccl"}'
    --logprobs-mode processed_logprobs`).

    Generation: every process sends its own prompts, as token ids, in one POST /v1/completions with
    `logprobs=0` (the sampled token's log-prob) and `return_token_ids`; the answer's choices are prompt-major
    (choice `index` = prompt * n + sample) and `finish_reason == "length"` marks a truncated completion.

    Weights, over vLLM's weight-transfer engine: once, /init_weight_transfer_engine opens an NCCL group in which
    this (main) process is rank 0 and the server's W workers are ranks 1..W (`rank_offset` 1). Each sync is
    /start_weight_update, then per chunk of tensors (up to `weight_chunk_bytes`) one /update_weights announcing
    their names, dtypes and shapes, answered once the tensors, broadcast one by one from rank 0 meanwhile, are
    loaded; then /finish_weight_update and /reset_prefix_cache. The tensors go unpacked (no `packed` field is
    sent), which every vLLM with these endpoints reads the same way."""

    def __init__(self, *args, weight_chunk_bytes: int = WEIGHT_CHUNK_BYTES, adapter_root: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunk_bytes = weight_chunk_bytes
        self.model = self._request("/v1/models", method="GET")["data"][0]["id"]
        self.adapters = None if adapter_root is None else AdapterFolders(adapter_root)

    def load_adapter(self, policy, group=None) -> None:
        """`vllm_sync_strategy="lora_adapter"`: the main process saves the policy's LoRA adapter (a new folder
        each time, which the server must see), POST /v1/load_lora_adapter loads it under a new name, generations
        name it as their model, and the previous adapter is unloaded. Every process then generates with it."""
        names = [None]
        if self.is_main:
            name, _, folder = self.adapters.save(policy)
            self._request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": folder})
            if self.adapter_name is not None:
                self._request("/v1/unload_lora_adapter", {"lora_name": self.adapter_name})
            names = [name]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(names, src=0, group=group)  # the other processes use it too
        self.adapter_name = names[0]

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> Rollout:
        n = sampling.num_generations
        request = {"model": self.adapter_name or self.model, "prompt": [list(ids) for ids in prompt_ids],
                   **sampling_fields(sampling, self.extra), "logprobs": 0, "return_token_ids": True}
        choices = sorted(self._request("/v1/completions", request)["choices"], key=lambda c: c["index"])
        if len(choices) != n * len(prompt_ids):
            raise RuntimeError(f"the vLLM server returned {len(choices)} completions for {len(prompt_ids)} prompts x "
                               f"n={n}")
        rows = []
        for i, choice in enumerate(choices):
            if choice.get("token_ids") is None or not choice.get("logprobs"):
                raise RuntimeError("the vLLM server's /v1/completions answer has no token_ids or logprobs: posttrain "
                                   "needs a vLLM whose OpenAI server honours return_token_ids and logprobs")
            rows.append((choice.get("prompt_token_ids") or prompt_ids[i // n], choice["token_ids"],
                         choice["logprobs"]["token_logprobs"], choice["finish_reason"] == "length"))
        return to_rollout(*zip(*rows), self.pad_token_id, self.eos_token_id)

    def init_weight_transfer(self) -> None:
        """Check that the server can take weights, then open the NCCL group with its workers."""
        try:
            config = self._request("/server_info?config_format=json", method="GET").get("vllm_config") or {}
        except ServerError as e:
            if e.code != 404:
                raise
            raise RuntimeError(f"the vLLM server at {self.base_url} does not expose its development endpoints, which "
                               "the weight sync uses: start it with VLLM_SERVER_DEV_MODE=1 in its environment (`trl "
                               "vllm-serve` does)") from e
        if config.get("weight_transfer_config") is None:
            raise RuntimeError(f"the vLLM server at {self.base_url} has no weight-transfer engine: start it with "
                               """--weight-transfer-config '{"backend": "nccl"}' (`trl vllm-serve` does)""")
        model_config = config.get("model_config")
        mode = model_config.get("logprobs_mode") if isinstance(model_config, dict) else None
        if mode not in (None, "processed_logprobs"):
            warnings.warn(f"the vLLM server returns {mode!r} log-probs; the importance-sampling correction expects "
                          "them after temperature: start it with --logprobs-mode processed_logprobs", stacklevel=2)
        world_size = int(self._request("/get_world_size", method="GET")["world_size"]) + 1
        init_info = {"master_address": local_address(urllib.parse.urlparse(self.base_url).hostname),
                     "master_port": self.group_port, "rank_offset": 1, "world_size": world_size}
        # the server answers once its workers have joined the group, so this process joins meanwhile
        answer = _Background(self._request, "/init_weight_transfer_engine", {"init_info": init_info})
        self.communicator = self._within(
            f"joining the NCCL weight-transfer group at {init_info['master_address']}:{self.group_port} with the "
            "server's workers", self.communicator_factory, init_info["master_address"], self.group_port, 0,
            world_size, self.device)
        answer.result(self.request_timeout, f"POST {self.base_url}/init_weight_transfer_engine")

    def _send_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        if self.communicator is None:
            self.init_weight_transfer()
        self._request("/start_weight_update", {})
        chunk, size = [], 0
        for name, tensor in weights:
            chunk.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.chunk_bytes:
                self._send_chunk(chunk)
                chunk, size = [], 0
        if chunk:
            self._send_chunk(chunk)
        self._request("/finish_weight_update", {})
        self._request("/reset_prefix_cache")

    def _send_chunk(self, chunk: list[tuple[str, Tensor]]) -> None:
        update_info = {"names": [name for name, _ in chunk],
                       "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
                       "shapes": [list(t.shape) for _, t in chunk]}
        answer = _Background(self._request, "/update_weights", {"update_info": update_info})
        self._within(f"broadcasting {len(chunk)} weights ({chunk[0][0]} ...) to the server's workers",
                     self._broadcast, [t for _, t in chunk], 0)
        answer.result(self.request_timeout, f"POST {self.base_url}/update_weights")

    def close(self) -> None:
        """Drop the weight-transfer group (the protocol has no endpoint to close it)."""
        self.communicator = None


def local_address(host: str | None) -> str:
    """This machine's address on the route to `host`: where the server's workers reach the NCCL group's store."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host or "127.0.0.1", 9))  # UDP: picks the route, sends nothing
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


# ---------------------------------------------------------------- server: TRL 0.18-0.2x's own server (legacy)

class LegacyServerEngine(_ServerClient):
    """A client of the server that `trl vllm-serve` ran up to TRL 0.2x (`/health/`, `/get_world_size/`,
    `/generate/`, `/init_communicator/`, `/update_named_param/`, `/reset_prefix_cache/`, `/close_communicator/`),
    used when the server does not answer GET /v1/models. Every process sends its own prompts to /generate/;
    only the main process sends weights: for each tensor, /update_named_param/ announces its name, dtype and
    shape, then the tensor is broadcast from this process's rank (the last: the server's workers are ranks
    0 .. W - 1) over the communicator, and a barrier waits for the server's workers to have loaded it."""

    health_path = "/health/"

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> Rollout:
        fields = sampling_fields(sampling, self.extra)
        # the request has fields of its own for these; the rest (stops, generation_kwargs) go as generation_kwargs
        request = {key: fields.pop(key) for key in SERVER_REQUEST_FIELDS}
        out = self._request("/generate/", {"prompts": [list(ids) for ids in prompt_ids], **request,
                                           "generation_kwargs": fields})
        n, completions = sampling.num_generations, out["completion_ids"]
        if len(completions) != n * len(prompt_ids):
            raise RuntimeError(f"the vLLM server returned {len(completions)} completions for {len(prompt_ids)} "
                               f"prompts x n={n}")
        prompts = out.get("prompt_ids") or prompt_ids
        if len(prompts) == len(prompt_ids):  # one per prompt: repeat for its completions
            prompts = [p for p in prompts for _ in range(n)]
        # one log-prob per token, or per token a list whose first entry is the sampled token's
        logprobs = [[lp[0] if isinstance(lp, list) else lp for lp in row] for row in out["logprobs"]]
        stops = {self.eos_token_id} if isinstance(self.eos_token_id, int) else set(self.eos_token_id or ())
        stops |= set(sampling.stop_token_ids)
        # the protocol has no finish reason: a completion that stopped early, or on a stop token, was not cut
        truncated = [len(c) >= sampling.max_new_tokens and c[-1] not in stops for c in completions]
        return to_rollout(prompts, completions, logprobs, truncated, self.pad_token_id, self.eos_token_id)

    def init_communicator(self) -> None:
        try:
            world = int(self._request("/get_world_size/", method="GET")["world_size"])
        except ServerError:  # TRL 0.17's server, one worker per tensor-parallel rank, says only this
            world = int(self._request("/get_tensor_parallel_size/", method="GET")["tensor_parallel_size"])
        self.rank, world_size = world, world + 1  # the server's workers are ranks 0 .. world - 1
        payload = {"host": "0.0.0.0", "port": self.group_port, "world_size": world_size}
        if self.device is not None and torch.device(self.device).type == "cuda":
            payload["client_device_uuid"] = str(torch.cuda.get_device_properties(self.device).uuid)
        self._request("/init_communicator/", payload)
        host = urllib.parse.urlparse(self.base_url).hostname
        self.communicator = self._within(f"joining the NCCL weight-update group at {host}:{self.group_port} with the "
                                         "server's workers", self.communicator_factory, host, self.group_port,
                                         self.rank, world_size, self.device)

    def _send_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        if self.communicator is None:
            self.init_communicator()
        for name, tensor in weights:
            self._request("/update_named_param/", {"name": name, "dtype": str(tensor.dtype),
                                                   "shape": list(tensor.shape)})
            self._within(f"broadcasting {name} to the server's workers", self._broadcast, [tensor], self.rank, True)
        self._request("/reset_prefix_cache/")

    def close(self) -> None:
        """Ask the server to drop the weight-update group (at exit; a server already gone is let be)."""
        if self.communicator is not None:
            self.communicator = None
            try:
                self._request("/close_communicator/", timeout=10.0)
            except (OSError, RuntimeError):
                pass


def nccl_communicator(host: str, port: int, rank: int, world_size: int, device):
    """vLLM's NCCL communicator between this process and the server's workers (needs CUDA and vLLM); the group's
    store listens at host:port on rank 0's machine."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(group, device=device)


def make_engine(args, model_name: str, accelerator, pad_token_id: int, eos_token_id, extra_sampling: dict | None = None,
                policy=None):
    """The engine `use_vllm=True` asks for (`vllm_mode`); in server mode, the client of the protocol the server
    speaks (`speaks_openai`). `policy`: checked for `vllm_sync_strategy="lora_adapter"` (`lora_rank`)."""
    rank = adapter_root = None
    if getattr(args, "vllm_sync_strategy", "weights") == "lora_adapter":
        from posttrain.models.loading import shards_weights

        rank, adapter_root = lora_rank(policy), os.path.join(args.output_dir, "vllm_adapter")
        if shards_weights(accelerator):
            raise ValueError("vllm_sync_strategy='lora_adapter' saves the adapter from each process's whole copy; "
                             "with ZeRO-3 / FSDP sharded weights use vllm_sync_strategy='weights'")
    if args.vllm_mode == "colocate":
        if not model_name:
            raise ValueError("vllm_mode='colocate' loads the policy into vLLM from its name or path, and this policy "
                             "has none (config._name_or_path); save it and pass the path, or use vllm_mode='server'")
        from posttrain.models.loading import resolve

        return ColocateEngine(resolve(model_name), args, accelerator.num_processes, accelerator.process_index, pad_token_id,
                              eos_token_id, extra_sampling, lora_rank=rank, adapter_root=adapter_root)
    base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
    openai = speaks_openai(base_url, args.vllm_server_timeout)
    if rank is not None and not openai:
        raise ValueError(f"vllm_sync_strategy='lora_adapter' loads adapters through vLLM's /v1/load_lora_adapter; the "
                         f"server at {base_url} is TRL 0.2x's `trl vllm-serve`, which has no such endpoint: run vLLM's "
                         "server (`vllm serve --enable-lora`) or use vllm_sync_strategy='weights'")
    common = dict(is_main=accelerator.is_main_process, device=accelerator.device, extra_sampling=extra_sampling,
                  request_timeout=getattr(args, "vllm_request_timeout", 1800.0))
    if openai:
        engine = ServerEngine(base_url, args.vllm_server_timeout, args.vllm_group_port, pad_token_id, eos_token_id,
                              adapter_root=adapter_root, **common)
    else:
        engine = LegacyServerEngine(base_url, args.vllm_server_timeout, args.vllm_group_port, pad_token_id,
                                    eos_token_id, **common)
    import atexit

    atexit.register(engine.close)
    return engine
