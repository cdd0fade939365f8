"""posttrain sizes its threads to the CPU share (affinity, cgroup quota) and keeps one OpenMP pool with a
short spin (posttrain/accel/threads.py, issue #34)."""

import json
import os
import subprocess
import sys

import pytest

from posttrain.accel import threads


def fake_cgroup(monkeypatch, tmp_path, proc_cgroup: str, files: dict[str, str]):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    real = threads._read
    monkeypatch.setattr(threads, "_read", lambda path: proc_cgroup if path == "/proc/self/cgroup" else real(path))


def test_quota_from_cgroup_v2_and_v1(monkeypatch, tmp_path):
    fake_cgroup(monkeypatch, tmp_path / "v2", "0::/job\n", {"job/cpu.max": "150000 100000\n"})
    assert threads.cpu_quota(str(tmp_path / "v2")) == 1.5
    fake_cgroup(monkeypatch, tmp_path / "none", "0::/job\n", {"job/cpu.max": "max 100000\n"})
    assert threads.cpu_quota(str(tmp_path / "none")) is None
    fake_cgroup(monkeypatch, tmp_path / "v1", "3:cpu,cpuacct:/ci\n",
                {"cpu,cpuacct/ci/cpu.cfs_quota_us": "300000", "cpu,cpuacct/ci/cpu.cfs_period_us": "100000"})
    assert threads.cpu_quota(str(tmp_path / "v1")) == 3.0
    fake_cgroup(monkeypatch, tmp_path / "v1u", "3:cpu:/\n",
                {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "1"})
    assert threads.cpu_quota(str(tmp_path / "v1u")) is None


def test_share_is_affinity_capped_by_quota(monkeypatch):
    monkeypatch.delenv("POSTTRAIN_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "cpu_quota", lambda: 1.5)
    assert threads.cpu_share() == 2
    monkeypatch.setattr(threads, "cpu_quota", lambda: None)
    assert threads.cpu_share() == 4
    monkeypatch.setenv("POSTTRAIN_THREADS", "3")
    assert threads.cpu_share() == 3


def configured_env(env: dict) -> dict:
    """OMP_NUM_THREADS, GOMP_SPINCOUNT and torch's thread count in a fresh `import posttrain; import torch`."""
    code = ("import os, posttrain, torch; print(__import__('json').dumps({k: os.environ.get(k) for k in "
            "('OMP_NUM_THREADS', 'GOMP_SPINCOUNT')} | {'torch': torch.get_num_threads()}))")
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY",
                                                              "POSTTRAIN_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_posttrain_sets_threads_and_a_short_spin_unless_the_user_did():
    assert configured_env({"POSTTRAIN_THREADS": "1"}) == {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": threads.SPIN_COUNT,
                                                          "torch": 1}
    assert configured_env({"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "active"}) == \
        {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": None, "torch": 1}
    assert configured_env({})["torch"] == threads.cpu_share()


def test_the_decoding_kernels_share_torchs_openmp_runtime():
    from posttrain.accel import few_rows

    if few_rows.kernels() is None:
        pytest.skip("no C compiler or no AVX2/FMA here: decoding runs through torch alone")
    import torch  # noqa: F401

    runtimes = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes
