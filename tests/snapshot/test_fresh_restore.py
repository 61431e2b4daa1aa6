"""A fresh process's restore: the locked private map, the anonymous-copy fallback with
populate-ahead, and the ext/ helpers they use (populate, hash_ranges, lock_memory)."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from agent import _restore
from agent.errors import SnapshotCorrupt
from agent.snapshot import reader
from agent.snapshot.reader import HostBuffer, restore_snapshot
from agent.snapshot.writer import DATA_NAME


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _drop(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


@pytest.mark.parametrize("cold", [False, True])
def test_fresh_restore_is_a_locked_map_with_every_chunk_verified(make_snapshot, tensors, cold):
    path, manifest = make_snapshot()
    if cold:
        _drop(path / DATA_NAME)
    r = restore_snapshot(path)
    assert r.stats.mode == "map" and r.buffer.locked and r.stats.verified
    assert r.stats.chunks == len(manifest.chunks) == 3 and r.stats.bytes == manifest.total_bytes
    for k, v in tensors.items():
        assert torch.equal(r.tensors[k], v) and r.tensors[k].dtype == v.dtype
    assert _restore.resident_fraction(path / DATA_NAME) == 1.0   # faulted in, and locked


def test_writing_a_mapped_tensor_copies_the_page_and_leaves_the_file(make_snapshot, tensors):
    path, manifest = make_snapshot()
    before = (path / DATA_NAME).read_bytes()
    r = restore_snapshot(path)
    r.tensors["ids"].fill_(-1)                                   # copy-on-write
    assert bool((r.tensors["ids"] == -1).all())
    assert (path / DATA_NAME).read_bytes() == before
    again = restore_snapshot(path)
    assert torch.equal(again.tensors["ids"], tensors["ids"])


@pytest.mark.parametrize("copy", ["auto", True])
def test_flipped_byte_is_caught_on_both_fresh_paths(make_snapshot, copy):
    path, manifest = make_snapshot()
    for i, c in enumerate(manifest.chunks):
        at = c.offset + c.length // 2
        _flip(path / DATA_NAME, at)
        with pytest.raises(SnapshotCorrupt) as err:
            restore_snapshot(path, copy=copy)
        e = err.value
        assert e.chunk == i and e.chunks == [i] and e.expected == f"{c.checksum:016x}" and e.actual != e.expected
        _flip(path / DATA_NAME, at)
    assert restore_snapshot(path, copy=copy).stats.mode == ("map" if copy == "auto" else "copy")


def test_unverified_map_still_faults_every_byte_in(make_snapshot, tensors):
    path, _ = make_snapshot()
    _drop(path / DATA_NAME)
    r = restore_snapshot(path, verify=False)
    assert r.stats.mode == "map" and not r.stats.verified
    assert torch.equal(r.tensors["embed"], tensors["embed"])


def test_refused_lock_falls_back_to_the_anonymous_copy(make_snapshot, tensors, monkeypatch):
    path, _ = make_snapshot()

    def refuse(buf, lock=True, onfault=False):
        raise OSError(12, "mlock: over RLIMIT_MEMLOCK")
    monkeypatch.setattr(reader._restore, "lock_memory", refuse)
    r = restore_snapshot(path)
    assert r.stats.mode == "copy" and not r.buffer.locked
    assert all(torch.equal(r.tensors[k], v) for k, v in tensors.items())


def test_layout_other_than_one_identity_file_is_copied(make_snapshot, monkeypatch):
    path, manifest = make_snapshot()
    fds = {DATA_NAME: (-1, 0)}
    assert reader._mappable(manifest, fds)
    assert not reader._mappable(manifest, {**fds, "data-00001.bin": (-1, 1)})
    shifted = manifest.chunks[1].__class__(**{**vars(manifest.chunks[1]), "buffer_offset": 0})
    odd = manifest.__class__(**{**vars(manifest), "chunks": [manifest.chunks[0], shifted]})
    assert not reader._mappable(odd, fds)
    assert restore_snapshot(path, direct=False).stats.mode == "copy"   # an explicit direct reads


@pytest.mark.parametrize("huge", [False, True])
def test_copy_into_huge_or_small_pages_restores_the_same_bytes(make_snapshot, tensors, monkeypatch, huge):
    path, manifest = make_snapshot()
    asked = []
    real = HostBuffer.allocate.__func__

    def allocate(cls, nbytes, **kw):
        asked.append(kw.get("huge"))
        return real(cls, nbytes, **kw)
    monkeypatch.setattr(HostBuffer, "allocate", classmethod(allocate))
    _drop(path / DATA_NAME)
    r = restore_snapshot(path, copy=True, huge=huge)
    assert r.stats.mode == "copy" and r.stats.verified and asked == [huge]
    assert all(torch.equal(r.tensors[k], v) for k, v in tensors.items())
    _flip(path / DATA_NAME, manifest.chunks[-1].offset + 7)
    with pytest.raises(SnapshotCorrupt) as err:
        restore_snapshot(path, copy=True, huge=huge)
    assert err.value.chunk == len(manifest.chunks) - 1


def test_buffer_given_is_read_into_as_before(make_snapshot, tensors):
    path, manifest = make_snapshot()
    buf = HostBuffer.allocate(manifest.total_bytes, prefault=True)
    r = restore_snapshot(path, buffer=buf)
    assert r.stats.mode == "buffer" and r.buffer is buf and not buf.locked
    assert torch.equal(r.tensors["proj"], tensors["proj"])


def test_read_chunks_populate_ahead_fills_fresh_memory_identically(make_snapshot):
    path, manifest = make_snapshot()
    fd = os.open(path / DATA_NAME, os.O_RDONLY)
    try:
        jobs = [(-1, fd, c.offset, c.length, c.buffer_offset, c.checksum) for c in manifest.chunks]
        buf = HostBuffer.allocate(manifest.total_bytes)
        res = _restore.read_chunks(buf.memory, jobs, 2, True, 4096, True)
        populated, err = _restore.last_populated()
    finally:
        os.close(fd)
    assert [r[3] for r in res] == [c.checksum for c in manifest.chunks] and err == 0
    assert 0 <= populated <= buf.capacity_bytes and populated % 4096 == 0
    assert bytes(buf.memory[:manifest.total_bytes]) == (path / DATA_NAME).read_bytes()[:manifest.total_bytes]


def test_hash_ranges_values_and_limits():
    data = bytearray(os.urandom(3 * 65536 + 100))
    ranges = [(0, 65536), (65536, 100), (70000, 3 * 65536 - 70000 + 100), (5, 0)]
    for fault in ("none", "read"):
        hashes, errs = _restore.hash_ranges(data, ranges, 3, "none", fault, 4096)
        assert hashes == [_restore.xxh3_64(bytes(data[o:o + n])) for o, n in ranges] and errs == [0] * 4
    hashes, errs = _restore.hash_ranges(data, ranges, 2, "none", "none", 4096, False)
    assert hashes == [0] * 4
    with pytest.raises(ValueError, match="outside buffer"):
        _restore.hash_ranges(data, [(len(data) - 1, 2)])
    with pytest.raises(ValueError, match="threads=0"):
        _restore.hash_ranges(data, ranges, 0)
    with pytest.raises(ValueError, match="willneed"):
        _restore.hash_ranges(data, ranges, 2, "none", "willneed")
    with pytest.raises(ValueError, match="multiple of 4096"):
        _restore.hash_ranges(data, ranges, 2, "none", "none", 1000)


def test_populate_and_file_map_faults(tmp_path):
    m = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    assert _restore.populate(m) == 1 << 20 and _restore.populate(m, True, 4096, 4096) == 4096
    with pytest.raises(ValueError, match="outside buffer"):
        _restore.populate(m, True, 0, (1 << 20) + 1)
    f = tmp_path / "f.bin"
    payload = os.urandom(5 * 4096)
    f.write_bytes(payload)
    fd = os.open(f, os.O_RDONLY)
    try:
        fm = mmap.mmap(fd, len(payload), flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        for fault, ahead in (("read", "willneed"), ("write", "read"), ("none", "write")):
            hashes, errs = _restore.hash_ranges(fm, [(0, 4096), (4096, 4 * 4096)], 2, ahead, fault, 4096)
            assert hashes == [_restore.xxh3_64(payload[:4096]), _restore.xxh3_64(payload[4096:])] and errs == [0, 0]
        _restore.lock_memory(fm, onfault=True)
        _restore.lock_memory(fm, lock=False)
        fm.close()
    finally:
        os.close(fd)


def test_unmappable_file_falls_back_to_the_copy(make_snapshot, tensors, monkeypatch):
    path, _ = make_snapshot()
    real = mmap.mmap

    def no_file_maps(fd, *a, **kw):
        if fd != -1:
            raise OSError(19, "No such device")
        return real(fd, *a, **kw)
    monkeypatch.setattr(reader.mmap, "mmap", no_file_maps)
    r = restore_snapshot(path)
    assert r.stats.mode == "copy" and torch.equal(r.tensors["norm"], tensors["norm"])
