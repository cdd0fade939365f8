"""One run per output_dir: an flock on the folder itself for the run's lifetime (see trainers/guards.py, which
exports these names). Standard library only, so that a process that only locks (or a test's helper process)
starts in a fraction of a second."""

from __future__ import annotations

import contextlib
import os

try:
    import fcntl
except ImportError:  # Windows: output_dir is not locked
    fcntl = None


class OutputDirInUseError(RuntimeError):
    """Another live run holds the output_dir's lock."""


_held_locks: dict[str, list] = {}  # real path of an output_dir -> [lock file, depth]: re-entrant in a process


def _lock_holder(fd: int) -> str:
    """'pid N' of the process holding a flock on the file of `fd`, from /proc/locks (Linux); else 'a process'."""
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError):
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if "FLOCK" in parts and device in parts:
                    return f"pid {parts[parts.index(device) - 1]}"
    return "a process"


@contextlib.contextmanager
def output_dir_lock(folder: str):
    """Hold an exclusive lock on the folder `folder` itself (flock on its directory: no file is written) for the
    block; another run into the same folder is refused, naming the holder. The kernel lets go of a lock when
    its process dies, so a killed run's lock is never stale. Re-entrant within one process; without fcntl
    (Windows) no lock is taken."""
    key = os.path.realpath(folder)
    if fcntl is None or key in _held_locks:
        if key in _held_locks:
            _held_locks[key][1] += 1
        try:
            yield
        finally:
            if key in _held_locks:
                _held_locks[key][1] -= 1
        return
    os.makedirs(folder, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise OutputDirInUseError(
            f"output_dir {folder} is in use by another run ({holder}): two runs writing into one folder replace "
            "each other's checkpoints and model. Wait for that run to end, stop it, or choose another "
            "output_dir") from None
    _held_locks[key] = [fd, 1]
    try:
        yield
    finally:
        _held_locks[key][1] -= 1
        if _held_locks[key][1] == 0:
            del _held_locks[key]
            os.close(fd)  # lets go of the lock
