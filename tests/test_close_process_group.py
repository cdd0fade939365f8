"""The end of a multi-process run: `cli.close_process_group` joins the gloo threads of the process group,
and `cli.end_process` exits with the run's code (through os._exit only where a group outlived the close)."""

import json
import os
import sys

import pytest
from posttrain import cli
from tests.helpers.launch import free_port, run_launch

SCRIPT = os.path.join(os.path.dirname(__file__), "close_group_run.py")
GLOO_THREADS = {"pt_gloo_runloop", "gloo_tcp_loop"}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from /proc (Linux)")
@pytest.mark.parametrize("close", ["close", "destroy"])
def test_close_process_group_joins_the_gloo_threads(tmp_path, close):
    out = str(tmp_path / "threads.json")
    run_launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), SCRIPT, out, close], tmp_path, timeout=120)
    for rank in (0, 1):
        threads = json.load(open(f"{out}.{rank}"))
        assert GLOO_THREADS <= set(threads["before"])
        # torch's destroy_process_group alone leaves them running: the group is still referenced
        assert (GLOO_THREADS & set(threads["after"])) == (set() if close == "close" else GLOO_THREADS)
        assert threads["alive_after"] == (close == "destroy")  # what end_process reads


def test_end_process_is_sys_exit_without_group_threads(monkeypatch):
    monkeypatch.setattr(cli, "_group_threads_alive", lambda: False)
    monkeypatch.setattr(os, "_exit", lambda code: pytest.fail("os._exit without surviving group threads"))
    with pytest.raises(SystemExit) as exit_:
        cli.end_process(3)
    assert exit_.value.code == 3


def test_end_process_does_the_exit_work_then_os_exit(monkeypatch, capsys):
    import atexit
    import threading

    calls = []
    monkeypatch.setattr(cli, "_group_threads_alive", lambda: True)
    monkeypatch.setattr(threading, "_shutdown", lambda: calls.append("threads joined"))
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: calls.append("atexit"))
    monkeypatch.setattr(sys.stdout, "flush", lambda: calls.append("stdout flushed"), raising=False)

    class Exited(Exception):
        pass

    def fake_exit(code):
        calls.append(("os._exit", code))
        raise Exited

    monkeypatch.setattr(os, "_exit", fake_exit)
    with pytest.raises(Exited):
        cli.end_process(0)
    assert calls == ["threads joined", "atexit", "stdout flushed", ("os._exit", 0)]

