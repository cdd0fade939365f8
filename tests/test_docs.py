"""The documentation stays true to the code.

* docs/config_reference.md is what scripts/gen_config_reference.py generates, and every config
  field has help text;
* every metric of the docs/metrics.md glossary is a string in posttrain's source, and every
  metric the trainers record is in the glossary;
* the Python snippets of docs/quickstart.md compile, import only public names, and pass only
  keyword arguments that the config classes and trainers accept;
* the example rows of docs/datasets.md are detected as the format their section names.
"""

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCE = sorted((ROOT / "posttrain").rglob("*.py"))


def _script():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "scripts" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code_blocks(text: str, language: str = "python") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def _sections(text: str, level: str = "## ") -> dict[str, str]:
    """{heading: body} for every heading of `level`."""
    parts = re.split(rf"^{re.escape(level)}(.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


# --------------------------------------------------------------------------- config reference

def test_config_reference_is_up_to_date(capsys):
    code = _script().main(["--check"])
    assert code == 0, capsys.readouterr().err + "\nregenerate with: python scripts/gen_config_reference.py"


def test_every_config_field_has_help_text():
    _, undocumented = _script().render()
    assert not undocumented, f"config fields without field(metadata={{'help': ...}}): {undocumented}"


def test_check_mode_flags_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "ref.md"
    stale.write_text("# old\n")
    assert _script().main(["--check", "--output", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert _script().main(["--output", str(stale)]) == 0
    assert _script().main(["--check", "--output", str(stale)]) == 0


# --------------------------------------------------------------------------- metrics glossary

def _glossary() -> list[str]:
    """Metric names: the backticked names in the first column of the tables, outside the transformers section."""
    names = []
    for heading, body in _sections((DOCS / "metrics.md").read_text()).items():
        if "transformers" in heading:
            continue
        for row in re.findall(r"^\| (`[^|]+`) \|", body, flags=re.M):
            names += re.findall(r"`([^`]+)`", row)
    return names


def _string_constants() -> set[str]:
    found = set()
    for path in SOURCE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def test_every_glossary_metric_appears_in_the_source():
    names = _glossary()
    assert len(names) > 40
    constants = _string_constants()
    joined = "\n".join(constants)
    missing = []
    for name in names:
        if "<" in name:  # a template such as rewards/<name>/mean: its literal parts must be there
            parts = [p for p in re.split(r"<[^>]+>", name) if p]
            if not all(part in joined for part in parts):
                missing.append(name)
        elif name not in constants:
            missing.append(name)
    assert not missing, f"docs/metrics.md documents metrics that no code logs: {missing}"


def _recorded_metric_names() -> set[str]:
    """Metric names the code records: keys of dict literals passed to `record(...)` / `masked_means(...)` or
    built up in a variable named `metrics` (`metrics = {...}`, `metrics.update({...})`), and constant keys
    assigned into `_metrics[...]` buffers or into `logs`."""

    def key_name(key) -> str | None:
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value
        if isinstance(key, ast.JoinedStr):  # f"rewards/{name}/mean" -> rewards/<name>/mean
            name = "".join(v.value if isinstance(v, ast.Constant) else "<name>" for v in key.values)
            return name.removeprefix("<name>_")  # f"{metric_key_prefix}_reward": the eval_ name of "reward"
        return None

    names = set()
    for path in SOURCE:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Dict):
                attr = getattr(node.func, "attr", None)
                into_metrics = attr == "update" and ast.unparse(node.func.value) == "metrics"
                if attr in ("record", "masked_means") or into_metrics:
                    names |= {key_name(k) for k in node.args[0].keys}
            if isinstance(node, ast.Assign):
                if isinstance(node.value, ast.Dict) and any(ast.unparse(t) == "metrics" for t in node.targets):
                    names |= {key_name(k) for k in node.value.keys}
                for target in node.targets:
                    if isinstance(target, ast.Subscript):
                        inner = ast.unparse(target.value)
                        if "_metrics[" in inner or inner == "logs":
                            names.add(key_name(target.slice))
    return {n for n in names if n}


def test_every_recorded_metric_is_in_the_glossary():
    recorded = _recorded_metric_names()
    assert {"mean_token_accuracy", "rewards/chosen"} <= recorded or not (ROOT / "posttrain/trainers/dpo.py").exists()
    glossary = set(_glossary())
    undocumented = sorted(recorded - glossary)
    assert not undocumented, f"metrics logged by the code but missing from docs/metrics.md: {undocumented}"


# --------------------------------------------------------------------------- quickstart

def _quickstart_snippets() -> list[str]:
    snippets = _code_blocks((DOCS / "quickstart.md").read_text())
    assert len(snippets) >= 9
    return snippets


def test_quickstart_snippets_compile():
    for i, snippet in enumerate(_quickstart_snippets()):
        compile(snippet, f"docs/quickstart.md[snippet {i}]", "exec")


def test_quickstart_uses_real_names_and_arguments():
    import posttrain

    problems = []
    for i, snippet in enumerate(_quickstart_snippets()):
        tree = ast.parse(snippet)
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("posttrain"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if node.module == "posttrain" and alias.name not in posttrain.__all__:
                        problems.append(f"snippet {i}: posttrain exports no {alias.name}")
                        continue
                    try:
                        imported[alias.asname or alias.name] = getattr(module, alias.name)
                    except (AttributeError, ImportError) as err:
                        problems.append(f"snippet {i}: from {node.module} import {alias.name}: {err}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported):
                continue
            target = imported[node.func.id]
            if dataclasses.is_dataclass(target):
                accepted = {f.name for f in dataclasses.fields(target)}
            elif callable(target):
                params = inspect.signature(target).parameters
                if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                    continue
                accepted = set(params)
            else:
                continue
            for kw in node.keywords:
                if kw.arg is not None and kw.arg not in accepted:
                    problems.append(f"snippet {i}: {node.func.id}(...) takes no argument {kw.arg!r}")
    assert not problems, "\n".join(problems)


def test_quickstart_covers_every_trainer():
    import posttrain

    text = (DOCS / "quickstart.md").read_text()
    trainers = [name for name in posttrain.__all__ if name.endswith("Trainer") and name != "OnlineTrainer"]
    missing = [name for name in trainers if name not in text]
    assert not missing, f"docs/quickstart.md has no example for {missing}"


# --------------------------------------------------------------------------- datasets

def test_dataset_examples_match_their_format():
    from posttrain.data.formats import FORMATS, detect_format, validate

    sections = _sections((DOCS / "datasets.md").read_text(), "### ")
    assert set(FORMATS) <= set(sections), f"formats without a section: {set(FORMATS) - set(sections)}"
    for name in FORMATS:
        rows = []
        for block in _code_blocks(sections[name]):
            for node in ast.parse(block).body:
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Dict):
                    rows.append(ast.literal_eval(node.value))
        assert rows, f"no example row for {name}"
        kinds = set()
        for row in rows:
            info = detect_format([row])
            assert info.name == name, f"{row} is detected as {info.name}, documented as {name}"
            validate([row])
            kinds.add(info.conversational)
        if name not in ("instruction", "sharegpt"):  # string-only / conversation-only formats
            assert kinds == {False, True}, f"{name}: show one standard and one conversational row"


def test_documented_implicit_prompt_split():
    from posttrain.data.formats import implicit_to_explicit_preference

    row = implicit_to_explicit_preference([{"chosen": "Q: 2+2?\nA: 4", "rejected": "Q: 2+2?\nA: 5"}])[0]
    assert row == {"prompt": "Q: 2+2?\nA:", "chosen": " 4", "rejected": " 5"}


# --------------------------------------------------------------------------- migration guide

def test_migration_guide_field_table_names_real_fields():
    import posttrain

    text = (DOCS / "migrating.md").read_text()
    rows = re.findall(r"^\| `(\w+Config)` \| (.+) \|$", text, flags=re.M)
    assert len(rows) >= 8
    missing = []
    for config, cell in rows:
        fields = {f.name for f in dataclasses.fields(getattr(posttrain, config))}
        missing += [f"{config}.{name}" for name in re.findall(r"`(\w+)`", cell) if name not in fields]
    assert not missing, f"docs/migrating.md lists fields that do not exist: {missing}"
    for name in re.findall(r"from posttrain import ([\w, ]+)`", text):
        for cls in name.split(", "):
            assert cls in posttrain.__all__, f"docs/migrating.md: posttrain exports no {cls}"


def test_posttrain_never_imports_trl():
    offenders = [str(p) for p in SOURCE if re.search(r"^\s*(import trl|from trl\b)", p.read_text(), flags=re.M)]
    assert not offenders


@pytest.mark.parametrize("page", ["quickstart.md", "datasets.md", "metrics.md", "debugging.md", "migrating.md",
                                  "config_reference.md"])
def test_doc_pages_exist_and_link_to_existing_pages(page):
    text = (DOCS / page).read_text()
    for target in re.findall(r"docs/([a-z_]+\.md)", text):
        assert (DOCS / target).exists(), f"{page} refers to docs/{target}, which does not exist"
