"""posttrain's GPU check: what `benchmarks/gpu_check.sh` runs on a machine with one NVIDIA GPU, offline.

    python benchmarks/gpu_check.py wheels                      # what to install beyond torch and transformers
    python benchmarks/gpu_check.py sampler [--small] [--device cuda]
    python benchmarks/gpu_check.py bench [--small] [--device cuda] [--steps N] [--trl-python PATH] [--out DIR]

- `sampler`: posttrain's generic sampler (`rollout.generate`, greedy) against `model.generate`, token for token,
  on the model below: in float32 every token must agree (exit status 1 otherwise); in bfloat16 the share of
  rows that agree is printed (other kernels may break a near-tie differently; not a failure).
- `bench`: SFT, DPO and GRPO, each trained by posttrain and by TRL 1.16 (its interpreter: --trl-python or
  $TRL_PYTHON, default .bench-venv-trl/bin/python; without it, posttrain alone), each run in a process of its own
  (benchmarks/vs_trl_worker.py, the same script and configuration for both sides), bf16 autocast over float32
  weights, no gradient checkpointing. Per run: seconds per step (median after the first), items per second
  (SFT: tokens, DPO: pairs, GRPO: completions), peak GPU memory (`torch.cuda.max_memory_allocated`) and the
  process's peak RSS; a markdown table and results.json go to --out.

The model: Qwen2.5-0.5B's configuration (24 layers, hidden 896, 14 heads / 2 KV heads, vocabulary 151936, tied
embeddings) with random weights from a fixed seed, built here (no download); the tokenizer is posttrain's built-in
1024-token one (ids stay below 1024; the output layer is the full 151936 wide, so a step costs what the real
model's does). --small uses posttrain's tiny-qwen2 configuration instead, 2 steps and short sequences, on the CPU:
the check's own code is then proven on any machine in a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SEED = 0

# Qwen2.5-0.5B's config.json, as published (architecture fields only)
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False)
TINY = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, tie_word_embeddings=True)

# Wheels beyond torch and transformers, for `pip install --no-index --find-links WHEELS ...` on a machine offline.
# The main environment's list is pyproject.toml's dependencies (tests/test_gpu_check.py keeps them equal) and
# what the check itself runs (peft for the LoRA tests, pytest); the TRL side's is what setup_trl_env.sh installs.
WHEELS = {
    "posttrain (main environment)": ["accelerate", "datasets", "tokenizers", "safetensors", "numpy", "pyyaml", "rich",
                                     "pillow", "peft", "pytest"],
    "TRL side (its own environment, benchmarks/setup_trl_env.sh)": [
        "trl==1.16.0", "accelerate", "datasets", "pillow", "transformers (the main environment's version)",
        "torch (a CUDA build)"],
}

# (workload, trainer, item) -> the configuration both libraries get (TRL's field names), full size and --small
WORKLOADS = {
    "sft": ("sft", "tokens", dict(per_device_train_batch_size=8, max_length=512, learning_rate=1e-5),
            dict(per_device_train_batch_size=2, max_length=48, learning_rate=1e-5)),
    "dpo": ("dpo", "pairs", dict(per_device_train_batch_size=8, max_length=512, learning_rate=1e-6, beta=0.1,
                                 loss_type="sigmoid"),
            dict(per_device_train_batch_size=2, max_length=48, learning_rate=1e-6, beta=0.1, loss_type="sigmoid")),
    "grpo": ("grpo", "samples", dict(per_device_train_batch_size=16, num_generations=8, max_completion_length=128,
                                     learning_rate=1e-6, temperature=1.0, beta=0.0, num_iterations=1,
                                     shuffle_dataset=False),
             dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=8, learning_rate=1e-6,
                  temperature=1.0, beta=0.0, num_iterations=1, shuffle_dataset=False)),
}


# ---------------------------------------------------------------- the model and the data

def build_model(small: bool, dtype=None):
    """(model, tokenizer): the Qwen2.5-0.5B-shaped model (or tiny-qwen2's shape) with seeded random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models.tiny import build_tokenizer

    tok = build_tokenizer()
    shape = dict(TINY, vocab_size=len(tok)) if small else QWEN25_05B
    config = AutoConfig.for_model("qwen2", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                  bos_token_id=None, **shape)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    return model.eval(), tok


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                    for _ in range(n))


def make_data(folder: Path, small: bool) -> dict[str, Path]:
    """The data set of each trainer, as JSON rows (the same file for both sides)."""
    rng, scale = random.Random(SEED), 0.1 if small else 1.0
    rows = {
        "sft": [{"text": words(rng, int(rng.randint(200, 500) * scale))} for _ in range(256)],
        "dpo": [{"prompt": words(rng, int(40 * scale) + 2), "chosen": words(rng, int(rng.randint(60, 160) * scale) + 2),
                 "rejected": words(rng, int(rng.randint(60, 160) * scale) + 2)} for _ in range(256)],
        "grpo": [{"prompt": words(rng, int(rng.randint(10, 40) * scale) + 2)} for _ in range(256)],
    }
    paths = {}
    for name, data in rows.items():
        paths[name] = folder / f"{name}.json"
        paths[name].write_text(json.dumps(data))
    return paths


# ---------------------------------------------------------------- stage: the sampler against model.generate

def compare_sampler(model, tok, device: str, max_new_tokens: int, prompts: int = 8) -> tuple[int, int]:
    """(rows whose greedy completion equals model.generate's, rows): posttrain's sampler against transformers'."""
    import torch

    from posttrain.data.collate import pad
    from posttrain.rollout.generate import SamplingConfig, generate

    rng = random.Random(SEED)
    prompt_ids = [[rng.randrange(10, min(len(tok), 1000)) for _ in range(rng.randint(4, 40))] for _ in range(prompts)]
    ours = generate(model, prompt_ids, SamplingConfig(max_new_tokens=max_new_tokens, do_sample=False),
                    pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    ids = pad(prompt_ids, tok.pad_token_id, side="left").to(device)
    mask = pad([[1] * len(p) for p in prompt_ids], 0, side="left").to(device)
    with torch.no_grad():
        theirs = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                min_new_tokens=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                top_k=None, top_p=None, temperature=None)[:, ids.shape[1]:].cpu()
    same = 0
    for row in range(prompts):
        n = int(ours.completion_mask[row].sum())
        mine = ours.completion_ids[row, :n].tolist()
        reference = theirs[row].tolist()
        ended = n < max_new_tokens  # ours stopped at EOS: transformers pads after its EOS
        same += mine == reference[:n] and (not ended or mine[-1] == tok.eos_token_id)
    return same, prompts


def sampler_stage(args) -> int:
    import torch

    failures = 0
    for dtype in (torch.float32, torch.bfloat16):
        if dtype == torch.bfloat16 and args.device == "cpu" and not args.small:
            continue
        model, tok = build_model(args.small, dtype)
        model.to(args.device)
        start = time.perf_counter()
        same, rows = compare_sampler(model, tok, args.device, 8 if args.small else 64)
        exact = dtype == torch.float32
        print(f"sampler vs model.generate, {str(dtype).removeprefix('torch.')} on {args.device}: {same}/{rows} rows "
              f"token for token ({time.perf_counter() - start:.1f} s){'' if exact else ' (informative)'}")
        failures += exact and same != rows
        del model
    return 1 if failures else 0


# ---------------------------------------------------------------- stage: SFT, DPO, GRPO against TRL

def trl_python(given: str | None) -> str | None:
    for candidate in (given, os.environ.get("TRL_PYTHON"), ROOT / ".bench-venv-trl" / "bin" / "python"):
        if candidate and Path(candidate).exists():
            return str(candidate)
    return None


def run_worker(python: str, spec: dict, folder: Path, timeout: float) -> dict:
    """One training run in a fresh process (vs_trl_worker.py); its result JSON, or {"error": ...}."""
    spec_path = folder / f"{spec['workload']}-{spec['side']}.spec.json"
    spec["out"] = str(folder / f"{spec['workload']}-{spec['side']}.result.json")
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(ROOT) if spec["side"] == "posttrain" else "", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    try:
        done = subprocess.run([python, str(HERE / "vs_trl_worker.py"), str(spec_path)], env=env, timeout=timeout,
                              capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(Path(spec["out"]).read_text())


def figures(result: dict, unit: str) -> dict:
    """Seconds per step (median after the first), items per second over those steps, memory peaks."""
    if "error" in result:
        return {"error": result["error"]}
    ends = [result.get("train_begin") or 0.0] + result["step_end"]
    steps = [b - a for a, b in zip(ends, ends[1:])]
    steady = steps[1:] or steps
    per_step = {"tokens": sum(result["sft_tokens"]) / max(len(result["sft_tokens"]), 1),
                "pairs": result["batch_size"], "samples": result["batch_size"]}[unit]
    return {"seconds_per_step": statistics.median(steady), "items_per_second": per_step / statistics.median(steady),
            "peak_gpu_mib": result.get("peak_gpu_mib"), "peak_rss_mib": result["peak_rss_mib"],
            "train_seconds": result["train_seconds"], "versions": result["versions"]}


def bench_stage(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trl = trl_python(args.trl_python)
    sides = [("posttrain", sys.executable)] + ([("trl", trl)] if trl else [])
    if trl is None:
        print("no TRL interpreter (--trl-python, $TRL_PYTHON or .bench-venv-trl/bin/python): posttrain alone")
    steps = args.steps or (2 if args.small else 10)
    results, failed = {}, 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, tok = build_model(args.small)
        model.save_pretrained(tmp / "model")
        tok.save_pretrained(tmp / "model")
        del model
        data = make_data(tmp, args.small)
        for workload, (trainer, unit, full, small) in WORKLOADS.items():
            config = dict(small if args.small else full, bf16=args.device == "cuda", gradient_checkpointing=False)
            for side, python in sides:
                spec = {"side": side, "trainer": trainer, "workload": workload, "config": config,
                        "data": str(data[trainer]), "model": str(tmp / "model"), "output_dir": str(tmp / "runs"),
                        "steps": steps, "seed": SEED, "threads": args.threads, "use_cpu": args.device == "cpu"}
                result = figures(run_worker(python, spec, tmp, args.timeout), unit)
                results[f"{workload}/{side}"] = result
                failed += "error" in result
                print(f"{workload:5s} {side:9s} " + (f"ERROR {result['error']}" if "error" in result else
                      f"{result['seconds_per_step']:.3f} s/step  {result['items_per_second']:.1f} {unit}/s  "
                      f"peak GPU {mib(result['peak_gpu_mib'])} MiB  peak RSS {result['peak_rss_mib']:.0f} MiB"),
                      flush=True)
    table = markdown(results, args)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(table)
    print(table)
    return 1 if failed else 0


def mib(value) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def markdown(results: dict, args) -> str:
    lines = ["| workload | side | s/step | items/s | vs TRL | peak GPU MiB | peak RSS MiB |",
             "|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        workload, side = key.split("/")
        if "error" in r:
            lines.append(f"| {workload} | {side} | error: {r['error']} | | | | |")
            continue
        peer = results.get(f"{workload}/trl", {})
        ratio = f"{r['items_per_second'] / peer['items_per_second']:.2f}x" if "items_per_second" in peer else ""
        lines.append(f"| {workload} | {side} | {r['seconds_per_step']:.3f} | {r['items_per_second']:.1f} | "
                     f"{ratio if side == 'posttrain' else ''} | {mib(r['peak_gpu_mib'])} | {r['peak_rss_mib']:.0f} |")
    size = "tiny-qwen2 shape (--small)" if args.small else "Qwen2.5-0.5B shape, random weights"
    return "\n".join([f"{size}, {args.device}, {args.steps or (2 if args.small else 10)} steps per run", ""] + lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["wheels", "sampler", "bench"])
    parser.add_argument("--small", action="store_true", help="tiny model, 2 steps, short sequences (any machine)")
    parser.add_argument("--device", default=None, help="cuda (default when one is there) or cpu")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 10; --small 2)")
    parser.add_argument("--trl-python", default=None, help="the TRL environment's python (or $TRL_PYTHON)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: all cores; "
                        "--small: 1, tiny models gain nothing from more)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds one training run may take")
    parser.add_argument("--out", default=str(ROOT / "gpu_check_out"), help="folder for results.json and table.md")
    args = parser.parse_args(argv)
    if args.stage == "wheels":
        for where, names in WHEELS.items():
            print(f"{where}: {' '.join(names)}")
        return 0
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.threads = args.threads or (1 if args.small else os.cpu_count() or 1)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA GPU")
    return sampler_stage(args) if args.stage == "sampler" else bench_stage(args)


if __name__ == "__main__":
    sys.exit(main())
