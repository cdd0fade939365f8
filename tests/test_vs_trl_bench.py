"""The TRL comparison harness (benchmarks/vs_trl.py): its step arithmetic, same-work check and FLOP count.

Runs no benchmark and needs no TRL: it checks the numbers the table is made of."""

import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

from posttrain.models.loading import load_causal_lm, resolve

_spec = importlib.util.spec_from_file_location("vs_trl", Path(__file__).parents[1] / "benchmarks" / "vs_trl.py")
vs_trl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs_trl)


def _run(step_end, items, train_seconds, losses=(2.0,), unit_key="sft_tokens"):
    raw = {"train_begin": 1.0, "step_end": step_end, "train_seconds": train_seconds, "batch_size": 4,
           "sft_tokens": [], "samples": [], "logs": [{"loss": x} for x in losses], "peak_rss_mib": 100.0,
           "versions": {}, "dtype": "torch.float32", "threads": 2}
    raw[unit_key] = items
    return raw


def test_steps_are_end_to_end_and_steady_is_the_median_after_the_first():
    # steps end at 11, 13, 17, 18 s after a train begin at 1 s: times 10, 2, 4, 1
    s = vs_trl.summarise(_run([11.0, 13.0, 17.0, 18.0], [100, 100, 200, 50], train_seconds=20.0), "tokens")
    assert s["times"] == [10.0, 2.0, 4.0, 1.0]
    assert s["steady"] == 50.0  # median of 100/2, 200/4, 50/1
    assert s["whole"] == 450 / 20.0
    assert s["first_step_s"] == 10.0 and s["first_loss"] == 2.0
    assert s["steady_cpu_step_s"] is None  # a run without CPU times
    cpu = vs_trl.summarise({**_run([11.0, 13.0, 17.0, 18.0], [100] * 4, 20.0), "step_cpu_end": [5.0, 8.0, 9.0, 13.0]},
                           "tokens")
    assert cpu["steady_cpu_step_s"] == 3.0  # median of 3, 1, 4
    assert s["steady_step_faults"] is None  # a run without page-fault counts (an older worker)
    faults = vs_trl.summarise({**_run([11.0, 13.0, 17.0, 18.0], [100] * 4, 20.0),
                               "step_faults_end": [900, 1000, 5000, 5200]}, "tokens")
    assert faults["steady_step_faults"] == 200  # median of 100, 4000, 200: the steps after the first


def test_same_work_needs_equal_first_loss_and_tokens_per_step():
    a = vs_trl.summarise(_run([2.0, 3.0], [100, 100], 3.0, losses=(2.5,)), "tokens")
    b = vs_trl.summarise(_run([2.0, 3.0], [100, 100], 3.0, losses=(2.5005,)), "tokens")
    c = vs_trl.summarise(_run([2.0, 3.0], [100, 100], 3.0, losses=(2.6,)), "tokens")
    d = vs_trl.summarise(_run([2.0, 3.0], [100, 90], 3.0, losses=(2.5,)), "tokens")
    assert vs_trl.same_work("sft", a, b)[0]
    assert not vs_trl.same_work("sft", a, c)[0]
    assert not vs_trl.same_work("sft", a, d)[0]
    # packed: each library's packer makes other bins, so only the tokens per step must agree
    assert vs_trl.same_work("sft-packed", a, c)[0] and not vs_trl.same_work("sft-packed", a, d)[0]
    g = vs_trl.summarise(_run([2.0, 3.0], [8, 8], 3.0, unit_key="samples"), "samples")
    h = vs_trl.summarise(_run([2.0, 3.0], [8, 4], 3.0, unit_key="samples"), "samples")
    assert vs_trl.same_work("grpo", g, g)[0] and not vs_trl.same_work("grpo", g, h)[0]


def test_same_work_needs_the_same_precision():
    # TRL's configs default to bf16 autocast: a run under it is not the same work as an fp32 run,
    # even where the first losses happen to agree
    fp32 = vs_trl.summarise(_run([2.0, 3.0], [4, 4], 3.0, losses=(0.77,)), "pairs")
    bf16 = vs_trl.summarise({**_run([2.0, 3.0], [4, 4], 3.0, losses=(0.77,)), "precision": "bf16 autocast"}, "pairs")
    assert fp32["precision"] == "torch.float32"
    assert vs_trl.same_work("reward", fp32, fp32)[0]
    ok, note = vs_trl.same_work("reward", bf16, fp32)
    assert not ok and "bf16 autocast" in note


def test_defaults_mode_compares_bf16_checkpointed_trl_with_fp32_posttrain_on_the_same_rows():
    # --defaults: each side its library's own settings; the same rows and a first loss within bf16's precision
    fp32 = vs_trl.summarise(_run([2.0, 3.0], [4, 4], 3.0, losses=(0.770,)), "pairs")
    trl = vs_trl.summarise({**_run([2.0, 3.0], [4, 4], 3.0, losses=(0.776,)), "precision": "bf16 autocast",
                            "gradient_checkpointing": True}, "pairs")
    other = vs_trl.summarise({**_run([2.0, 3.0], [4, 4], 3.0, losses=(0.95,)), "precision": "bf16 autocast"}, "pairs")
    assert not vs_trl.same_work("reward", trl, fp32)[0]  # same settings asked: different arithmetic is refused
    ok, note = vs_trl.same_work("reward", trl, fp32, defaults=True)
    assert ok and "ran bf16 autocast, checkpointing / torch.float32" in note
    assert not vs_trl.same_work("reward", other, fp32, defaults=True)[0]  # other rows: a loss far off


def test_defaults_mode_leaves_bf16_and_checkpointing_to_each_library(tmp_path, monkeypatch):
    import sys

    worker = tmp_path / "worker.py"  # a stand-in worker: it writes the config it was given
    worker.write_text("import json, sys\nspec = json.load(open(sys.argv[1]))\n"
                      "json.dump(spec['config'], open(spec['out'], 'w'))\n")
    monkeypatch.setitem(vs_trl.WORKLOADS, "fake", dict(trainer="sft", data="d", unit="tokens", config={"lr": 1},
                                                       worker=str(worker)))

    def run(**mode):
        args = type("Args", (), dict(gradient_checkpointing=False, bf16=False, steps=2, threads=1,
                                     memory_profile=False, time_profile=False, op_times=False,
                                     trl_python=sys.executable, **mode))()
        return vs_trl.run_worker("trl", "fake", args, {"causal": "m"}, {"d": "d.json"}, tmp_path)

    assert run() == {"lr": 1, "gradient_checkpointing": False, "bf16": False}
    assert run(defaults=True) == {"lr": 1}


@pytest.mark.parametrize("name", ["posttrain/tiny-qwen2", "posttrain/tiny-llama"])
def test_weights_in_matrix_products_match_the_models_linear_layers(name):
    model = load_causal_lm(name)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    n, output, layers, d_attn = vs_trl.linear_params(resolve(name))
    assert n == linear
    assert output == model.lm_head.weight.numel() and layers == model.config.num_hidden_layers


def test_sft_flops_are_three_forwards_of_two_n_plus_attention():
    model = (1000, 100, 2, 8)
    lengths = {"docs-256/context": 5.0}
    assert vs_trl.flops_per_item("sft", lengths, model, 0.0) == 3 * (2 * 1000 + 4 * 2 * 8 * 5.0)
    # RLOO is GRPO plus one reference forward per token
    lengths = {"prompt/tokens": 3.0}
    grpo, rloo = (vs_trl.flops_per_item(w, lengths, model, 5.0) for w in ("grpo", "rloo"))
    assert rloo / grpo == pytest.approx(5 / 4)


_worker_spec = importlib.util.spec_from_file_location("vs_trl_worker", Path(__file__).parents[1] / "benchmarks" / "vs_trl_worker.py")
vs_trl_worker = importlib.util.module_from_spec(_worker_spec)
_worker_spec.loader.exec_module(vs_trl_worker)


def test_memory_breakdown_finds_the_tensors_live_at_their_peak():
    from torch.profiler import ProfilerActivity, profile

    mib = 2**20 // 4  # float32 elements per MiB
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        a = torch.ones(3 * mib)
        b = torch.ones(2 * mib)
        del a  # the peak (5 MiB) has passed: what comes next stays below it
        c = torch.ones(mib)
        del b, c
    m = vs_trl_worker.memory_breakdown(prof)
    assert m["peak_tensor_mib"] == pytest.approx(5.0, abs=0.01)
    sizes = [size for size, _ in m["largest_mib"]]
    assert sizes[:2] == pytest.approx([3.0, 2.0]) and (len(sizes) < 3 or sizes[2] < 0.01)
    assert sum(m["by_category_mib"].values()) == pytest.approx(m["peak_tensor_mib"])


def test_matmul_peak_times_products_as_step_floor_does():
    peak = vs_trl.matmul_peak(1, size=64, repeats=2)  # GFLOP/s of a 64^3 product: positive and finite
    assert 0 < peak < float("inf")


def test_time_profile_covers_the_steps_after_the_first():
    timed = vs_trl_worker.make_time_profile()
    a = torch.randn(64, 64)
    timed.on_step_begin(None, None, None)
    torch.softmax(a, -1)  # the first step: not profiled
    timed.on_step_begin(None, None, None)
    torch.mm(a, a)
    timed.on_step_begin(None, None, None)
    torch.mm(a, a)
    timed.on_train_end(None, None, None)
    mm = [line for line in timed.table.splitlines() if line.strip().startswith("aten::mm ")]
    assert len(mm) == 1 and mm[0].split()[-1] == "2"  # two calls, one per profiled step
    assert "aten::softmax" not in timed.table


def test_op_times_cover_the_steps_after_the_first_and_count_product_flops():
    timed = vs_trl_worker.make_op_times()
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    timed.on_step_begin(None, None, None)
    torch.softmax(a, -1)  # the first step: not timed
    timed.on_step_begin(None, None, None)
    torch.mm(a, b)
    x = torch.randn(3, 8, 16, requires_grad=True)
    torch.bmm(x, torch.randn(3, 16, 4)).sum().backward()  # the backward's operators are seen too
    timed.on_step_begin(None, None, None)
    torch.mm(a, b)
    timed.on_train_end(None, None, None)
    ops, products = timed.context.ops, timed.context.products
    assert "aten._softmax.default" not in ops
    assert products["aten.mm.default", (8, 16), (16, 4)][:1] == [2]  # two calls, one per timed step
    assert products["aten.mm.default", (8, 16), (16, 4)][2] == 2 * (2 * 8 * 16 * 4)
    assert products["aten.bmm.default", (3, 8, 16), (3, 16, 4)][2] == 2 * 3 * 8 * 16 * 4
    assert ("aten.bmm.default", (3, 8, 4), (3, 4, 16)) in products  # the backward's product (grad of x)
    assert "matrix products:" in timed.table and "aten.mm.default (8, 16) x (16, 4)" in timed.table
    assert vs_trl_worker.product_flops(torch.empty(3, 8, 16), torch.empty(3, 16, 4)) == 2 * 3 * 8 * 16 * 4


def test_memory_table_has_one_row_per_profiled_run(capsys):
    run = {"peak_rss_mib": 900.0, "rss_before_train_mib": 500.0, "memory_breakdown": {
        "peak_tensor_mib": 300.0, "tensors": 3,
        "by_category_mib": {"activation": 200.0, "parameter": 60.0, "uncategorized": 40.0},
        "largest_mib": [[150.0, "activation"], [60.0, "parameter"]]}}
    vs_trl.print_memory_breakdowns({"sft": {"trl": [run], "posttrain": [{**run, "memory_breakdown": None}]}})
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| sft")]
    assert rows == ["| sft | trl | 900 | 500 | 300 | 60 | 0 | 0 | 200 | 0 | 40 | 150 activation, 60 parameter |"]


def test_bco_flops_are_half_a_dpo_pair_and_ppo_counts_policy_and_critic():
    model = (1000, 100, 2, 8)
    lengths = {"pair/context": 5.0, "pair/tokens": 20.0, "prompt/tokens": 3.0}
    # DPO: (3 + 1) forwards of 2000 + 4 * 2 * 8 * 5 = 2320 per token of both sequences; a BCO row is one of them
    assert vs_trl.flops_per_item("dpo", lengths, model, 0.0) == 4 * 2320 * 20
    assert vs_trl.flops_per_item("bco", lengths, model, 0.0) == 4 * 2320 * 10
    # PPO, 2 epochs, 3 + 5 tokens (4.5 keys each): (2 no-grad + 3 x 2) forwards of the policy (2000 + 288 per token)
    # and of the critic without the output layer (1800 + 288)
    assert vs_trl.flops_per_item("ppo", lengths, model, 5.0) == 8 * (2288 + 2088) * 8


def test_bco_same_work_compares_the_first_log_probs_as_its_first_loss_is_log_2():
    def run(chosen):
        logs = [{"loss": 0.6931, "logps/chosen": chosen, "logps/rejected": -80.0}]
        return vs_trl.summarise({**_run([2.0, 3.0], [8, 8], 3.0), "logs": logs}, "rows")

    assert vs_trl.same_work("bco", run(-60.0), run(-60.02))[0]
    ok, note = vs_trl.same_work("bco", run(-60.0), run(-64.0))  # the same loss from other rows
    assert not ok and "logps/chosen -60.000 / -64.000" in note


def test_ppo_and_bco_run_trl_1_12_with_their_own_worker(monkeypatch):
    args = type("Args", (), {"trl_python": "trl116/python", "trl112_python": "trl112/python"})
    assert [vs_trl.trl_python(w, args) for w in ("sft", "ppo", "bco")] == ["trl116/python"] + ["trl112/python"] * 2
    benchmarks = Path(__file__).parents[1] / "benchmarks"
    assert all((benchmarks / vs_trl.WORKLOADS[w]["worker"]).exists() for w in ("ppo", "bco"))
    monkeypatch.syspath_prepend(str(benchmarks))
    worker = importlib.import_module("vs_trl_experimental_worker")
    pairs = [{"prompt": "p0", "chosen": "c0", "rejected": "r0"}, {"prompt": "p1", "chosen": "c1", "rejected": "r1"}]
    # pair i -> rows 2i, 2i + 1, so that a batch of an even number of rows read in order holds whole pairs
    assert worker.unpaired(pairs) == [{"prompt": "p0", "completion": "c0", "label": True},
                                      {"prompt": "p0", "completion": "r0", "label": False},
                                      {"prompt": "p1", "completion": "c1", "label": True},
                                      {"prompt": "p1", "completion": "r1", "label": False}]


def test_the_allocator_off_column_runs_posttrain_with_malloc_untouched(tmp_path, monkeypatch):
    # a stand-in worker: it writes what it saw of POSTTRAIN_KEEP_FREED_MEMORY, and claims the trainer
    # tuned malloc unless told to turn the setting off (or, as "liar", whatever it was told)
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import json, os, sys\n"
        "spec = json.load(open(sys.argv[1]))\n"
        "seen = os.environ.get('POSTTRAIN_KEEP_FREED_MEMORY')\n"
        "kept = True if spec['workload'] == 'liar' else seen != '0'\n"
        "json.dump({'seen': seen, 'keep_freed_memory': kept}, open(spec['out'], 'w'))\n")
    for name in ("fake", "liar"):
        monkeypatch.setitem(vs_trl.WORKLOADS, name, dict(trainer="sft", data="d", unit="tokens", config={},
                                                         worker=str(worker)))
    args = type("Args", (), dict(gradient_checkpointing=False, bf16=False, steps=2, threads=1,
                                 memory_profile=False, time_profile=False, op_times=False,
                                 trl_python="unused"))()
    monkeypatch.delenv("POSTTRAIN_KEEP_FREED_MEMORY", raising=False)

    def run(column, workload="fake"):
        return vs_trl.run_worker(column, workload, args, {"causal": "m"}, {"d": "d.json"}, tmp_path)

    assert run("posttrain") == {"seen": None, "keep_freed_memory": True}
    assert run("posttrain-malloc-off") == {"seen": "0", "keep_freed_memory": False}
    with pytest.raises(SystemExit, match="keep_freed_memory was True"):  # the setting did not take: no column
        run("posttrain-malloc-off", "liar")


def test_posttrain_side_runs_this_checkout_and_trl_side_sees_no_posttrain(tmp_path, monkeypatch):
    import sys

    worker = tmp_path / "worker.py"  # a stand-in worker: it writes the PYTHONPATH it was started with
    worker.write_text("import json, os, sys\nspec = json.load(open(sys.argv[1]))\n"
                      "json.dump({'path': os.environ.get('PYTHONPATH')}, open(spec['out'], 'w'))\n")
    monkeypatch.setitem(vs_trl.WORKLOADS, "fake", dict(trainer="sft", data="d", unit="tokens", config={},
                                                       worker=str(worker)))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    args = type("Args", (), dict(gradient_checkpointing=False, bf16=False, steps=2, threads=1, memory_profile=False,
                                 time_profile=False, op_times=False, trl_python=sys.executable))()
    run = lambda side: vs_trl.run_worker(side, "fake", args, {"causal": "m"}, {"d": "d.json"}, tmp_path)  # noqa: E731
    assert run("posttrain") == {"path": str(vs_trl.ROOT)}
    assert run("trl") == {"path": None}


def test_a_workloads_min_steps_raise_the_steps_of_both_sides(tmp_path, monkeypatch):
    import sys

    worker = tmp_path / "worker.py"  # a stand-in worker: it writes the steps it was asked for
    worker.write_text("import json, sys\nspec = json.load(open(sys.argv[1]))\n"
                      "json.dump({'steps': spec['steps']}, open(spec['out'], 'w'))\n")
    monkeypatch.setitem(vs_trl.WORKLOADS, "fake", dict(trainer="sft", data="d", unit="tokens", config={},
                                                       worker=str(worker), min_steps=10))
    assert vs_trl.WORKLOADS["vlm_sft"]["min_steps"] == 10

    def run(side, steps):
        args = type("Args", (), dict(gradient_checkpointing=False, bf16=False, steps=steps, threads=1,
                                     memory_profile=False, time_profile=False, op_times=False,
                                     trl_python=sys.executable))()
        return vs_trl.run_worker(side, "fake", args, {"causal": "m"}, {"d": "d.json"}, tmp_path)["steps"]

    assert run("posttrain", 5) == run("trl", 5) == 10 and run("trl", 12) == 12


def test_online_dpo_workload_runs_on_posttrain_with_trls_batch_meaning(tmp_path):
    """The posttrain side of the online_dpo workload, on the tiny model for 2 steps (timing nothing): TRL's batch of
    2 prompts becomes 4 completions, each step scores 2 pairs, and the first loss is DPO's log 2."""
    import json
    import subprocess
    import sys

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"prompt": f"Reverse {i}{i + 1}{i + 2}:"} for i in range(6)]))
    spec = {"side": "posttrain", "workload": "online_dpo", "trainer": "online_dpo",
            "config": {**vs_trl.WORKLOADS["online_dpo"]["config"], "max_new_tokens": 4, "gradient_checkpointing": False,
                       "bf16": False},
            "model": "posttrain/tiny-qwen2", "models": {}, "data": str(prompts), "steps": 2, "threads": 1, "seed": 0,
            "output_dir": str(tmp_path / "out"), "out": str(tmp_path / "result.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    worker = Path(__file__).parents[1] / "benchmarks" / "vs_trl_worker.py"
    done = subprocess.run([sys.executable, str(worker), str(tmp_path / "spec.json")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["batch_size"] == 4 and result["samples"] == [4, 4]
    assert result["logs"][0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # policy = reference at the first step
    assert all(0 < n <= 4 for n in result["completion_tokens"])
    summary = vs_trl.summarise(result, "samples")
    assert vs_trl.same_work("online_dpo", summary, summary)[0]
@pytest.mark.parametrize("workload", ["distillation", "gkd", "gold", "iw_opd"])
def test_distillation_workloads_run_on_the_posttrain_side(tmp_path, monkeypatch, workload):
    # the worker's posttrain side on the tiny models, 2 steps: the trainer builds from the workload's TRL-named
    # config, the teacher's decoder runs on every completion of a step, and the result holds what vs_trl reads
    import json
    import sys

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    worker = importlib.import_module("vs_trl_distill_worker")
    rows = [{"prompt": [{"role": "user", "content": p}]} for p in vs_trl.PROMPTS] * 8
    if vs_trl.WORKLOADS[workload]["data"] == "messages":
        rows = [{"messages": r["prompt"] + [{"role": "assistant", "content": "Sure."}]} for r in rows]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    config = {**vs_trl.WORKLOADS[workload]["config"], "per_device_train_batch_size": 4}
    config["max_new_tokens" if workload == "gkd" else "max_completion_length"] = 4
    spec = {"side": "posttrain", "workload": workload, "trainer": vs_trl.WORKLOADS[workload]["trainer"],
            "config": config, "model": resolve("posttrain/tiny-qwen2"),
            "models": {"teacher": resolve("posttrain/tiny-llama")}, "data": str(tmp_path / "data.json"), "steps": 2,
            "threads": torch.get_num_threads(), "seed": 0, "output_dir": str(tmp_path / "out"),
            "out": str(tmp_path / "result.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    monkeypatch.setattr(sys, "argv", ["worker", str(tmp_path / "spec.json")])
    worker.main()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["samples"] == [4, 4] and len(result["step_end"]) == 2
    summary = vs_trl.summarise(result, vs_trl.WORKLOADS[workload]["unit"])
    assert summary["samples_per_step"] == 4 and summary["first_loss"] is not None
    # per token: sampled, trained (3 forwards), the teacher's forward; 10 + 4 tokens attending to 7.5 keys
    assert vs_trl.flops_per_item(workload, {"prompt/tokens": 10.0}, (1000, 100, 2, 8), 4.0) == 5 * (2000 + 64 * 7.5) * 14


@pytest.mark.parametrize("workload", ["orpo", "cpo"])
def test_orpo_and_cpo_workloads_run_on_the_posttrain_side(tmp_path, monkeypatch, workload):
    """The posttrain side of the orpo and cpo workloads, as vs_trl.py starts it (its worker in a fresh process, the
    workload's configuration), on the tiny model and 8 of the bench's chat pairs for 2 steps; times are not read.
    Their TRL side imports trl.experimental.orpo / .cpo (TRL 1.16)."""
    import json
    import subprocess
    import sys

    benchmarks = Path(__file__).parents[1] / "benchmarks"
    spec = vs_trl.WORKLOADS[workload]
    assert (spec["trainer"], spec["data"], spec["unit"]) == (workload, "pairs", "pairs")
    data = tmp_path / "pairs.json"
    data.write_text(json.dumps(vs_trl.pairs(8)))
    job = {"side": "posttrain", "workload": workload, "trainer": spec["trainer"],
           "config": {**spec["config"], "gradient_checkpointing": False, "bf16": False, "max_length": 64},
           "model": resolve("posttrain/tiny-qwen2"), "data": str(data), "seed": 0, "threads": 1, "steps": 2,
           "output_dir": str(tmp_path / "out"), "out": str(tmp_path / "result.json")}
    (tmp_path / "spec.json").write_text(json.dumps(job))
    done = subprocess.run([sys.executable, str(benchmarks / "vs_trl_worker.py"), str(tmp_path / "spec.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result["step_end"]) == 2 and result["batch_size"] == 4 and result["precision"] == "torch.float32"
    first = vs_trl.summarise(result, "pairs")
    assert first["first_loss"] is not None and first["first_loss"] > 0
    assert "nll_loss" in result["logs"][0]
    monkeypatch.syspath_prepend(str(benchmarks))
    assert importlib.import_module("vs_trl_worker").TRAINERS[workload][3] == f"trl.experimental.{workload}"
    # no reference model: three forwards' worth (forward + backward) per token of both sequences
    model, lengths = (1000, 100, 2, 8), {"pair/context": 5.0, "pair/tokens": 20.0}
    assert vs_trl.flops_per_item(workload, lengths, model, 0.0) == 3 * 2320 * 20


def test_vlm_grpo_workload_runs_on_the_posttrain_side(tmp_path):
    """The posttrain side of vlm_grpo as vs_trl.py starts it (the worker in a fresh process, the workload's
    configuration) on the tiny VLM and 8 rows of the visual task (PNG files the worker opens), for 2 steps; the
    prompt length counts each image's 16 tokens."""
    import json
    import subprocess
    import sys

    from posttrain.tasks.vision import vision_dataset

    spec = vs_trl.WORKLOADS["vlm_grpo"]
    rows = []
    for i, row in enumerate(vision_dataset("train", 8)):  # the rows vs_trl_vlm_worker.prepare writes
        row["images"][0].save(tmp_path / f"{i}.png")
        rows.append({"prompt": row["prompt"], "completion": row["completion"], "images": [str(tmp_path / f"{i}.png")]})
    (tmp_path / "data.json").write_text(json.dumps(rows))
    model = resolve("posttrain/tiny-llava")
    assert vs_trl.vision_prompt_tokens(model, rows) > 16  # each image's 16 tokens counted
    job = {"side": "posttrain", "workload": "vlm_grpo", "trainer": spec["trainer"],
           "config": {**spec["config"], "max_completion_length": 4, "gradient_checkpointing": False, "bf16": False},
           "model": model, "models": {}, "data": str(tmp_path / "data.json"), "seed": 0, "threads": 1, "steps": 2,
           "output_dir": str(tmp_path / "out"), "out": str(tmp_path / "result.json")}
    (tmp_path / "spec.json").write_text(json.dumps(job))
    done = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "vs_trl_worker.py"),
                           str(tmp_path / "spec.json")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["samples"] == [8, 8] and all(0 < n <= 4 for n in result["completion_tokens"])
    summary = vs_trl.summarise(result, "samples")
    assert vs_trl.same_work("vlm_grpo", summary, summary)[0]
