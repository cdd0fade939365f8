"""Multi-process launches (torchrun, accelerate launch) from tests: a free port and one runner."""

import os
import socket
import subprocess


def free_port() -> int:
    """A TCP port free on this machine now, for the launch's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launch(cmd: list, cwd, *, timeout: float = 240, path: str | None = None, **env) -> None:
    """Run a launch command offline with one thread per process and assert it exits 0 (its output's tail is the
    message). A collective that one rank never joins hangs: the timeout turns that into a failure. `path`: a
    folder put first on PYTHONPATH (the worker scripts' own); `env`: more environment variables."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **env}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([path, os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

