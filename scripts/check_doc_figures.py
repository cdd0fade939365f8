"""Re-run the commands behind every learning figure README.md and docs/quickstart.md state, and compare.

Each entry of RUNS is a command a reader can type, taken from the documents themselves where they show it
(the README's command-line example and Quickstart snippet are extracted and run as written), and the figures
it produces. `docs/figures.json` records the figures measured last, with the machine class they hold for:
the learning figures are deterministic for a CPU class and thread count (the float kernels differ between
CPU families: oneDNN on AMD, MKL on Intel), wall times are not (they are approximate and never compared).
tests/test_doc_figures.py checks, fast, that the documents state exactly the recorded figures; this script
checks that the code still produces them:

    python scripts/check_doc_figures.py                 # all runs (several minutes of CPU), exit 1 on a change
    python scripts/check_doc_figures.py --runs cli,quickstart
    python scripts/check_doc_figures.py --update        # re-measure and rewrite docs/figures.json

After --update, write the new figures into the documents (the fast test names what differs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "figures.json"
README = ROOT / "README.md"
TOLERANCE = 0.005  # the documents print accuracies to two decimals


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section of a markdown text."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    if match is None:
        raise ValueError(f"no section '## {heading}'")
    return match.group(1)


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def cli_example(readme: str) -> list[str]:
    """The README's command-line example as shell commands: the `posttrain sft` and `posttrain grpo` lines of
    the Quickstart section's bash block (continuations joined)."""
    block = next(b for b in code_blocks(section(readme, "Quickstart"), "bash") if "posttrain grpo" in b)
    commands = block.replace("\\\n", " ").splitlines()
    return [" ".join(c.split()) for c in commands if c.startswith(("posttrain sft", "posttrain grpo"))]


def quickstart_snippet(readme: str) -> str:
    """The README's Quickstart Python snippet."""
    return code_blocks(section(readme, "Quickstart"), "python")[0]


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _posttrain() -> list[str]:
    return [sys.executable, "-m", "posttrain.cli"]


def _run(argv, cwd: str, shell: bool = False) -> str:
    """Run a command quietly; its stdout, or its output's end and an error when it fails."""
    done = subprocess.run(argv, cwd=cwd, env=_env(), shell=shell, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{argv!r} failed with exit status {done.returncode}")
    return done.stdout


def _held_out(folder: str) -> float:
    from posttrain.tasks.builtin import task_dataset
    from posttrain.eval import generation_accuracy
    from posttrain.models.loading import load_causal_lm, load_tokenizer

    return generation_accuracy(load_causal_lm(folder), load_tokenizer(None, model=folder),
                               task_dataset("reverse", "test"))


def run_demo(workdir: str, model: str | None = None) -> dict:
    """`posttrain demo [--model M]`: {stage: [before, after]} and the wall time."""
    out = os.path.join(workdir, "demo")
    argv = [*_posttrain(), "demo", "--output_dir", out] + (["--model", model] if model else [])
    start = time.time()
    _run(argv, cwd=workdir)
    results = json.loads(Path(out, "results.json").read_text())
    figures = {r["stage"]: [r["before"], r["after"]] for r in results}
    if model:  # the README also states the sampled training reward, first and last logging step
        rewards = [h["reward"] for h in json.loads(Path(out, "grpo", "log_history.json").read_text()) if "reward" in h]
        figures["grpo training reward"] = [rewards[0], rewards[-1]]
    print(f"  ({time.time() - start:.0f} s wall, not recorded: it depends on the machine's load)")
    return {"figures": figures}


def run_cli(workdir: str) -> dict:
    """The README's `posttrain sft` and `posttrain grpo` lines as written; held-out accuracy of each model."""
    for command in cli_example(README.read_text()):
        _run(command.replace("posttrain ", " ".join(_posttrain()) + " ", 1), cwd=workdir, shell=True)
    return {"figures": {"sft": _held_out(os.path.join(workdir, "out/sft")),
                        "grpo": _held_out(os.path.join(workdir, "out/grpo"))}}


def run_quickstart(workdir: str) -> dict:
    """The README's Quickstart snippet as written: the accuracies it prints."""
    out = _run([sys.executable, "-c", quickstart_snippet(README.read_text())], cwd=workdir)
    printed = dict(re.findall(r"^held-out accuracy after (\w+): ([0-9.]+)$", out, flags=re.M))
    return {"figures": {stage.lower(): float(value) for stage, value in printed.items()}}


RUNS = {
    "demo": run_demo,
    "cli": run_cli,
    "quickstart": run_quickstart,
    "smollm2": lambda workdir: run_demo(workdir, "smollm2"),
}


def machine() -> str:
    """The CPU class the learning figures hold for: model name, threads, the float32 products' backend."""
    import torch

    from posttrain.accel import products

    name = "unknown CPU"
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or name
    name = " ".join(re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b", " ", name).split())
    library = "oneDNN" if products.backend() == "onednn" else "MKL" if torch.backends.mkl.is_available() else "ATen"
    return f"{name} ({torch.get_num_threads()} threads, {library} products)"


def differences(recorded: dict, measured: dict) -> list[str]:
    """What differs by more than TOLERANCE between two {name: figure or [before, after]} dicts."""
    problems = []
    for name in sorted(set(recorded) | set(measured)):
        a, b = recorded.get(name), measured.get(name)
        pairs = list(zip(a, b)) if isinstance(a, list) and isinstance(b, list) and len(a) == len(b) else [(a, b)]
        if any(x is None or y is None or abs(x - y) > TOLERANCE for x, y in pairs if (x, y) != (None, None)):
            problems.append(f"{name}: recorded {a}, measured {b}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--update", action="store_true", help="write the measured figures into docs/figures.json")
    args = parser.parse_args(argv)
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {"runs": {}}
    here, failed = machine(), False
    if record.get("machine") not in (None, here) and not args.update:
        print(f"note: the record was measured on {record['machine']}; this is {here}: learning figures may differ")
    for name in args.runs.split(","):
        with tempfile.TemporaryDirectory() as workdir:
            measured = RUNS[name](workdir)
        problems = differences(record["runs"].get(name, {}).get("figures", {}), measured["figures"])
        status = "updated" if args.update else ("differs" if problems else "as recorded")
        print(f"{name}: {status}: {json.dumps(measured)}" + "".join(f"\n  {p}" for p in problems), flush=True)
        failed |= bool(problems) and not args.update
        if args.update:
            record["runs"][name] = measured
            record["machine"] = here
            RECORD.write_text(json.dumps(record, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
