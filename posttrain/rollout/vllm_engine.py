"""Generation with vLLM for the online trainers (`use_vllm=True`), in TRL's two modes.

vLLM samples whole completions, so it does not fit the sampler's per-token `SamplerBackend`
interface (docs/sampler.md): it stands where a `rollout_func` stands, taking each process's prompt
ids and returning `num_generations` completions per prompt, prompt-major, with each sampled
token's log-prob, as a `Rollout` (`to_rollout`).

- `ColocateEngine` (`vllm_mode="colocate"`): a `vllm.LLM` in the training process, sharing its GPU
  (`vllm_gpu_memory_utilization`). Weights are loaded into it by reference through
  `LLM.apply_model(model.load_weights)`, then its prefix cache is reset.
- `ServerEngine` (`vllm_mode="server"`): a client of the HTTP server that TRL's `trl vllm-serve`
  ran up to TRL 0.2x (`/health/`, `/get_world_size/`, `/generate/`, `/init_communicator/`,
  `/update_named_param/`, `/reset_prefix_cache/`, `/close_communicator/`). Each weight is announced
  over HTTP and then broadcast from this process over vLLM's NCCL communicator
  (`PyNcclCommunicator` on a `StatelessProcessGroup`), in which this process is the last rank.

What is synced and when: the trainer calls `load_weights(policy_weights(policy))` before a generation
whenever an optimizer step has happened since the last one (and before the first): every tensor of
the policy's state dict under its Hugging Face name, PEFT adapters merged in, sharded weights
gathered. vLLM's log-probs are not the trainer's (other kernels, maybe another dtype): the trainer
recomputes the behaviour log-probs with the policy where they are used and weights each token's
policy loss by `truncated_importance_weights` (TRL's `vllm_importance_sampling_correction`).

Only the plumbing is tested here, against a fake `vllm` module and a local HTTP server
(tests/rollout/test_vllm_engine.py); vLLM itself and NCCL need a CUDA machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # the config's check imports this module: keep that import light
    from posttrain.rollout.generate import Rollout, SamplingConfig

VLLM_MODES = ("colocate", "server")
# the sampling fields of the server's /generate/ request; it passes its generation_kwargs to SamplingParams
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
    """The keywords of vLLM's `SamplingParams` (and of the server's /generate/ request) for `sampling`;
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


def truncated_importance_weights(old_logp: Tensor, vllm_logp: Tensor, cap: float) -> Tensor:
    """min(pi_old / pi_vllm, cap) per token (B, T): the weight of each token's policy loss that corrects
    for sampling with vLLM's numbers instead of the policy's (truncated importance sampling; TRL's
    `token_truncate`). No gradient flows through it."""
    return torch.exp(old_logp.detach() - vllm_logp).clamp(max=cap)


def policy_weights(model) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, tensor) for each entry of the policy's state dict, as vLLM's `load_weights`
    reads a checkpoint. A PEFT model is merged for the duration (its base names, adapters left out);
    FSDP2 DTensors are gathered (`full_tensor`, every process must iterate); ZeRO-3 parameters are gathered
    one at a time (every process must iterate)."""
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
                    if clean is not None:
                        yield clean, param.data
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


# ---------------------------------------------------------------- colocate

class ColocateEngine:
    """vLLM in the training process (`vllm.LLM`). With several processes each runs its own engine under
    `external_launcher` (one engine per `vllm_tensor_parallel_size` processes, which then generate the prompts
    of all of them together); a single process uses the same in-process executor, so that weights are
    loaded by reference, never serialised."""

    def __init__(self, model: str, args, num_processes: int, process_index: int, pad_token_id: int, eos_token_id,
                 extra_sampling: dict | None = None):
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
        self.llm = vllm.LLM(model=model, tensor_parallel_size=tp, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                            enable_sleep_mode=args.vllm_enable_sleep_mode, model_impl=args.vllm_model_impl,
                            max_model_len=max_len, seed=args.seed + process_index // tp,
                            distributed_executor_backend="external_launcher",
                            # log-probs after temperature: the distribution the trainer's log-probs are taken under
                            logprobs_mode="processed_logprobs")
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
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], params, use_tqdm=False)
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


# ---------------------------------------------------------------- server

class ServerEngine:
    """A client of the `trl vllm-serve` server (TRL 0.2x's HTTP protocol). Every process sends its own prompts
    to /generate/; only the main process (`is_main`) sends weights: for each tensor, /update_named_param/
    announces its name, dtype and shape, then the tensor is broadcast from this process's rank over the
    communicator, and a barrier waits for the server's workers to have loaded it.

    communicator_factory(host, port, rank, world_size, device) -> an object with `broadcast(tensor, src)` and
    `group.barrier()`; by default vLLM's `PyNcclCommunicator` on a `StatelessProcessGroup` (needs CUDA)."""

    def __init__(self, base_url: str, timeout: float, group_port: int, pad_token_id: int, eos_token_id,
                 is_main: bool = True, device=None, extra_sampling: dict | None = None, communicator_factory=None):
        self.base_url, self.group_port, self.device = base_url.rstrip("/"), group_port, device
        self.pad_token_id, self.eos_token_id, self.is_main = pad_token_id, eos_token_id, is_main
        self.extra, self.communicator_factory = dict(extra_sampling or {}), communicator_factory or nccl_communicator
        self.communicator, self.rank = None, None
        self.wait_until_healthy(timeout)

    def _request(self, path: str, payload: dict | None = None, method: str = "POST", timeout: float = 600.0):
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(f"{self.base_url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"vLLM server {self.base_url}{path} answered {e.code}: "
                               f"{e.read().decode(errors='replace')[:500]}") from e
        return json.loads(body) if body else {}

    def wait_until_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._request("/health/", method="GET", timeout=5.0)
                return
            except (urllib.error.URLError, ConnectionError, OSError) as e:
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"no vLLM server answered at {self.base_url}/health/ within "
                                          f"vllm_server_timeout={timeout} s; start one with `trl vllm-serve --model "
                                          "<the policy>` or set vllm_server_base_url / vllm_server_host / "
                                          f"vllm_server_port ({e})") from e
                time.sleep(min(2.0, max(deadline - time.monotonic(), 0.0)))

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
        except RuntimeError:  # TRL 0.17's server, one worker per tensor-parallel rank, says only this
            world = int(self._request("/get_tensor_parallel_size/", method="GET")["tensor_parallel_size"])
        self.rank, world_size = world, world + 1  # the server's workers are ranks 0 .. world - 1
        payload = {"host": "0.0.0.0", "port": self.group_port, "world_size": world_size}
        if self.device is not None and torch.device(self.device).type == "cuda":
            payload["client_device_uuid"] = str(torch.cuda.get_device_properties(self.device).uuid)
        self._request("/init_communicator/", payload)
        host = urllib.parse.urlparse(self.base_url).hostname
        self.communicator = self.communicator_factory(host, self.group_port, self.rank, world_size, self.device)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Send every weight (main process only; the others must still iterate `weights`, which may gather
        sharded parameters collectively), then reset the server's prefix cache."""
        if not self.is_main:
            for _ in weights:
                pass
            return
        if self.communicator is None:
            self.init_communicator()
        for name, tensor in weights:
            self._request("/update_named_param/", {"name": name, "dtype": str(tensor.dtype),
                                                   "shape": list(tensor.shape)})
            self.communicator.broadcast(tensor, src=self.rank)
            self.communicator.group.barrier()
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
    """vLLM's NCCL communicator between this process and the server's workers (needs CUDA and vLLM)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(group, device=device)


def make_engine(args, model_name: str, accelerator, pad_token_id: int, eos_token_id, extra_sampling: dict | None = None):
    """The engine `use_vllm=True` asks for (`vllm_mode`)."""
    if args.vllm_mode == "colocate":
        if not model_name:
            raise ValueError("vllm_mode='colocate' loads the policy into vLLM from its name or path, and this policy "
                             "has none (config._name_or_path); save it and pass the path, or use vllm_mode='server'")
        from posttrain.models.loading import resolve

        return ColocateEngine(resolve(model_name), args, accelerator.num_processes, accelerator.process_index, pad_token_id,
                              eos_token_id, extra_sampling)
    base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
    engine = ServerEngine(base_url, args.vllm_server_timeout, args.vllm_group_port, pad_token_id, eos_token_id,
                          is_main=accelerator.is_main_process, device=accelerator.device, extra_sampling=extra_sampling)
    import atexit

    atexit.register(engine.close)
    return engine
