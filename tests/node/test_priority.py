"""Background priority for waiting zygotes (agent/node/priority.py): a process started by the
workers' preexec at nice 10 keeps it in every thread until :func:`to_normal` sets each back to
0; a process gone is left alone; where nice 0 could not be restored zygotes start at 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent.node import priority
from agent.node.processes import ProcessBackend, _limits

TWO_THREADS = ("import threading, time; threading.Thread(target=time.sleep, args=(60,)).start();"
               " print('ok', flush=True); time.sleep(60)")


@pytest.fixture
def niced():
    proc = subprocess.Popen([sys.executable, "-c", TWO_THREADS], stdout=subprocess.PIPE,
                            text=True, preexec_fn=_limits(None, 10))
    try:
        assert proc.stdout.readline().strip() == "ok"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not priority.can_restore_normal(), reason="needs CAP_SYS_NICE")
def test_every_thread_back_to_nice_zero(niced):
    # os.nice is relative: under a runner already niced (`nice make test`) the worker sits at
    # the runner's nice + 10, capped at 19
    lowered = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    assert list(priority.thread_nices(niced.pid).values()) == [lowered, lowered]
    priority.to_normal(niced.pid)
    assert list(priority.thread_nices(niced.pid).values()) == [0, 0]
    priority.to_normal(niced.pid)           # already normal: nothing to do, no error
    assert os.getpriority(os.PRIO_PROCESS, niced.pid) == 0


def test_a_process_gone_is_left_to_the_restore_call():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(ProcessLookupError):
        priority.thread_nices(proc.pid)
    priority.to_normal(proc.pid)            # no raise: the restore call reports the death


def test_no_lowering_without_a_way_back(tmp_path, monkeypatch):
    monkeypatch.setattr(priority, "can_restore_normal", lambda: False)
    assert ProcessBackend(tmp_path).zygote_nice == 0
    monkeypatch.setattr(priority, "can_restore_normal", lambda: True)
    assert ProcessBackend(tmp_path).zygote_nice == priority.ZYGOTE_NICE
    assert _limits(None, 0) is None


def test_unprivileged_needs_rlimit_or_capability(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(priority.resource, "getrlimit", lambda which: (20, 20))
    assert priority.can_restore_normal()


def test_root_without_cap_sys_nice_cannot_restore_normal(monkeypatch):
    # uid 0 in a container that dropped CAP_SYS_NICE (Docker's default set): setpriority
    # back to 0 is EACCES there, so zygotes must not start at nice 10
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(priority.resource, "getrlimit", lambda which: (0, 0))
    monkeypatch.setattr(priority, "_cap_eff", lambda: 0x1fffeffffff & ~(1 << 23))
    assert not priority.can_restore_normal()
    monkeypatch.setattr(priority, "_cap_eff", lambda: 1 << 23)
    assert priority.can_restore_normal()


def test_an_unlimited_rlimit_nice_is_enough(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(priority, "_cap_eff", lambda: 0)
    inf = priority.resource.RLIM_INFINITY
    monkeypatch.setattr(priority.resource, "getrlimit", lambda which: (inf, inf))
    assert priority.can_restore_normal()
    monkeypatch.setattr(priority.resource, "getrlimit", lambda which: (19, 19))
    assert not priority.can_restore_normal()


class _Worker:
    """A zygote's worker that records its calls (no process)."""

    pid, nice, address, data_address = 4242, priority.ZYGOTE_NICE, "unix:w.sock", None

    def __init__(self):
        self.calls = []

    def call(self, msg, timeout_s):
        self.calls.append(msg["op"])
        return {}


def test_a_zygote_that_cannot_go_back_to_nice_zero_still_restores(tmp_path, monkeypatch, caplog):
    # refused (EPERM/EACCES: a capability dropped after start, a seccomp filter): the restore
    # runs at nice 10, slower, instead of failing and having its valid snapshot discarded
    from agent.node.processes import ProcessZygote

    def refuse(pid):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(priority, "to_normal", refuse)
    worker = _Worker()
    replica = ProcessZygote("cpu", worker, 5.0).restore(tmp_path / "snap", "r-1")
    assert worker.calls == ["restore"] and replica.replica_id == "r-1"
    assert "nice 10" in caplog.text and "4242" in caplog.text


def test_a_thread_started_during_the_renice_is_set_back_too(monkeypatch):
    # thread 1 (nice 10) starts thread 2 after /proc/PID/task was listed: it inherits nice 10
    readings = iter([{1: 10}, {1: 0, 2: 10}, {1: 0, 2: 0}])
    monkeypatch.setattr(priority, "thread_nices", lambda pid: next(readings))
    set_to = []
    monkeypatch.setattr(priority.os, "setpriority", lambda which, tid, n: set_to.append((tid, n)))
    priority.to_normal(77)
    assert set_to == [(1, 0), (2, 0)]


def test_threads_that_keep_appearing_end_after_bounded_passes(monkeypatch, caplog):
    # a zygote starting threads without end must not hold its restore forever: after
    # RENICE_PASSES the restore goes on (logged), as it does when the renice is refused
    tids = iter(range(1, 10_000))
    monkeypatch.setattr(priority, "thread_nices", lambda pid: {next(tids): 10})
    monkeypatch.setattr(priority.os, "setpriority", lambda which, tid, n: None)
    assert priority.to_normal(77) is False
    assert next(tids) == priority.RENICE_PASSES + 1
    assert "77" in caplog.text and f"{priority.RENICE_PASSES} passes" in caplog.text
