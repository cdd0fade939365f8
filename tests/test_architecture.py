"""The import rules of docs/architecture.md, checked on the source: core/ imports only core/, posttrain's parts
import each other in one direction only (down the layers below, so there is no cycle), every import names a
module that exists (no path left over from a move), and no function is longer than 90 lines.

Every import counts, also those inside functions (a lazy import is still a dependency) and under
TYPE_CHECKING. Imports of the package root `posttrain` are not edges: it holds only the lazy public names.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "posttrain"

# Lowest first; a part imports only parts of lower layers (and itself). A module at the package root is a part
# of its own (cli, demo, callbacks, ...); a subpackage is one part.
LAYERS = [
    {"core", "cache", "plotting", "_moved", "flags"},  # flags: dataclass fields -> command-line flags
    {"accel"},            # CPU speed: products, kernels, lean activations, replay, memory habits
    {"data"},             # formats, chat templates, tokenisation, collators, packing, tool schemas
    {"models", "tasks"},  # loading, tiny models, value heads | built-in datasets, checkers, rewards, environments
    {"forward"},          # model-facing log-probs
    {"rollout", "eval", "scripts"},  # the sampler, multi-turn, rewards | generation accuracy | TRL's script helpers
    {"judges"},
    {"callbacks"},
    {"trainers"},
    {"demo_vision"},      # the demo's vision stage (the tiny VLM), run by demo
    {"demo"},
    {"cli"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}
RANK["posttrain"] = len(LAYERS)  # the package's __init__: the lazy public names, above every part
MAX_FUNCTION_LINES = 90


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("posttrain",) + path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported posttrain module) for every import in the file; `from pkg import mod` names the module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("posttrain")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("posttrain"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((node.lineno, sub if sub in MODULES else base))
    return found


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "posttrain"


EDGES = [(module, line, target) for module, path in MODULES.items() for line, target in _imports(module, path)]


def test_every_part_has_a_layer():
    assert {_part(m) for m in MODULES} <= set(RANK), "add the new part to LAYERS (and the picture)"


def test_imports_name_existing_modules():
    missing = [f"{module}:{line} imports {target}" for module, line, target in EDGES if target not in MODULES]
    assert not missing, "imports of modules that do not exist (moved? see docs/architecture.md):\n" + "\n".join(missing)


def test_core_imports_only_core():
    bad = [f"{module}:{line} imports {target}" for module, line, target in EDGES
           if _part(module) == "core" and _part(target) != "core"]
    assert not bad, "core/ is pure tensor math and imports nothing of posttrain outside core/:\n" + "\n".join(bad)


def test_imports_point_down():
    bad = [f"{module}:{line} imports {target}" for module, line, target in EDGES
           if target != "posttrain" and _part(module) != _part(target)
           and RANK.get(_part(target), 99) >= RANK.get(_part(module), -1)]
    assert not bad, "imports that do not point down the layers of docs/architecture.md:\n" + "\n".join(bad)


def test_no_import_cycle_between_parts():
    graph: dict[str, set[str]] = {}
    for module, _, target in EDGES:
        if target != "posttrain" and _part(module) != _part(target):
            graph.setdefault(_part(module), set()).add(_part(target))
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail(f"import cycle between posttrain's parts: {' -> '.join(path + [node, nxt])}")
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_no_function_is_longer_than_90_lines():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them):\n" + "\n".join(long)


MAX_ENGINE_LINES = 420  # the "about 400": online.py holds the loop, its wiring lives in online_*.py


def test_the_online_engine_file_is_the_loop():
    """online.py stays the loop (make experience -> build experience -> loss): setup, sampling and scoring, prompt
    data, evaluation, metrics, state and the classic call forms live in files of their own."""
    engine = ROOT / "trainers" / "online.py"
    lines = len(engine.read_text().splitlines())
    assert lines <= MAX_ENGINE_LINES, (f"trainers/online.py has {lines} lines (at most {MAX_ENGINE_LINES}): move what "
                                       "is not the loop into trainers/online_*.py (see docs/architecture.md)")
    methods = {node.name for node in ast.walk(ast.parse(engine.read_text())) if isinstance(node, ast.FunctionDef)}
    assert {"make_experience", "build_experience", "compute_loss", "training_step"} <= methods


def test_the_rules_catch_what_they_guard(tmp_path):
    """The checks above would fail on a violation: an upward import and a cycle are seen as such."""
    assert RANK["core"] < RANK["forward"] < RANK["rollout"] < RANK["trainers"]
    sample = tmp_path / "m.py"
    sample.write_text("def f():\n    from posttrain.trainers import base\nfrom posttrain.accel import products\n")
    assert [t for _, t in _imports("posttrain.core.m", sample)] == ["posttrain.accel.products",
                                                                   "posttrain.trainers.base"]
