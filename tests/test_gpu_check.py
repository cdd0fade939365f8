"""benchmarks/gpu_check.py lists every wheel an offline GPU machine needs beyond torch and transformers: each
of pyproject.toml's dependencies, and each package setup_trl_env.sh installs on the TRL side."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def test_the_wheel_list_covers_pyprojects_dependencies():
    tomllib = pytest.importorskip("tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        dependencies = {_name(d) for d in tomllib.load(f)["project"]["dependencies"]}
    listed = set(gpu_check.WHEELS["posttrain (main environment)"])
    assert dependencies - {"torch", "transformers"} <= listed, dependencies - listed
    assert {"peft", "pytest"} <= listed  # the LoRA tests and the test run itself


def test_the_trl_side_lists_what_setup_trl_env_installs():
    script = (ROOT / "benchmarks" / "setup_trl_env.sh").read_text()
    installed = {_name(m) for m in re.findall(r'"([a-z][a-z0-9_-]*)==', script)}
    trl_side = {_name(w) for w in gpu_check.WHEELS["TRL side (its own environment, benchmarks/setup_trl_env.sh)"]}
    assert installed - {"torch", "transformers"} <= trl_side, installed - trl_side
