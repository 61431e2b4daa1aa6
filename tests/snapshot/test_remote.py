"""The zstd remote tier: push, resumable stage, and strict frame checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import zstandard

from agent.errors import SnapshotCorrupt, SnapshotTampered
from agent.snapshot import remote
from agent.snapshot.format import MANIFEST_NAME
from agent.snapshot.manifest import encode_manifest, read_manifest
from agent.snapshot.reader import restore_snapshot
from agent.snapshot.writer import DATA_NAME

ZST = DATA_NAME + ".zst"


def test_push_and_stage_round_trip(tmp_path, make_snapshot, tensors):
    src, manifest = make_snapshot(key=b"k")
    rdir = remote.push(src, tmp_path / "remote", key=b"k")
    rm = read_manifest(rdir, b"k")
    assert all(c.compressed_length and c.compressed_offset is not None for c in rm.chunks)
    seen = []
    local = remote.stage(rdir, tmp_path / "staged", lambda d, t: seen.append((d, t)), key=b"k")
    assert seen[-1] == (manifest.total_bytes, manifest.total_bytes) and len(seen) == len(manifest.chunks)
    assert local.chunks == manifest.chunks and local.tensors == manifest.tensors
    out = restore_snapshot(tmp_path / "staged", key=b"k").tensors
    assert all(torch.equal(out[k], v) for k, v in tensors.items())
    assert not (tmp_path / "staged.partial").exists()


def test_stage_resumes_after_interruption(tmp_path, make_snapshot, monkeypatch):
    src, manifest = make_snapshot()
    rdir = remote.push(src, tmp_path / "remote")

    def stop_after_two(done, total):
        if done >= 2 * 8192:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        remote.stage(rdir, tmp_path / "staged", stop_after_two)
    assert (tmp_path / "staged.partial").exists() and not (tmp_path / "staged").exists()
    calls = []
    real = remote.decompress_chunk
    monkeypatch.setattr(remote, "decompress_chunk", lambda *a: calls.append(1) or real(*a))
    remote.stage(rdir, tmp_path / "staged")
    assert len(calls) == len(manifest.chunks) - 2          # the two staged chunks were kept
    assert restore_snapshot(tmp_path / "staged").stats.bytes == manifest.total_bytes


def _frame(n: int = 8192, fill: bytes = b"a") -> bytes:
    return zstandard.ZstdCompressor(write_content_size=True).compress(fill * n)


@pytest.mark.parametrize("data,why", [
    (_frame() + b"\0\0\0", "trailing bytes"),
    (_frame() + _frame(), "trailing bytes or extra frames"),
    (_frame()[:-2], "bad zstd frame"),
    (_frame(8193), "content size"),
    (_frame(4096), "content size"),
    (zstandard.ZstdCompressor(write_content_size=False).compress(b"a" * 8192), "content size"),
    (b"\0" * 16, "magic"),
])
def test_bad_frames_are_corruption(data, why):
    with pytest.raises(SnapshotCorrupt) as err:
        remote.decompress_chunk(data, 8192, "here")
    assert why in str(err.value) and "here" in str(err.value)


def test_good_frame_and_compress_bound():
    assert remote.decompress_chunk(_frame(), 8192, "x") == b"a" * 8192
    assert remote.zstd_frame_size(_frame() + b"junk") == len(_frame())
    assert remote.max_compressed_bytes(1 << 20) == (1 << 20) + (1 << 12) + 64


def _rewrite_remote(rdir, **chunk0):
    m = read_manifest(rdir)
    chunks = [dataclasses.replace(m.chunks[0], **chunk0), *m.chunks[1:]]
    (rdir / MANIFEST_NAME).write_bytes(encode_manifest(dataclasses.replace(m, chunks=chunks)))


def test_stage_refuses_corrupt_remote_chunks(tmp_path, make_snapshot):
    src, manifest = make_snapshot()
    rdir = remote.push(src, tmp_path / "remote")
    c0 = read_manifest(rdir).chunks[0]
    _rewrite_remote(rdir, compressed_length=c0.compressed_length + 1)   # frame + 1 trailing byte
    with pytest.raises(SnapshotCorrupt) as err:
        remote.stage(rdir, tmp_path / "a")
    assert err.value.chunk == 0 and err.value.tensors == manifest.chunk_tensors(0)
    _rewrite_remote(rdir, compressed_length=c0.compressed_length, checksum=c0.checksum ^ 1)
    with pytest.raises(SnapshotCorrupt, match="XXH3-64"):
        remote.stage(rdir, tmp_path / "b")
    _rewrite_remote(rdir, checksum=c0.checksum, compressed_length=remote.max_compressed_bytes(8192) + 1)
    with pytest.raises(SnapshotCorrupt, match="over the bound"):
        remote.stage(rdir, tmp_path / "c")
    _rewrite_remote(rdir, compressed_length=c0.compressed_length)
    with open(rdir / ZST, "r+b") as f:
        f.truncate(f.seek(0, 2) - 10)
    with pytest.raises(SnapshotCorrupt, match="truncated"):
        remote.stage(rdir, tmp_path / "d")


def test_remote_manifest_signature_checked(tmp_path, make_snapshot):
    src, _ = make_snapshot(key=b"k")
    rdir = remote.push(src, tmp_path / "remote", key=b"k")
    with pytest.raises(SnapshotTampered):
        remote.stage(rdir, tmp_path / "x", key=b"other")
