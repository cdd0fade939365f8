"""How many CPU threads posttrain computes with, and how its threads wait: sized to this process's share of
the CPU, so that a busy machine costs a run no more than the share it loses.

PyTorch's intra-op pool (OpenMP, libgomp on Linux) and the decoding kernels (`accel/decode_kernels.c`,
run on the same libgomp team) start one thread per core the process may run on. Two things make a shared
machine (a laptop, a CI runner, a container with a CPU quota, other training jobs) cost far more than the
CPU taken away:

* a CPU quota (cgroup `cpu.max`, or v1's `cpu.cfs_quota_us`) is not counted: a container allowed 2 CPUs of
  a 64-core host starts 64 threads, which the quota then stalls in turn;
* at the end of each parallel region libgomp's threads spin (300,000 spins by default) waiting for the next
  one. A thread that is descheduled because another process holds its core keeps the whole team waiting
  at the barrier, while the spinning threads burn the CPU that the descheduled one needs.

`configure()` therefore sets, unless the user set them: OMP_NUM_THREADS (and torch's thread count) to
`cpu_share()`, the smaller of the affinity mask (`os.sched_getaffinity`) and the quota; and a short spin
(GOMP_SPINCOUNT, `SPIN_COUNT`) before a waiting thread sleeps -- long enough to bridge the microseconds
between the back-to-back regions of a decoding step, short enough that a team waiting for a descheduled
thread gives its cores back. With OMP_WAIT_POLICY or GOMP_SPINCOUNT set, the user's choice stands.
The environment variables take effect only before torch is first imported (libgomp reads them when it
loads): `import posttrain` and the `posttrain` command call `configure()` first; a program that imported
torch earlier gets the thread count (torch.set_num_threads) but not the spin. POSTTRAIN_THREADS=N sets
the thread count outright. `benchmarks/busy_machine.py` measures the effect.

A fixed team is still too many when other processes keep cores busy: with two busy loops beside a 2-thread
run on 2 CPUs, every parallel region waits for whichever thread the scheduler has parked, and a step took
several times as long as alone, far more than a one-thread run lost (benchmarks/README.md, "A busy
machine"). So when a
run starts (`fitted_threads`), posttrain counts the CPUs that other processes keep busy -- the kernel's
runnable tasks (/proc/stat `procs_running`) less this process's own running threads, the lower median of a
few looks -- and trains with the CPUs left free, between 1 and `cpu_share()`. The count is chosen once and
saved in the run's checkpoints, and a resumed run takes the saved count: float sums depend on the thread
count, and a run and its resumption must sum alike. It acts only where those counts mean this process's
CPUs (Linux, an affinity mask of the whole machine), and not when the user fixed the count
(OMP_NUM_THREADS, POSTTRAIN_THREADS) or set POSTTRAIN_FIT_THREADS=0; for figures bit-identical from run to
run whatever the load, fix the count.
"""

from __future__ import annotations

import math
import os
import sys

SPIN_COUNT = "10000"  # libgomp spins before sleeping: about 10-50 µs, against libgomp's default 300,000


def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def _cgroup_dirs(root: str = "/sys/fs/cgroup") -> list[tuple[str, str]]:
    """(cgroup version, folder) where this process's CPU controller files may be, innermost first."""
    found = []
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            found += [("2", os.path.join(root, path.lstrip("/"))), ("2", root)]
        elif "cpu" in controllers.split(","):
            for sub in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                found += [("1", os.path.join(root, sub, path.lstrip("/"))), ("1", os.path.join(root, sub))]
    return found


def cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time the cgroup quota allows this process (cpu.max "200000 100000" -> 2.0), or None."""
    for version, folder in _cgroup_dirs(root):
        if version == "2":
            text = _read(os.path.join(folder, "cpu.max"))
            if text:
                quota, _, period = text.partition(" ")
                return None if quota == "max" else int(quota) / int(period or 100000)
        else:
            quota, period = _read(os.path.join(folder, "cpu.cfs_quota_us")), _read(os.path.join(folder,
                                                                                              "cpu.cfs_period_us"))
            if quota is not None and period:
                return None if int(quota) <= 0 else int(quota) / int(period)
    return None


def cpu_share() -> int:
    """Threads this process can keep busy: the CPUs of its affinity mask, capped by the cgroup quota
    (rounded up: a quota of 1.5 CPUs still runs two threads part of the time); POSTTRAIN_THREADS overrides."""
    if (given := os.environ.get("POSTTRAIN_THREADS", "").strip()).isdigit() and int(given) > 0:
        return int(given)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    return max(1, min(affinity, math.ceil(quota)) if quota else affinity)


def configure() -> int:
    """Size posttrain's threads to `cpu_share()` and shorten the spin of waiting threads, leaving what the
    user set alone (see the module docstring); returns the thread count torch will use."""
    share = cpu_share()
    given = os.environ.get("OMP_NUM_THREADS")  # the user's, unless it is the value posttrain set (a child process)
    user_threads = given is not None and given != os.environ.get("POSTTRAIN_SET_OMP_THREADS")
    if user_threads:
        os.environ["POSTTRAIN_USER_OMP_THREADS"] = "1"  # FitThreads leaves a count the user fixed alone
    if "torch" not in sys.modules:
        if not user_threads:
            os.environ["OMP_NUM_THREADS"] = str(share)
            os.environ["POSTTRAIN_SET_OMP_THREADS"] = str(share)  # child processes: this count is not the user's
        if "OMP_WAIT_POLICY" not in os.environ:
            os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
        return int(os.environ["OMP_NUM_THREADS"]) if os.environ["OMP_NUM_THREADS"].isdigit() else share
    import torch

    if not user_threads and torch.get_num_threads() > share:
        torch.set_num_threads(share)
    return torch.get_num_threads()


def procs_running(stat: str = "/proc/stat") -> int | None:
    """Tasks the kernel counts as runnable right now, over the whole machine; None where unknown."""
    for line in (_read(stat) or "").splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    return None


def own_running(tasks: str = "/proc/self/task") -> int:
    """Threads of this process that are running or runnable (state R)."""
    count = 0
    for tid in os.listdir(tasks) if os.path.isdir(tasks) else ():
        text = _read(os.path.join(tasks, tid, "stat")) or ""
        count += text[text.rfind(")") + 2:text.rfind(")") + 3] == "R"  # the state follows "(comm) "
    return count


def others_running() -> int | None:
    """Runnable tasks of other processes on this machine, or None where /proc cannot say."""
    total = procs_running()
    return None if total is None else max(0, total - own_running())


def fit_wanted() -> bool:
    """Whether a run's thread count may follow the load: Linux, the whole machine in the affinity mask, and no
    count fixed by the user."""
    if os.environ.get("POSTTRAIN_FIT_THREADS", "1").strip() == "0":
        return False
    if os.environ.get("POSTTRAIN_THREADS", "").strip() or os.environ.get("POSTTRAIN_USER_OMP_THREADS"):
        return False
    return (hasattr(os, "sched_getaffinity") and procs_running() is not None
            and len(os.sched_getaffinity(0)) == os.cpu_count())


def fitted_threads(share: int | None = None, cpus: int | None = None, sample=others_running, looks: int = 3,
                   pause: float = 0.02) -> int | None:
    """The thread count for a run starting now: the CPUs other processes leave free (the lower median of
    `looks` readings, `pause` seconds apart, so that one passing process changes nothing), between 1 and
    `share`; None where the readings are unknown."""
    import statistics
    import time

    share, cpus = share or cpu_share(), cpus or len(os.sched_getaffinity(0))
    seen = []
    for i in range(looks):
        if (others := sample()) is None:
            return None
        seen.append(others)
        if i + 1 < looks:
            time.sleep(pause)
    return max(1, min(share, cpus - statistics.median_low(seen)))
