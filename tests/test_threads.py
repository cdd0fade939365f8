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
                                                              "POSTTRAIN_THREADS", "POSTTRAIN_SET_OMP_THREADS",
                                                              "POSTTRAIN_USER_OMP_THREADS")}
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


def test_running_tasks_are_read_from_proc(tmp_path):
    (tmp_path / "stat").write_text("cpu  1 2 3\nprocs_running 5\nprocs_blocked 0\n")
    assert threads.procs_running(str(tmp_path / "stat")) == 5
    assert threads.procs_running(str(tmp_path / "missing")) is None
    tasks = tmp_path / "task"
    for tid, state in (("10", "R"), ("11", "S"), ("12", "R")):
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "stat").write_text(f"{tid} (py (worker) 1) {state} 1 2 3\n")  # a name with ") " in it
    assert threads.own_running(str(tasks)) == 2


def test_fitted_threads_leave_the_cpus_others_keep_busy():
    looks = iter([3, 0, 3])
    assert threads.fitted_threads(share=4, cpus=4, sample=lambda: next(looks), pause=0) == 1  # lower median 3
    looks = iter([0, 3, 0])
    assert threads.fitted_threads(share=4, cpus=4, sample=lambda: next(looks), pause=0) == 4  # one busy look: none
    assert threads.fitted_threads(share=2, cpus=4, sample=lambda: 0, pause=0) == 2  # never above the share
    assert threads.fitted_threads(share=4, cpus=4, sample=lambda: 9, pause=0) == 1  # never below one thread
    assert threads.fitted_threads(share=4, cpus=4, sample=lambda: None, pause=0) is None  # no reading


def test_fit_stays_off_where_the_count_is_fixed(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_FIT_THREADS", "1")
    monkeypatch.delenv("POSTTRAIN_THREADS", raising=False)
    monkeypatch.delenv("POSTTRAIN_USER_OMP_THREADS", raising=False)
    monkeypatch.setattr(threads, "procs_running", lambda: 3)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert threads.fit_wanted()
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # a slice of a larger machine: the host's count says nothing
    assert not threads.fit_wanted()
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for name, value in (("POSTTRAIN_FIT_THREADS", "0"), ("POSTTRAIN_THREADS", "2"), ("POSTTRAIN_USER_OMP_THREADS", "1")):
        monkeypatch.setenv(name, value)
        assert not threads.fit_wanted(), name
        monkeypatch.delenv(name)


def test_a_run_keeps_its_fitted_count_when_resumed(tmp_path, monkeypatch):
    """The count chosen at the start is saved with each checkpoint; a resumed run takes it whatever the load."""
    import torch

    from posttrain import SFTConfig, SFTTrainer
    from posttrain.tasks.builtin import task_dataset

    monkeypatch.setenv("POSTTRAIN_FIT_THREADS", "1")
    monkeypatch.setattr(threads, "fit_wanted", lambda: True)
    before = torch.get_num_threads()
    args = dict(output_dir=str(tmp_path), max_steps=2, save_strategy="steps", save_steps=1, per_device_train_batch_size=2,
                report_to="none",
                disable_tqdm=True, learning_rate=1e-3)
    data = task_dataset("reverse", "train", size=8)
    try:
        monkeypatch.setattr(threads, "fitted_threads", lambda: 1)  # busy when the run starts
        trainer = SFTTrainer("posttrain/tiny-qwen2", args=SFTConfig(**args), train_dataset=data)
        trainer.train()
        assert trainer.run_threads == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setattr(threads, "fitted_threads", lambda: 2)  # idle when it resumes
        resumed = SFTTrainer("posttrain/tiny-qwen2", args=SFTConfig(**{**args, "max_steps": 3}), train_dataset=data)
        resumed.train(resume_from_checkpoint=True)
        assert resumed.run_threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
