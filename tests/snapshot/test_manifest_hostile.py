"""Hostile manifests: huge declared lengths, deep nesting, wrong types, limits at and over."""

from __future__ import annotations

import hashlib
import os
import tracemalloc

import msgpack
import pytest

from agent.errors import SnapshotCorrupt, SnapshotIncompatible, SnapshotNotFound
from agent.snapshot import format as fmt
from agent.snapshot.manifest import decode_manifest, encode_manifest, read_manifest
from tests.snapshot.blocking import with_timeout

HUGE = [
    b"\xdb\xff\xff\xff\xff",           # str32 declaring 4 GiB
    b"\xc6\xff\xff\xff\xff",           # bin32 declaring 4 GiB
    b"\xdd\xff\xff\xff\xff",           # array32 of 4 G items
    b"\xdf\xff\xff\xff\xff",           # map32 of 4 G pairs
    b"\x91" * 200_000 + b"\xc0",       # 200k nested arrays
    b"\x81\xa4body" + b"\x81\xa1a" * 100_000,  # deep maps
]


def _envelope(body_obj) -> bytes:
    body = msgpack.packb(body_obj, use_bin_type=True)
    return msgpack.packb({"magic": fmt.MAGIC, "format_version": fmt.FORMAT_VERSION, "body": body,
                          "sha256": hashlib.sha256(body).digest(), "hmac": None}, use_bin_type=True)


@pytest.mark.parametrize("data", HUGE, ids=["str32", "bin32", "array32", "map32", "nest-array", "nest-map"])
def test_huge_declared_lengths_and_nesting_fail_with_bounded_memory(data):
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotCorrupt) as err:
            decode_manifest(data, "m")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20 and err.value.path == "m"


@pytest.mark.parametrize("data", HUGE[:4] + HUGE[4:5], ids=["str32", "bin32", "array32", "map32", "nest"])
def test_hostile_body_inside_a_valid_envelope(data):
    env = msgpack.packb({"magic": fmt.MAGIC, "format_version": 1, "body": data,
                         "sha256": hashlib.sha256(data).digest(), "hmac": None}, use_bin_type=True)
    with pytest.raises(SnapshotCorrupt, match="body"):
        decode_manifest(env, "m")


@pytest.fixture
def good(make_snapshot):
    _, manifest = make_snapshot()
    return manifest.to_dict()


MUTATIONS = {
    "tensors not a list": (lambda d: d.update(tensors="x"), "tensors"),
    "negative dim": (lambda d: d["tensors"][0].__setitem__(2, [-1, 64]), "embed.shape"),
    "bool as int": (lambda d: d["tensors"][0].__setitem__(4, True), "embed.offset"),
    "nbytes lies": (lambda d: d["tensors"][0].__setitem__(5, 4), "embed.nbytes"),
    "unknown dtype": (lambda d: d["tensors"][0].__setitem__(1, "float7"), "embed.dtype"),
    "duplicate name": (lambda d: d["tensors"][1].__setitem__(0, "embed"), "tensors[1].name"),
    "tensor past end": (lambda d: d["tensors"][4].__setitem__(4, d["total_bytes"]), "scale.offset"),
    "path traversal": (lambda d: d["chunks"][0].__setitem__(0, "../etc/passwd"), "chunks[0].file"),
    "chunk gap": (lambda d: d["chunks"][1].__setitem__(3, 16384), "chunks[1].buffer_offset"),
    "unaligned chunk": (lambda d: d["chunks"][0].__setitem__(2, 100), "chunks[0]"),
    "negative checksum": (lambda d: d["chunks"][0].__setitem__(4, -1), "checksum"),
    "total lies": (lambda d: d.update(total_bytes=d["total_bytes"] + 4096), "total_bytes"),
    "missing field": (lambda d: d.pop("extra"), "manifest"),
    "pins wrong type": (lambda d: d["pins"].update(torch=2), "pins.torch"),
    "model extra key": (lambda d: d["model"].update(x="y"), "model"),
    "chunk short row": (lambda d: d["chunks"][0].pop(), "chunks[0]"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_wrong_types_and_layouts_are_named(good, case):
    mutate, field = MUTATIONS[case]
    mutate(good)
    with pytest.raises(SnapshotCorrupt) as err:
        decode_manifest(_envelope(good), "m")
    assert field in str(err.value) and err.value.expected is not None


def test_ndim_limit_at_and_over(good):
    good["tensors"][4][2] = [1] * fmt.MAX_NDIM
    good["tensors"][4][3] = [1] * fmt.MAX_NDIM
    m = decode_manifest(_envelope(good), "m")
    assert m.tensors[4].shape == (1,) * fmt.MAX_NDIM
    good["tensors"][4][2] = [1] * (fmt.MAX_NDIM + 1)
    with pytest.raises(SnapshotCorrupt, match=f"at most {fmt.MAX_NDIM} entries"):
        decode_manifest(_envelope(good), "m")


def test_manifest_size_limit_at_and_over(tmp_path, make_snapshot, monkeypatch):
    path, manifest = make_snapshot()
    size = len((path / fmt.MANIFEST_NAME).read_bytes())
    monkeypatch.setattr("agent.snapshot.manifest.MAX_MANIFEST_BYTES", size)
    assert read_manifest(path) == manifest                           # at the limit
    with open(path / fmt.MANIFEST_NAME, "ab") as f:
        f.write(b"\0")
    with pytest.raises(SnapshotCorrupt) as err:                      # one byte over
        read_manifest(path)
    assert err.value.expected == size and err.value.actual == size + 1


def test_wrong_magic_and_non_map(good):
    with pytest.raises(SnapshotCorrupt, match="magic"):
        decode_manifest(msgpack.packb({"magic": "nope"}), "m")
    with pytest.raises(SnapshotCorrupt, match="magic"):
        decode_manifest(msgpack.packb(5), "m")
    assert encode_manifest(fmt.manifest_from_dict(good)) == encode_manifest(fmt.manifest_from_dict(good))


def test_entry_count_limit_at_and_over(good, monkeypatch):
    monkeypatch.setattr(fmt, "MAX_ENTRIES", len(good["tensors"]))
    assert len(decode_manifest(_envelope(good), "m").tensors) == fmt.MAX_ENTRIES     # at the limit
    good["tensors"].append(["extra", "uint8", [0], [1], 0, 0])
    with pytest.raises(SnapshotCorrupt) as err:                                      # one over
        decode_manifest(_envelope(good), "m")
    assert err.value.actual == fmt.MAX_ENTRIES + 1 and "tensors" in str(err.value)


@pytest.mark.parametrize("version", [True, 1.0, 2, "1", None], ids=["true", "float", "two", "str", "nil"])
def test_envelope_format_version_must_be_the_int_1(good, version):
    env = msgpack.unpackb(_envelope(good), raw=False)
    env["format_version"] = version
    with pytest.raises(SnapshotIncompatible) as err:
        decode_manifest(msgpack.packb(env, use_bin_type=True), "m")
    got = err.value.mismatches["format_version"]
    assert got == (version, fmt.FORMAT_VERSION) and type(got[0]) is type(version)


def test_envelope_hmac_must_be_bytes_or_nil(good):
    env = msgpack.unpackb(_envelope(good), raw=False)
    env["hmac"] = 63                    # one flipped bit turns nil (0xc0) into fixint 63 (0x3f)
    with pytest.raises(SnapshotCorrupt, match="hmac") as err:
        decode_manifest(msgpack.packb(env, use_bin_type=True), "m")
    assert err.value.actual == "int"


# --- what is in manifest.msgpack's place ---------------------------------------------------

def _unblock_fifo(fifo):
    def unblock():
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))   # the blocked open returns, EOF
        except OSError:
            pass
    return unblock


def test_manifest_fifo_is_refused_without_blocking(make_snapshot):
    path, _ = make_snapshot()
    mpath = path / fmt.MANIFEST_NAME
    mpath.unlink()
    os.mkfifo(mpath)
    err = with_timeout(lambda: read_manifest(path), unblock=_unblock_fifo(mpath))
    assert isinstance(err, SnapshotCorrupt) and err.path == mpath
    assert err.actual == "a FIFO" and "not a regular file" in str(err)


def test_manifest_directory_is_refused(make_snapshot):
    path, _ = make_snapshot()
    mpath = path / fmt.MANIFEST_NAME
    mpath.unlink()
    mpath.mkdir()
    with pytest.raises(SnapshotCorrupt, match="not a regular file") as err:
        read_manifest(path)
    assert err.value.path == mpath and err.value.actual == "a directory"


@pytest.mark.parametrize("target", ["loop", "dangling", "devzero", "real"])
def test_manifest_symlink_is_refused(make_snapshot, tmp_path, target):
    path, _ = make_snapshot()
    mpath = path / fmt.MANIFEST_NAME
    real = tmp_path / "elsewhere.msgpack"
    real.write_bytes(mpath.read_bytes())
    mpath.unlink()
    os.symlink({"loop": fmt.MANIFEST_NAME, "dangling": "/nonexistent/x", "devzero": "/dev/zero",
                "real": str(real)}[target], mpath)
    with pytest.raises(SnapshotCorrupt, match="symbolic link") as err:
        read_manifest(path)
    assert err.value.path == mpath


def test_snapshot_path_that_is_a_file_is_not_found(tmp_path):
    path = tmp_path / "snap"
    path.write_bytes(b"x")
    with pytest.raises(SnapshotNotFound, match="not a directory") as err:
        read_manifest(path)
    assert err.value.path == path


def _with_golden(good, **golden):
    good["golden"] = {"prompts": [[1, 2]], "seed": 3, "max_tokens": 1, "expected": [[4]], **golden}
    return good


def test_golden_method_round_trips_and_an_old_record_decodes_without_one(good):
    m = decode_manifest(_envelope(_with_golden(good, method="teacher_forced/1")), "m")
    assert m.golden.method == "teacher_forced/1" and m.golden.expected == [[4]]
    old = _with_golden(good)              # written before the field existed: no "method" key
    assert "method" not in old["golden"]
    assert decode_manifest(_envelope(old), "m").golden.method == ""


def test_golden_method_limit_at_and_over_and_wrong_type(good):
    at = "x" * fmt.MAX_METHOD_CHARS
    assert decode_manifest(_envelope(_with_golden(good, method=at)), "m").golden.method == at
    with pytest.raises(SnapshotCorrupt) as err:
        decode_manifest(_envelope(_with_golden(good, method=at + "x")), "m")
    assert "golden.method" in str(err.value) and err.value.actual == fmt.MAX_METHOD_CHARS + 1
    with pytest.raises(SnapshotCorrupt, match="golden.method"):
        decode_manifest(_envelope(_with_golden(good, method=1)), "m")
    with pytest.raises(SnapshotCorrupt, match="golden"):       # an unknown key is still refused
        decode_manifest(_envelope(_with_golden(good, method="m", other=1)), "m")
