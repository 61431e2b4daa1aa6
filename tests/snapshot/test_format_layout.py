"""Manifest layout rules a recomputed digest (no HMAC) must not get past: the body's own format
version, and extents that overlap or run backwards (tensors aliasing each other's bytes, chunks
of one file read twice)."""

from __future__ import annotations

import hashlib

import msgpack
import pytest

from agent.errors import SnapshotCorrupt, SnapshotIncompatible
from agent.snapshot import format as fmt
from agent.snapshot.manifest import decode_manifest
from agent.snapshot.reader import restore_snapshot


def _envelope(body_obj) -> bytes:
    body = msgpack.packb(body_obj, use_bin_type=True)
    return msgpack.packb({"magic": fmt.MAGIC, "format_version": fmt.FORMAT_VERSION, "body": body,
                          "sha256": hashlib.sha256(body).digest(), "hmac": None}, use_bin_type=True)


@pytest.fixture
def good(make_snapshot):
    _, manifest = make_snapshot()
    return manifest.to_dict()


def test_body_format_version_must_be_the_supported_one(good):
    good["format_version"] = 2
    with pytest.raises(SnapshotIncompatible) as err:
        decode_manifest(_envelope(good), "m")
    assert err.value.mismatches == {"format_version": (2, fmt.FORMAT_VERSION)}
    assert "format_version 2" in str(err.value) and f"reads {fmt.FORMAT_VERSION}" in str(err.value)


def test_overlapping_tensors_are_refused_naming_both(good):
    names = [t[0] for t in good["tensors"]]
    assert names[:2] == ["embed", "norm"]
    good["tensors"][1][4] = good["tensors"][0][4]            # norm aliases embed's first bytes
    with pytest.raises(SnapshotCorrupt) as err:
        decode_manifest(_envelope(good), "m")
    assert err.value.tensors == ["embed", "norm"] and "'embed'" in str(err.value) and "'norm'" in str(err.value)
    assert err.value.expected == 5120 and err.value.actual == 0


def test_out_of_order_tensors_are_refused(good):
    # Swap the offsets of embed (5120 B at 0) and norm (256 B at 5120): no overlap if read as a
    # set, but the table is no longer in buffer order, which the writer never produces.
    a, b = good["tensors"][0], good["tensors"][1]
    a[4], b[4] = 5376, 0
    with pytest.raises(SnapshotCorrupt) as err:
        decode_manifest(_envelope(good), "m")
    assert err.value.tensors == ["embed", "norm"] and err.value.expected == 5376 + 5120


def test_empty_tensors_may_sit_anywhere_aligned(good):
    good["tensors"].insert(1, ["empty", "float32", [0, 3], [3, 1], 0, 0])
    m = decode_manifest(_envelope(good), "m")
    assert [t.name for t in m.tensors][:3] == ["embed", "empty", "norm"] and m.tensors[1].nbytes == 0


def test_chunks_reading_the_same_file_bytes_twice_are_refused(good):
    assert len(good["chunks"]) >= 2
    good["chunks"][1][1] = 0                                # chunk 1 re-reads chunk 0's file bytes
    with pytest.raises(SnapshotCorrupt) as err:
        decode_manifest(_envelope(good), "m")
    assert err.value.chunks == [0, 1] and err.value.expected == good["chunks"][0][2]
    assert err.value.actual == 0 and "data-00000.bin" in str(err.value)


def test_restore_of_aliased_tensors_returns_nothing(make_snapshot):
    path, manifest = make_snapshot()
    env = msgpack.unpackb((path / fmt.MANIFEST_NAME).read_bytes(), raw=False)
    body = msgpack.unpackb(env["body"], raw=False)
    body["tensors"][1][4] = body["tensors"][0][4]
    env["body"] = msgpack.packb(body, use_bin_type=True)
    env["sha256"] = hashlib.sha256(env["body"]).digest()     # recomputed: only HMAC would catch it
    (path / fmt.MANIFEST_NAME).write_bytes(msgpack.packb(env, use_bin_type=True))
    with pytest.raises(SnapshotCorrupt) as err:
        restore_snapshot(path)
    assert err.value.tensors == ["embed", "norm"]
