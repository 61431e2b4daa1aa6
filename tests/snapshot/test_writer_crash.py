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

# Imports torch once, then forks one writer per destination read from stdin and prints its
# pid; on the next line ("reap") it waits for that writer and prints "exit <status> <write
# seconds or ->".  Reaping only when told keeps the pid valid (a zombie) until the test has
# sent its SIGKILL.  torch runs single-threaded so that forking is safe.
DRIVER = r"""
import os, sys, time, torch
torch.set_num_threads(1)
from agent.snapshot.format import ModelIdentity
from agent.snapshot.writer import write_snapshot
data = {f"w{i}": torch.full((1 << 20,), i, dtype=torch.int32) for i in range(8)}   # 32 MiB
print("ready", flush=True)
for line in sys.stdin:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        t = time.perf_counter()
        write_snapshot(line.strip(), data, model=ModelIdentity("crash", "1", "sha256:0"), chunk_bytes=1 << 16)
        os.write(w, str(time.perf_counter() - t).encode())
        os._exit(0)
    os.close(w)
    print(pid, flush=True)
    sys.stdin.readline()
    _, status = os.waitpid(pid, 0)
    print("exit", status, os.read(r, 64).decode() or "-", flush=True)
    os.close(r)
"""


def _assert_nothing_half_ready(root) -> list:
    """Every directory that looks ready restores and verifies; returns the ready ones."""
    ready = [p for p in root.iterdir() if (p / MANIFEST_NAME).exists() and not p.name.endswith(".partial")]
    for p in ready:
        r = restore_snapshot(p)
        assert torch.equal(r.tensors["w7"], torch.full((1 << 20,), 7, dtype=torch.int32))
    return ready


@pytest.mark.slow
def test_sigkill_at_random_points_leaves_nothing_ready(tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert driver.stdout.readline().strip() == "ready"

        def start(dest) -> int:
            driver.stdin.write(f"{dest}\n")
            driver.stdin.flush()
            return int(driver.stdout.readline())

        def reap() -> list[str]:
            driver.stdin.write("reap\n")
            driver.stdin.flush()
            return driver.stdout.readline().split()

        start(tmp_path / "full")
        _, status, seconds = reap()
        assert status == "0"
        write_s = float(seconds)   # spreads the kill points over a write; not a timing assertion
        assert len(_assert_nothing_half_ready(tmp_path)) == 1
        rng = random.Random(20261130)
        killed_partial = 0
        for k in range(8):
            dest = tmp_path / f"s{k}"
            pid = start(dest)
            time.sleep(rng.uniform(0, write_s * 1.1))
            os.kill(pid, signal.SIGKILL)
            assert reap()[0] == "exit"
            killed_partial += (tmp_path / f"s{k}.partial").exists()
            ready = _assert_nothing_half_ready(tmp_path)
            assert dest in ready or not (dest / MANIFEST_NAME).exists()
    finally:
        driver.stdin.close()
        driver.wait(60)
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
