"""loading.prepare_frozen: a frozen model (a reference policy) is placed for the engine the policy trains under.
FSDP2 shards it with fully_shard (2 CPU processes under torchrun); without an engine accelerate places it.
(ZeRO-3's inference engine is tested in tests/trainers/test_deepspeed.py.)"""

import json
import os
import sys

import torch
from tests.helpers.launch import free_port, run_launch

from posttrain.models.loading import frozen_copy, load_causal_lm, prepare_frozen

SCRIPT = os.path.join(os.path.dirname(__file__), "fsdp_frozen.py")


def test_fsdp2_shards_the_frozen_model_and_its_forward_is_the_whole_models(tmp_path):
    out = str(tmp_path / "frozen.json")
    run_launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), SCRIPT, out], tmp_path)
    ranks = [json.load(open(f"{out}.{rank}")) for rank in (0, 1)]
    for r in ranks:
        assert r["dtensor"] and r["frozen"] and not r["training"]
        assert r["local_rows"] == r["rows"] // 2  # each process holds half of the embedding
        assert r["max_diff"] < 1e-5  # the sharded forward is the whole model's


def test_without_an_engine_accelerate_places_the_frozen_model():
    from accelerate import Accelerator

    model = load_causal_lm("posttrain/tiny-qwen2")
    ref = prepare_frozen(Accelerator(cpu=True), frozen_copy(model))
    assert ref is not model and not any(p.requires_grad for p in ref.parameters()) and not ref.training
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
