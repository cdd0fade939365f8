"""`keep_freed_memory`: in a training-like loop that makes and frees the same large tensors every
step, the later steps reuse the heap instead of faulting in fresh pages from the OS (checked by
counting minor page faults, in fresh processes)."""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = """
import resource, sys, torch
if sys.argv[1] in ("keep", "switched off"):
    from posttrain.accel.memory import keep_freed_memory
    assert keep_freed_memory() == (sys.argv[1] == "keep")
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for step in range(12):
    before = faults()
    x = torch.ones(32 * 2**20)  # 128 MiB
    y = x * 2
    loss = float(y.sum())
    del x, y
    counts.append(faults() - before)
print(sum(counts[4:]) // 8)  # page faults per step once warm
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_freed_blocks_are_reused_without_page_faults():
    faults = {}
    for mode in ("default", "keep", "switched off"):
        env = {**os.environ, "POSTTRAIN_KEEP_FREED_MEMORY": "0" if mode == "switched off" else "1"}
        out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True, env=env)
        faults[mode] = int(out.stdout.strip().splitlines()[-1])
    pages = 2 * 128 * 2**20 // 4096  # two 128 MiB tensors a step
    assert faults["default"] > pages // 2, faults  # glibc mapped both afresh: a fault per page (or huge page)
    # the freed heap memory was reused (most steps fault nothing; now and then a block that a small
    # allocation split has to be extended)
    assert faults["keep"] < faults["default"] // 3, faults
    # POSTTRAIN_KEEP_FREED_MEMORY=0: malloc untouched, glibc maps and unmaps as by default
    assert faults["switched off"] > pages // 2, faults


# ------------------------------------------------------------------ Adam state made before the first step


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _step(model, optimizer, seed):
    torch.manual_seed(seed)
    model(torch.randn(4, 6)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("kind", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),  # L2 decay: the priming step fills the moments
    lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True),
    lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
])
def test_adam_state_made_up_front_changes_nothing(kind):
    from posttrain.accel.memory import make_adam_state

    lazy_model, eager_model = _model(), _model()
    lazy, eager = kind(lazy_model.parameters()), kind(eager_model.parameters())
    before = [p.detach().clone() for p in eager_model.parameters()]
    assert make_adam_state(eager)
    assert all(torch.equal(a, b) for a, b in zip(before, eager_model.parameters()))  # no parameter moved
    assert all(p.grad is None for p in eager_model.parameters())
    assert [g["lr"] for g in eager.param_groups] == [1e-2]
    for state in eager.state.values():
        assert float(state["step"]) == 0
        assert all(not v.any() for k, v in state.items() if k != "step")
        assert state["exp_avg"].data_ptr() != 0
    assert len(eager.state) == len(list(eager_model.parameters()))
    for seed in range(3):  # then training is exactly what lazy initialisation gives
        _step(lazy_model, lazy, seed)
        _step(eager_model, eager, seed)
    assert all(torch.equal(a, b) for a, b in zip(lazy_model.parameters(), eager_model.parameters()))
    assert all(torch.equal(lazy.state[a]["exp_avg_sq"], eager.state[b]["exp_avg_sq"])
               for a, b in zip(lazy_model.parameters(), eager_model.parameters()))


def test_adam_state_is_left_alone_elsewhere():
    from posttrain.accel.memory import make_adam_state

    model = _model()
    assert not make_adam_state(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    adam = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, adam, 0)
    steps = [float(s["step"]) for s in adam.state.values()]
    assert not make_adam_state(adam)  # already has state: untouched
    assert [float(s["step"]) for s in adam.state.values()] == steps


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
@pytest.mark.parametrize("keep", [True, False])
def test_trainer_makes_the_adam_state_when_it_keeps_freed_memory(tmp_path, keep):
    from datasets import Dataset

    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, disable_tqdm=True, keep_freed_memory=keep,
                     use_cpu=True, report_to="none")
    trainer = SFTTrainer("posttrain/tiny-qwen2", args=args, train_dataset=Dataset.from_list([{"text": "a b c"}] * 4))
    optimizer = trainer.create_optimizer()
    assert bool(optimizer.state) == keep
    if keep:
        assert all(float(s["step"]) == 0 for s in optimizer.state.values())


def _in_file_mappings(tensors) -> list[bool]:
    """Whether each tensor's first byte lies in a mapping of a file (/proc/self/maps)."""
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return [any(s <= t.data_ptr() < e for s, e in ranges) for t in tensors]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_file_backed_parameters_are_copied_once_keeping_identity_values_and_ties():
    from transformers import AutoModelForCausalLM

    from posttrain.accel.memory import own_file_backed
    from posttrain.models.tiny import tiny_model_path

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("tiny-qwen2"))
    params = list(model.parameters())
    assert all(_in_file_mappings(params))  # safetensors maps the checkpoint: what the copy is for
    shared = torch.nn.Parameter(params[1].data[:2])  # a second parameter viewing another's storage
    before = [p.detach().clone() for p in params]
    ids = [id(p) for p in params]
    assert own_file_backed(params + [shared, params[0]]) == len(params) + 1  # params[0] twice: copied once
    assert not any(_in_file_mappings(params + [shared]))
    assert [id(p) for p in model.parameters()] == ids
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert shared.untyped_storage().data_ptr() == params[1].untyped_storage().data_ptr()  # still one storage
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # tied as before
    assert own_file_backed(params) == 0  # in the process's memory now: nothing to do


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_trainer_copies_its_trained_weights_out_of_the_checkpoint_file(tmp_path):
    from datasets import Dataset

    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), max_steps=1, disable_tqdm=True, use_cpu=True, report_to="none",
                     keep_freed_memory=False)
    trainer = SFTTrainer("posttrain/tiny-qwen2", args=args, train_dataset=Dataset.from_list([{"text": "a b c"}] * 4))
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert any(_in_file_mappings(trained))
    trainer.create_optimizer()
    assert not any(_in_file_mappings(trained))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_frozen_copy_takes_over_the_file_mapping():
    """frozen_copy: the reference keeps the checkpoint's pages, the trained model takes the deep copy's."""
    from transformers import AutoModelForCausalLM

    from posttrain.accel.memory import own_file_backed
    from posttrain.models.loading import frozen_copy
    from posttrain.models.tiny import tiny_model_path

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path("tiny-qwen2"))
    params = list(model.parameters())
    ids, before = [id(p) for p in params], [p.detach().clone() for p in params]
    assert all(_in_file_mappings(params))
    ref = frozen_copy(model)
    assert not any(_in_file_mappings(params))  # the model's weights are the process's own now
    assert all(_in_file_mappings(list(ref.parameters())))  # the frozen copy reads the file's pages
    assert [id(p) for p in model.parameters()] == ids and all(p.requires_grad for p in params)
    assert not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert all(torch.equal(a, b) for a, b in zip(before, ref.parameters()))
    for m in (model, ref):
        assert m.get_input_embeddings().weight is m.get_output_embeddings().weight  # tied as before
    assert model.get_input_embeddings().weight is not ref.get_input_embeddings().weight
    assert own_file_backed(params) == 0  # nothing left for the optimizer's copy
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(ref(tokens).logits, model(tokens).logits, rtol=0, atol=0)
