"""Corrupted, truncated and tampered snapshots are refused, naming the chunk and tensors."""

from __future__ import annotations

import hashlib
import random

import msgpack
import pytest

from agent.errors import SnapshotCorrupt, SnapshotNotFound, SnapshotTampered
from agent.snapshot.format import MANIFEST_NAME
from agent.snapshot.reader import HostBuffer, restore_snapshot, verify_chunks
from agent.snapshot.writer import DATA_NAME


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_one_flipped_byte_in_any_chunk_is_detected_and_attributed(make_snapshot):
    path, manifest = make_snapshot()
    rng = random.Random(3)
    assert len(manifest.chunks) == 3
    for i, c in enumerate(manifest.chunks):
        at = c.offset + rng.randrange(c.length)
        _flip(path / DATA_NAME, at)
        with pytest.raises(SnapshotCorrupt) as err:
            restore_snapshot(path, buffer=HostBuffer.allocate(manifest.total_bytes))
        e = err.value
        assert e.chunk == i and e.chunks == [i] and e.tensors == manifest.chunk_tensors(i)
        assert e.expected == f"{c.checksum:016x}" and e.actual != e.expected
        assert f"chunk {i}" in str(e) and DATA_NAME in str(e)
        with pytest.raises(SnapshotCorrupt) as err2:
            verify_chunks(path, manifest)
        assert err2.value.chunk == i
        _flip(path / DATA_NAME, at)  # restore the byte: the snapshot is good again
        assert restore_snapshot(path).stats.bytes == manifest.total_bytes


def test_flip_in_alignment_padding_is_detected(make_snapshot):
    path, manifest = make_snapshot()
    _flip(path / DATA_NAME, manifest.total_bytes - 1)   # past the last tensor's end
    with pytest.raises(SnapshotCorrupt) as err:
        restore_snapshot(path)
    assert err.value.chunk == len(manifest.chunks) - 1


def test_all_bad_chunks_are_listed(make_snapshot):
    path, manifest = make_snapshot()
    for c in manifest.chunks:
        _flip(path / DATA_NAME, c.offset + 5)
    with pytest.raises(SnapshotCorrupt) as err:
        restore_snapshot(path)
    assert err.value.chunks == [0, 1, 2] and "2 more bad chunks" in str(err.value)


def test_truncated_and_missing_data_file(make_snapshot):
    path, manifest = make_snapshot()
    with open(path / DATA_NAME, "r+b") as f:
        f.truncate(manifest.total_bytes - 100)
    with pytest.raises(SnapshotCorrupt) as err:
        restore_snapshot(path)
    assert err.value.expected == manifest.total_bytes and err.value.actual == manifest.total_bytes - 100
    assert err.value.chunk == len(manifest.chunks) - 1 and "truncated" in str(err.value)
    (path / DATA_NAME).unlink()
    with pytest.raises(SnapshotCorrupt, match="missing"):
        restore_snapshot(path)


def test_missing_manifest_is_not_found(tmp_path):
    with pytest.raises(SnapshotNotFound) as err:
        restore_snapshot(tmp_path / "nothing")
    assert err.value.path == tmp_path / "nothing"


def _rewrite_body(path, mutate, fix_digest: bool) -> None:
    env = msgpack.unpackb((path / MANIFEST_NAME).read_bytes())
    body = msgpack.unpackb(env["body"])
    mutate(body)
    env["body"] = msgpack.packb(body, use_bin_type=True)
    if fix_digest:
        env["sha256"] = hashlib.sha256(env["body"]).digest()
    (path / MANIFEST_NAME).write_bytes(msgpack.packb(env, use_bin_type=True))


def test_tampered_signed_manifest_is_refused(make_snapshot):
    key = b"node-key-0123456789abcdef0123456"
    path, _ = make_snapshot(key=key)
    assert restore_snapshot(path, key=key).manifest.model.name == "tiny"
    with pytest.raises(SnapshotTampered, match="HMAC"):
        restore_snapshot(path, key=b"another key")
    # a forger who recomputes the SHA-256 still cannot produce the HMAC
    _rewrite_body(path, lambda b: b["model"].update(name="evil"), fix_digest=True)
    with pytest.raises(SnapshotTampered) as err:
        restore_snapshot(path, key=key)
    assert "HMAC" in str(err.value) and err.value.expected != err.value.actual


def test_manifest_digest_mismatch_and_unsigned_with_key(make_snapshot):
    path, _ = make_snapshot()
    with pytest.raises(SnapshotTampered, match="HMAC"):
        restore_snapshot(path, key=b"k")          # a node with a key refuses unsigned manifests
    _rewrite_body(path, lambda b: b.update(total_bytes=b["total_bytes"] + 4096), fix_digest=False)
    with pytest.raises(SnapshotTampered, match="SHA-256"):
        restore_snapshot(path)
