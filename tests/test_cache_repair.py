"""A damaged cache entry (a truncated built-in model, a truncated compiled kernel) is found when next used and
built again, instead of failing every run that uses it."""

import json
import shutil

import pytest

from posttrain import cache
from posttrain.accel import few_rows


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_truncated_builtin_model_is_rebuilt(own_cache, caplog):
    from posttrain.models.loading import load_causal_lm
    from posttrain.models.tiny import tiny_model_path

    folder = tiny_model_path("tiny-llama", "causal-lm")
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level("WARNING", logger="posttrain"):
        again = tiny_model_path("tiny-llama", "causal-lm")
    assert again == folder and weights.stat().st_size == size
    assert "is damaged (model.safetensors is" in caplog.text and "building it again" in caplog.text
    assert load_causal_lm(str(again)) is not None


def test_a_cut_json_file_is_damage_too(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qw')
    assert "config.json cannot be read" in cache.damage(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert cache.damage(tmp_path) is None


@pytest.mark.skipif(shutil.which("cc") is None or not few_rows._cpu_has_avx2_fma(), reason="no compiler/AVX2")
def test_a_truncated_compiled_kernel_is_compiled_again(own_cache, monkeypatch):
    import os
    import subprocess
    import sys

    monkeypatch.delenv("POSTTRAIN_NO_KERNELS", raising=False)
    load = [sys.executable, "-c", "from posttrain.accel import few_rows; print(few_rows.kernels() is not None)"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}  # a fresh process: dlopen has not seen the library
    assert subprocess.run(load, capture_output=True, text=True, env=env).stdout.strip() == "True"
    (library,) = (own_cache / "kernels").glob("decode_kernels-*.so")
    size = library.stat().st_size
    with open(library, "r+b") as f:
        f.truncate(100)
    done = subprocess.run(load, capture_output=True, text=True, env=env)
    assert done.stdout.strip() == "True" and library.stat().st_size == size
    assert "cannot be loaded" in done.stderr and "compiling them again" in done.stderr
