"""A zygote's device restore and its fallbacks, with the fake kvikio at the driver boundary.

Host tensors stand in for device memory (``DeviceBuffer`` on "cpu"), so the control flow the
GPU runs (read into the zygote's device buffer, verify, bind, golden check; a failed device
read taking the host path with its reason) runs here.  ``-m gpu`` runs it on a real GPU."""

from __future__ import annotations

import shutil

import pytest
import torch

from agent.errors import SnapshotCorrupt
from agent.replica import zygote
from agent.replica.synthetic import make_synthetic
from agent.snapshot import gpu
from agent.snapshot.reader import read_manifest
from tests.fake_kvikio import FakeKvikio

PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    booted = zygote.boot(make_synthetic(root / "m", "tiny", seed=3), max_seqs=2, max_seq_len=32)
    zygote.capture(booted, root / "snap")
    return root / "snap", booted


def _buffer(snap, fake, extra_bytes: int = 0):
    return gpu.DeviceBuffer.allocate(read_manifest(snap).total_bytes + extra_bytes, "cpu",
                                     kvikio=fake)


def test_restore_reads_into_the_zygotes_device_buffer(captured):
    snap, booted = captured
    fake = FakeKvikio()
    buf = _buffer(snap, fake, 4096)
    loaded = zygote.restore(snap, buffer=buf, path="zygote_restore")
    assert (loaded.restore_io, loaded.fallback, loaded.device) == ("compat", None, "cpu")
    assert fake.reads, "kvikio did the reading"
    base = buf.tensor.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in loaded.weights.values())
    assert loaded.keepalive is buf and loaded.golden == booted.golden
    assert loaded.engine.generate([PROMPT], 6, seed=9) == booted.engine.generate([PROMPT], 6, seed=9)


def test_a_warmed_device_zygote_reuses_its_engine(captured):
    snap, booted = captured
    buf = _buffer(snap, FakeKvikio())
    warmed = zygote.warm_zygote(buf, snap)
    assert warmed is not None
    loaded = zygote.restore(snap, buffer=buf)
    assert loaded.engine is warmed.engine and loaded.restore_io == "compat"
    assert loaded.engine.generate([PROMPT], 6, seed=9) == booted.engine.generate([PROMPT], 6, seed=9)


@pytest.mark.parametrize("fault, reason", [
    ({"flip_at": 4096 + 3}, "SnapshotCorrupt"),       # a bad byte in device memory only
    ({"fail_at": 0}, "RuntimeError"),                 # kvikio's read failed (EIO)
])
def test_a_failed_device_read_takes_the_host_path_and_says_why(captured, fault, reason, caplog):
    snap, booted = captured
    fake = FakeKvikio(**fault)
    buf = _buffer(snap, fake)
    warmed = zygote.warm_zygote(buf, snap)
    loaded = zygote.restore(snap, buffer=buf)
    assert loaded.restore_io == "host" and loaded.fallback.startswith(reason)
    assert loaded.engine is not warmed.engine          # its views are of the device buffer
    assert all(h.closed for h in fake.opened)
    assert "device restore onto cpu failed" in caplog.text
    assert loaded.golden == booted.golden
    assert loaded.engine.generate([PROMPT], 6, seed=9) == booted.engine.generate([PROMPT], 6, seed=9)


@pytest.mark.skipif(gpu.cuda_driver_present(), reason="the driver is present here")
def test_without_kvikio_the_zygote_keeps_its_buffer_and_reads_through_the_host(captured):
    snap, booted = captured
    buf = gpu.DeviceBuffer.allocate(read_manifest(snap).total_bytes, "cpu")
    assert buf.kvikio is None
    loaded = zygote.restore(snap, buffer=buf)
    assert loaded.restore_io == "host" and "libcuda.so.1" in loaded.fallback
    assert loaded.golden == booted.golden


def test_a_snapshot_corrupt_on_disk_fails_both_paths(captured, tmp_path):
    snap, _ = captured
    bad = tmp_path / "bad"
    shutil.copytree(snap, bad)
    with open(bad / "data-00000.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(SnapshotCorrupt) as err:
        zygote.restore(bad, buffer=_buffer(bad, FakeKvikio()))
    assert err.value.chunk == 0      # the host path's verdict: the node agent's next rung


def test_a_buffer_too_small_gets_a_fresh_device_allocation(captured):
    snap, booted = captured
    fake = FakeKvikio()
    small = gpu.DeviceBuffer.allocate(64, "cpu", kvikio=fake)
    loaded = zygote.restore(snap, buffer=small)
    assert loaded.restore_io == "compat" and loaded.keepalive is None
    assert loaded.golden == booted.golden


def test_prepare_zygote_on_a_gpu_makes_a_device_buffer(monkeypatch, caplog):
    made = {}

    def allocate(nbytes, device, *, bounce_bytes=16 << 20, kvikio=None):
        made.update(nbytes=nbytes, device=device)
        return gpu.DeviceBuffer(torch.empty(nbytes, dtype=torch.uint8), device, [], None,
                                "libcuda.so.1 not found")
    monkeypatch.setattr(gpu.DeviceBuffer, "allocate", staticmethod(allocate))
    warmed = []
    monkeypatch.setattr(zygote, "warm_device", warmed.append)
    buf = zygote.prepare_zygote(1, 4096, device="cuda:0")
    assert made == {"nbytes": 4096, "device": "cuda:0"} and buf.device == "cuda:0"
    assert warmed == ["cuda:0"]        # no snapshot to warm for: the device is warmed
    assert "read into host memory" in caplog.text
    assert not isinstance(zygote.prepare_zygote(1, 4096, prefault=False), gpu.DeviceBuffer)


@pytest.mark.gpu
@pytest.mark.skipif(not (gpu.cuda_driver_present() and torch.cuda.is_available()),
                    reason="needs an NVIDIA GPU and its driver")
def test_cuda_zygote_restores_and_checks_on_the_gpu(tmp_path):
    pytest.importorskip("kvikio")
    booted = zygote.boot(make_synthetic(tmp_path / "m", "tiny", seed=3), max_seqs=2,
                         max_seq_len=32, device="cuda")
    zygote.capture(booted, tmp_path / "snap")
    buf = zygote.prepare_zygote(1, 64 << 20, device="cuda", warm=tmp_path / "snap")
    loaded = zygote.restore(tmp_path / "snap", buffer=buf)
    assert loaded.restore_io in ("staged", "gds", "compat") and loaded.fallback is None
    assert all(t.is_cuda for t in loaded.weights.values())
    assert loaded.engine.generate([PROMPT], 6, seed=9) == booted.engine.generate([PROMPT], 6, seed=9)


def test_a_device_buffer_starts_zeroed_so_a_warm_up_never_reads_garbage(captured):
    snap, _ = captured
    buf = _buffer(snap, FakeKvikio())
    assert int(buf.tensor.count_nonzero()) == 0
