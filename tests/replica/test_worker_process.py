"""The worker as a process: ready line, SIGTERM, shutdown, and no process left behind when its
parent dies (PR_SET_PDEATHSIG / parent-pid watchdog)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.replica.worker import call

REPO = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in state  # exited, not yet reaped by its new parent


def _wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


def _zygote_cmd(sock: Path) -> list[str]:
    return [sys.executable, "-m", "agent.cli", "replica", "--zygote", "--buffer-mib", "4",
            "--threads", "1", "--listen", f"unix:{sock}"]


@pytest.mark.slow
def test_zygote_process_answers_then_exits_on_sigterm(tmp_path):
    sock = tmp_path / "z.sock"
    proc = subprocess.Popen(_zygote_cmd(sock), cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] == f"unix:{sock}" and ready["state"] == "zygote"
        assert ready["pid"] == proc.pid
        stats = call(ready["ready"], {"op": "stats", "id": 1}, timeout_s=30)[-1]["result"]
        assert stats["state"] == "zygote" and stats["model"] is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_shutdown_op_ends_the_process(tmp_path):
    sock = tmp_path / "s.sock"
    proc = subprocess.Popen(_zygote_cmd(sock), cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        address = json.loads(proc.stdout.readline())["ready"]
        assert call(address, {"op": "shutdown", "id": 7}, timeout_s=30)[-1]["result"]["state"] == "closed"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_worker_exits_when_its_parent_is_killed(tmp_path):
    sock = tmp_path / "p.sock"
    # The parent is a shell that starts the worker in the background and then waits; SIGKILL
    # gives it no chance to clean up, so only the worker's own parent-death handling remains.
    script = " ".join(f"'{a}'" for a in _zygote_cmd(sock)) + " & wait"
    parent = subprocess.Popen(["sh", "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    worker_pid = None
    try:
        ready = json.loads(parent.stdout.readline())
        worker_pid = ready["pid"]
        assert worker_pid != parent.pid and not _gone(worker_pid)
        parent.kill()
        parent.wait(timeout=10)
        assert _wait_gone(worker_pid), "worker outlived its parent"
    finally:
        if worker_pid is not None and not _gone(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def test_bad_mode_arguments_are_refused():
    from agent.errors import ConfigError
    from agent.replica.worker import run_replica

    with pytest.raises(ConfigError, match="exactly one"):
        run_replica("127.0.0.1:0")
    with pytest.raises(ConfigError, match="exactly one"):
        run_replica("127.0.0.1:0", model_dir="x", snapshot="y")
