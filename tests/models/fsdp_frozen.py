"""A frozen reference model sharded by `loading.prepare_frozen` under FSDP2, run by test_frozen_sharding.py under
torchrun (2 CPU processes, gloo): each process keeps half of every weight and the forward gives the whole
model's logits. accelerate runs no FSDP on the CPU, so the accelerator is a stand-in that says FSDP2."""

import json
import sys
import types

import torch
import torch.distributed as dist

from posttrain.models.loading import frozen_copy, load_causal_lm, prepare_frozen


def main(out_path: str):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    whole = load_causal_lm("posttrain/tiny-qwen2")
    accelerator = types.SimpleNamespace(is_fsdp2=True, distributed_type="FSDP", state=types.SimpleNamespace())
    ref = prepare_frozen(accelerator, frozen_copy(whole))
    ids = torch.tensor([[3, 8, 15, 4, 9, 22, 7], [5, 5, 11, 2, 30, 1, 6]]) + rank  # each rank its own rows
    with torch.no_grad():
        expected, got = whole(input_ids=ids).logits, ref(input_ids=ids).logits
    weight = ref.get_input_embeddings().weight
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"max_diff": (got - expected).abs().max().item(), "dtensor": type(weight).__name__ == "DTensor",
                   "local_rows": weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0],
                   "rows": whole.get_input_embeddings().weight.shape[0],
                   "frozen": not any(p.requires_grad for p in ref.parameters()), "training": ref.training}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
