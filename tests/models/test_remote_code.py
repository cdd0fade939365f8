"""A model folder that ships custom code is never run, and never brings transformers' interactive
"run the custom code? [y/N]" prompt: trust_remote_code=False is passed unless the user set it."""

import builtins
import json
import sys

import pytest

from posttrain.models import loading


class Spy:
    calls: list[dict] = []

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        cls.calls.append(kwargs)
        return object()


def test_trust_remote_code_false_is_passed_unless_set(tmp_path):
    Spy.calls.clear()
    loading._from_pretrained(Spy, str(tmp_path))
    loading._from_pretrained(Spy, str(tmp_path), trust_remote_code=True)
    assert [c["trust_remote_code"] for c in Spy.calls] == [False, True]


def test_a_folder_with_custom_code_loads_without_running_it_or_prompting(tmp_path, monkeypatch):
    import shutil

    from posttrain.models.tiny import tiny_model_path

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path("tiny-qwen2", "causal-lm"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text("raise SystemExit('custom code ran')\n")
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)

    def no_prompt(*args, **kwargs):
        raise AssertionError("transformers prompted on the terminal")

    monkeypatch.setattr(builtins, "input", no_prompt)
    model = loading.load_causal_lm(str(folder))  # the architecture transformers knows, not the shipped code
    assert type(model).__name__ == "Qwen2ForCausalLM"
