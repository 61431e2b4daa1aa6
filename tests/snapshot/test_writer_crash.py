"""Crash (SIGKILL) at random points and a full disk leave no snapshot that looks ready."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from agent.errors import DiskFull
from agent.snapshot import writer
from agent.snapshot.format import MANIFEST_NAME
from agent.snapshot.reader import restore_snapshot
from agent.snapshot.writer import clean_partials

CHILD = r"""
import sys, time, torch
from agent.snapshot.format import ModelIdentity
from agent.snapshot.writer import write_snapshot
data = {f"w{i}": torch.full((1 << 20,), i, dtype=torch.int32) for i in range(8)}   # 32 MiB
print("ready", flush=True)
t = time.perf_counter()
write_snapshot(sys.argv[1], data, model=ModelIdentity("crash", "1", "sha256:0"), chunk_bytes=1 << 16)
print("done", time.perf_counter() - t, flush=True)
"""


def _child(dest):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(dest)], stdout=subprocess.PIPE, text=True)


def _assert_nothing_half_ready(root) -> list:
    """Every directory that looks ready restores and verifies; returns the ready ones."""
    ready = [p for p in root.iterdir() if (p / MANIFEST_NAME).exists() and not p.name.endswith(".partial")]
    for p in ready:
        r = restore_snapshot(p)
        assert torch.equal(r.tensors["w7"], torch.full((1 << 20,), 7, dtype=torch.int32))
    return ready


@pytest.mark.slow
def test_sigkill_at_random_points_leaves_nothing_ready(tmp_path):
    proc = _child(tmp_path / "full")
    assert proc.stdout.readline().strip() == "ready"
    line = proc.stdout.readline().split()
    assert proc.wait(60) == 0 and line[0] == "done"
    write_s = float(line[1])     # spreads the kill points over the write; not a timing assertion
    assert len(_assert_nothing_half_ready(tmp_path)) == 1
    rng = random.Random(20261130)
    killed_partial = 0
    for k in range(8):
        dest = tmp_path / f"s{k}"
        proc = _child(dest)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0, write_s * 1.1))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
        killed_partial += (tmp_path / f"s{k}.partial").exists()
        ready = _assert_nothing_half_ready(tmp_path)
        assert dest in ready or not (dest / MANIFEST_NAME).exists()
    removed = clean_partials(tmp_path)
    assert len(removed) == killed_partial >= 1
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    _assert_nothing_half_ready(tmp_path)


def test_clean_partials_only_removes_partials(tmp_path, make_snapshot):
    path, _ = make_snapshot("keep")
    (tmp_path / "x.partial").mkdir()
    (tmp_path / "x.partial" / "data-00000.bin").write_bytes(b"junk")
    assert clean_partials(tmp_path) == [tmp_path / "x.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]
    assert clean_partials(tmp_path / "missing") == []


def test_stale_partial_is_replaced(tmp_path, make_snapshot, tensors):
    (tmp_path / "snap.partial").mkdir()
    (tmp_path / "snap.partial" / MANIFEST_NAME).write_bytes(b"stale")
    path, _ = make_snapshot()
    assert torch.equal(restore_snapshot(path).tensors["embed"], tensors["embed"])
    assert not (tmp_path / "snap.partial").exists()


def test_disk_full_during_write_names_path_and_leaves_nothing(tmp_path, make_snapshot, monkeypatch):
    calls = {"n": 0}
    real_write = os.write

    def write(fd, data):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(writer.os, "write", write)
    with pytest.raises(DiskFull) as err:
        make_snapshot()
    assert err.value.path == tmp_path / "snap.partial" and "no space" in str(err.value).lower()
    assert err.value.errno is None or isinstance(err.value, OSError)
    assert list(tmp_path.iterdir()) == []


def test_disk_full_before_write_from_free_space(tmp_path, make_snapshot, monkeypatch):
    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(writer.os, "statvfs", lambda p: Full)
    with pytest.raises(DiskFull) as err:
        make_snapshot()
    assert err.value.free_bytes == 40960 and err.value.needed_bytes == 24576
    assert str(tmp_path / "snap.partial") in str(err.value)
    assert list(tmp_path.iterdir()) == []
