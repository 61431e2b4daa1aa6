"""The extension's helpers directly, and the `rewarm snapshot` / `rewarm import` commands."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from agent import exitcodes
from agent import _restore
from agent.cli import main
from agent.snapshot.reader import HostBuffer
from agent.snapshot.writer import DATA_NAME


def test_xxh3_reference_values():
    # XXH3_64bits reference values for "" and "abc" (seed 0)
    assert _restore.xxh3_64(b"") == 0x2D06800538D394C2
    assert _restore.xxh3_64(b"abc") == 0x78AF5F94892F3950
    assert _restore.xxh3_64(memoryview(b"xabc")[1:]) == 0x78AF5F94892F3950


def test_read_chunks_reports_errors_per_job(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(bytes(range(256)) * 32)           # 8 KiB
    buf = HostBuffer.allocate(16384)
    fd = os.open(p, os.O_RDONLY)
    try:
        h = _restore.xxh3_64(p.read_bytes()[:4096])
        res = _restore.read_chunks(buf.memory, [(-1, fd, 0, 4096, 0, h), (-1, fd, 4096, 8192, 4096, 0),
                                                (-1, 9999, 0, 4096, 0, 0)], 2, True)
        assert res[0] == (0, 0, 0, h)
        assert res[1][1] == 1                      # file ended inside the chunk
        assert res[2][0] == errno.EBADF
        with pytest.raises(ValueError, match="outside"):
            _restore.read_chunks(buf.memory, [(-1, fd, 0, 4096, 16384, 0)], 1, True)
        with pytest.raises(ValueError, match="threads"):
            _restore.read_chunks(buf.memory, [], 0, True)
    finally:
        os.close(fd)


def test_resident_fraction_sees_the_cache_drop(make_snapshot):
    path, _ = make_snapshot()
    data = path / DATA_NAME
    data.read_bytes()
    assert _restore.resident_fraction(str(data)) == 1.0
    fd = os.open(data, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert _restore.resident_fraction(str(data)) < 1.0   # clean pages are dropped
    with pytest.raises(OSError):
        _restore.resident_fraction(str(path / "missing"))


def test_cli_inspect_verify_import(tmp_path, capsys, make_snapshot):
    path, manifest = make_snapshot()
    assert main(["snapshot", "inspect", str(path), "--tensors"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tensors"] == 5 and out["total_bytes"] == manifest.total_bytes
    assert out["tensor_table"][0][:3] == ["embed", "bfloat16", [40, 64]]
    assert main(["snapshot", "verify", str(path)]) == 0
    assert f"{manifest.total_bytes} bytes verified" in capsys.readouterr().out
    with open(path / DATA_NAME, "r+b") as f:
        f.seek(100)
        f.write(b"\xee")
    assert main(["snapshot", "verify", str(path)]) == exitcodes.EX_DATAERR
    assert "chunk 0" in capsys.readouterr().err
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    save_file({"w": torch.ones(3)}, hf / "model.safetensors")
    assert main(["import", str(hf), str(tmp_path / "imp"), "--name", "m", "--version", "v1"]) == 0
    assert "m v1, 1 tensors" in capsys.readouterr().out


def test_every_hash_kernel_gives_the_same_xxh3():
    data = bytes(range(256)) * 4099 + b"tail"
    chosen = _restore.hash_kernel()
    try:
        values = {}
        for kernel in ("default", "avx2", "avx512"):
            try:
                _restore.hash_kernel(kernel)
            except ValueError:
                continue               # not on this CPU
            values[kernel] = [_restore.xxh3_64(data[:n]) for n in (0, 3, 240, 241, 1024, 100_000, len(data))]
        assert len(values) >= 1 and all(v == values["default"] for v in values.values())
        assert values["default"][1] == 0x78AF5F94892F3950 or data[:3] != b"abc"
    finally:
        _restore.hash_kernel(chosen)
    with pytest.raises(ValueError, match="not available"):
        _restore.hash_kernel("neon")


def test_piecewise_hash_equals_one_shot(tmp_path):
    payload = os.urandom(3 * 4096 * 17)
    p = tmp_path / "f"
    p.write_bytes(payload)
    buf = HostBuffer.allocate(len(payload))
    fd = os.open(p, os.O_RDONLY)
    try:
        for piece in (4096, 8192 * 3, 1 << 20):
            res = _restore.read_chunks(buf.memory, [(-1, fd, 0, len(payload), 0, 0)], 1, True, piece)
            assert res[0][3] == _restore.xxh3_64(payload)
            assert bytes(buf.memory[:len(payload)]) == payload
        with pytest.raises(ValueError, match="piece_bytes"):
            _restore.read_chunks(buf.memory, [], 1, True, 1000)
    finally:
        os.close(fd)
