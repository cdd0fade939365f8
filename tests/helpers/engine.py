"""A stand-in for vLLM in learning runs on the CPU (`use_vllm=True` without vLLM or a GPU): posttrain's sampler
on a copy of the policy whose weights each sync rounds to a lower precision, as an inference engine holding them
in bf16 or fp8 computes with them, so the behaviour log-probs differ from the float32 trainer's and the
importance-sampling correction (`vllm_importance_sampling_mode`) has something to correct. Used by
tests/trainers/test_learning_modes.py and benchmarks/learning_modes.py."""

import copy

import torch


def rounded(tensor: torch.Tensor, precision: str) -> torch.Tensor:
    """`tensor` as an engine holding it in `precision` computes with it: "bf16", or "fp8" (e4m3, one scale per
    tensor, as fp8 rollouts in verl and slime)."""
    if precision == "bf16":
        return tensor.to(torch.bfloat16).float()
    scale = tensor.abs().max().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    return (tensor / scale).to(torch.float8_e4m3fn).float() * scale


class RoundedEngine:
    """The engine surface the trainer uses (`sync(policy, group=None)`, `generate(prompt_ids, sampling)`)."""

    def __init__(self, policy, pad_token_id: int, eos_token_id, seed: int, precision: str = "bf16"):
        self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        self.pad_token_id, self.eos_token_id, self.precision = pad_token_id, eos_token_id, precision
        self.generator = torch.Generator().manual_seed(seed)
        self.syncs = 0

    def sync(self, policy, group=None):
        from posttrain.rollout.vllm_engine import policy_weights

        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in policy_weights(policy):
                state[name].copy_(rounded(tensor, self.precision))
        self.syncs += 1

    def generate(self, prompt_ids, sampling):
        from posttrain.rollout.generate import generate

        return generate(self.model, prompt_ids, sampling, pad_token_id=self.pad_token_id,
                        eos_token_id=self.eos_token_id, generator=self.generator)


def engine_patches(seed: int, precision: str = "bf16") -> dict:
    """The attributes of posttrain.rollout.vllm_engine to set so that `use_vllm=True` builds a RoundedEngine
    (the config's vLLM and GPU checks passing): {name: value}, for monkeypatch.setattr or setattr."""
    return {"vllm_installed": lambda: True, "cuda_available": lambda: True,
            "make_engine": lambda args, name, accelerator, pad, eos, extra=None, policy=None: RoundedEngine(
                policy, pad, eos, seed, precision)}
