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



def joined(*jobs: list) -> list:
    """Several jobs' arguments as one worker command line (tests/trainers/worker_jobs.py): "+" between them."""
    return [str(word) for job in jobs for word in ["+", *job]][1:]


def accelerate_on_two(script: str) -> list:
    """`accelerate launch` of a worker script on 2 processes: the torch.distributed launcher (`--multi_gpu`;
    `--cpu --num_processes 2` starts one process unless MPI is installed), the script putting the run on the CPU
    (`use_cpu=True`) with gloo."""
    import sys

    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), script]
