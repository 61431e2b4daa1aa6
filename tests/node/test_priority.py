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
