"""Hostile data files and a hostile total_bytes: every case fails with a typed error naming the
path, before any buffer is allocated, and never blocks (FIFO) or follows a symlink."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from agent import _restore
from agent.errors import SnapshotCorrupt, SnapshotNotFound
from agent.snapshot import format as fmt
from agent.snapshot import reader
from agent.snapshot.manifest import read_manifest
from agent.snapshot.reader import restore_snapshot, verify_chunks
from agent.snapshot.writer import DATA_NAME
from tests.snapshot.blocking import with_timeout


def _rewrite_body(path, mutate) -> None:
    """Edit the manifest body and recompute its SHA-256 (an unsigned snapshot cannot tell)."""
    env = msgpack.unpackb((path / fmt.MANIFEST_NAME).read_bytes(), raw=False)
    body = msgpack.unpackb(env["body"], raw=False)
    mutate(body)
    env["body"] = msgpack.packb(body, use_bin_type=True)
    env["sha256"] = hashlib.sha256(env["body"]).digest()
    (path / fmt.MANIFEST_NAME).write_bytes(msgpack.packb(env, use_bin_type=True))


@pytest.fixture
def no_alloc(monkeypatch):
    """Call it to make any later HostBuffer allocation fail the test."""
    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"HostBuffer.allocate{args} called before the data files were checked")
    return lambda: monkeypatch.setattr(reader.HostBuffer, "allocate", classmethod(refuse))


def _both(path, manifest=None):
    """The errors of restore_snapshot and of read_manifest + verify_chunks on ``path``."""
    errors = []
    with pytest.raises(SnapshotCorrupt) as err:
        restore_snapshot(path)
    errors.append(err.value)
    with pytest.raises(SnapshotCorrupt) as err:
        verify_chunks(path, manifest or read_manifest(path))
    errors.append(err.value)
    return errors


@pytest.mark.parametrize("total", [1 << 40, 1 << 62], ids=["1TiB", "2^62"])
def test_huge_total_bytes_is_refused_before_allocating(make_snapshot, no_alloc, total):
    path, manifest = make_snapshot()
    size = (path / DATA_NAME).stat().st_size

    def grow(body):                     # the last chunk covers the rest: the layout stays valid
        body["chunks"][-1][2] += total - body["total_bytes"]
        body["total_bytes"] = total
    _rewrite_body(path, grow)
    no_alloc()
    for err in _both(path):
        assert err.total_bytes == total and err.on_disk_bytes == size
        assert f"total_bytes {total}" in str(err) and f"on disk {size} bytes" in str(err)
        assert err.chunk == len(manifest.chunks) - 1 and err.actual == size


def test_total_bytes_over_the_files_is_refused_even_for_an_unvalidated_manifest(make_snapshot, no_alloc):
    # A Manifest built in code skips validation: many chunks re-reading the file's first page
    # add up to far more than the file holds.
    path, manifest = make_snapshot()
    size = (path / DATA_NAME).stat().st_size
    n = 1 << 16
    chunks = [fmt.ChunkEntry(DATA_NAME, 0, fmt.ALIGN, i * fmt.ALIGN, 0) for i in range(n)]
    hostile = dataclasses.replace(manifest, chunks=chunks, total_bytes=n * fmt.ALIGN)
    no_alloc()
    with pytest.raises(SnapshotCorrupt) as err:
        verify_chunks(path, hostile)
    assert err.value.actual == n * fmt.ALIGN and err.value.expected == size
    assert err.value.on_disk_bytes == size and "total_bytes" in str(err.value)


def _unblock(fifo):
    def unblock():
        for _ in range(3):          # one writer open per blocked reader open
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    return unblock


@pytest.mark.parametrize("op", ["restore", "verify", "restore-direct", "page-cache-share"])
def test_data_fifo_is_refused_without_blocking(make_snapshot, op):
    path, manifest = make_snapshot()
    data = path / DATA_NAME
    data.unlink()
    os.mkfifo(data)
    call = {"restore": lambda: restore_snapshot(path),
            "restore-direct": lambda: restore_snapshot(path, direct=True),
            "verify": lambda: verify_chunks(path, manifest),
            "page-cache-share": lambda: reader.page_cache_share(path, manifest) == 0.0 or 1 / 0}[op]
    err = with_timeout(call, unblock=_unblock(data))
    if op == "page-cache-share":
        assert err is None          # a heuristic: the FIFO counts as not cached
        return
    assert isinstance(err, SnapshotCorrupt) and err.path == data and err.actual == "a FIFO"
    assert "not a regular file" in str(err) and err.chunk == len(manifest.chunks) - 1


def test_resident_fraction_refuses_a_fifo_without_blocking(tmp_path):
    # In a subprocess: a blocking open here would hold the GIL, so a thread could not time out.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = ("import sys; from agent import _restore\n"
            "try:\n    _restore.resident_fraction(sys.argv[1])\n"
            "except OSError as e:\n    print('OSError', e)\n")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True, text=True,
                             timeout=30, cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        pytest.fail("resident_fraction blocked on a FIFO")
    assert out.stdout.startswith("OSError") and "not a regular file" in out.stdout, out.stderr


def test_resident_fraction_of_an_open_descriptor(make_snapshot):
    path, _ = make_snapshot()
    (path / DATA_NAME).read_bytes()
    fd = os.open(path / DATA_NAME, os.O_RDONLY)
    try:
        assert _restore.resident_fraction(fd) == 1.0
        os.fstat(fd)                # still open: the caller's descriptor is not closed
    finally:
        os.close(fd)


def test_data_directory_is_refused(make_snapshot):
    path, manifest = make_snapshot()
    (path / DATA_NAME).unlink()
    (path / DATA_NAME).mkdir()
    for err in _both(path, manifest):
        assert err.path == path / DATA_NAME and err.actual == "a directory"


@pytest.mark.parametrize("target", ["loop", "devzero", "real"])
def test_data_symlink_is_refused(make_snapshot, tmp_path, target):
    # Policy: data files must be regular files in the snapshot directory; a symlink, even to
    # the right bytes, is refused, so a chunk's plain file name confines reads to the directory.
    path, manifest = make_snapshot()
    data = path / DATA_NAME
    real = tmp_path / "elsewhere.bin"
    real.write_bytes(data.read_bytes())
    data.unlink()
    os.symlink({"loop": DATA_NAME, "devzero": "/dev/zero", "real": str(real)}[target], data)
    for err in _both(path, manifest):
        assert err.path == data and "symbolic link" in str(err)
        assert err.chunk == len(manifest.chunks) - 1


def test_snapshot_path_that_is_a_file(make_snapshot, tmp_path):
    path, manifest = make_snapshot()
    other = tmp_path / "plain-file"
    other.write_bytes(b"x")
    with pytest.raises(SnapshotNotFound, match="not a directory"):
        restore_snapshot(other)
    with pytest.raises(SnapshotNotFound, match="not a directory") as err:
        verify_chunks(other, manifest)
    assert err.value.path == other
