"""The kvikio device path: with the fake kvikio here (host tensors stand in for device memory),
with the real one where a GPU and its driver are present (``pytest -m gpu``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agent.errors import ConfigError, DriverUnavailable, SnapshotCorrupt, SnapshotIncompatible
from agent.snapshot import gpu
from agent.snapshot.pins import machine_pins
from tests.fake_kvikio import Defaults, FakeKvikio

HAVE_GPU = gpu.cuda_driver_present() and torch.cuda.is_available()


@pytest.mark.skipif(gpu.cuda_driver_present(), reason="the driver is present here")
def test_without_driver_the_device_path_says_so(make_snapshot):
    path, _ = make_snapshot()
    with pytest.raises(DriverUnavailable) as err:
        gpu.restore_to_device(path)
    assert err.value.missing == ["libcuda.so.1"]


@pytest.mark.skipif(gpu.cuda_driver_present(), reason="the driver is present here")
def test_a_buffer_without_the_driver_keeps_why():
    buf = gpu.DeviceBuffer.allocate(4096, "cpu")
    assert buf.kvikio is None and "libcuda.so.1" in buf.unavailable
    assert buf.capacity_bytes == 4096 and buf.as_tensor(100).numel() == 100


def test_fake_restore_fills_the_buffer_and_verifies(make_snapshot, tensors):
    path, manifest = make_snapshot()
    fake = FakeKvikio()
    buf = gpu.DeviceBuffer.allocate(manifest.total_bytes + 4096, "cpu", bounce_bytes=1024,
                                    kvikio=fake)
    r = gpu.restore_to_device(path, device="cpu", buffer=buf)
    for name, t in tensors.items():
        assert torch.equal(r.tensors[name], t), name
        assert r.tensors[name].untyped_storage().data_ptr() == buf.tensor.untyped_storage().data_ptr()
    assert r.buffer is buf and r.stats.mode == "compat" and r.stats.verified
    assert len(fake.reads) == len(manifest.chunks) and all(h.closed for h in fake.opened)
    # bounce buffers smaller than a chunk are replaced for the verification, not overrun
    assert buf.bounce[0].numel() == 1024


def test_a_flipped_byte_is_found_and_named(make_snapshot):
    path, manifest = make_snapshot()
    c = manifest.chunks[2]
    fake = FakeKvikio(flip_at=c.offset + 17)
    with pytest.raises(SnapshotCorrupt) as err:
        gpu.restore_to_device(path, device="cpu", kvikio=fake)
    assert err.value.chunk == 2 and err.value.expected == c.checksum
    assert err.value.tensors == manifest.chunk_tensors(2)
    assert all(h.closed for h in fake.opened)
    # unverified, the same bytes are accepted: verification is what catches them
    r = gpu.restore_to_device(path, device="cpu", kvikio=FakeKvikio(flip_at=c.offset + 17),
                              verify=False)
    assert not r.stats.verified


def test_an_io_error_propagates_and_every_file_is_closed(make_snapshot):
    path, manifest = make_snapshot()
    fake = FakeKvikio(fail_at=manifest.chunks[1].offset)
    with pytest.raises(RuntimeError, match="Input/output error"):
        gpu.restore_to_device(path, device="cpu", kvikio=fake)
    assert fake.opened and all(h.closed for h in fake.opened)


def test_pins_and_accept_refuse_before_a_byte_is_read(make_snapshot):
    other = dataclasses.replace(machine_pins("cpu"), gpu_name="NVIDIA H200", gpu_cc="9.0",
                                cuda_driver="580.65")
    path, _ = make_snapshot(pins=other)
    fake = FakeKvikio()
    with pytest.raises(SnapshotIncompatible) as err:
        gpu.restore_to_device(path, device="cpu", kvikio=fake)
    assert "gpu_name" in err.value.mismatches and fake.reads == [] and fake.opened == []
    path2, _ = make_snapshot("snap2")

    def refuse(manifest):
        raise SnapshotIncompatible("not a replica", path=path2, mismatches={})
    with pytest.raises(SnapshotIncompatible):
        gpu.restore_to_device(path2, device="cpu", kvikio=fake, accept=refuse)
    assert fake.reads == []


def test_a_buffer_too_small_or_elsewhere_is_refused(make_snapshot):
    path, manifest = make_snapshot()
    fake = FakeKvikio()
    small = gpu.DeviceBuffer.allocate(manifest.total_bytes - 1, "cpu", kvikio=fake)
    with pytest.raises(ConfigError) as err:
        gpu.restore_to_device(path, device="cpu", buffer=small)
    assert err.value.limit == manifest.total_bytes and fake.reads == []
    with pytest.raises(ConfigError) as err:
        gpu.restore_to_device(path, device="meta",
                              buffer=gpu.DeviceBuffer.allocate(manifest.total_bytes, "cpu", kvikio=fake),
                              machine=machine_pins("cpu"))
    assert err.value.name == "device"


def test_io_path_says_gds_only_with_cufile_and_nvidia_fs(tmp_path):
    present = tmp_path / "nvidia-fs"
    present.mkdir()
    absent = tmp_path / "none"
    assert gpu.io_path(FakeKvikio(Defaults(compat=False)), present) == "gds"
    assert gpu.io_path(FakeKvikio(Defaults(compat=False)), absent) == "compat"
    assert gpu.io_path(FakeKvikio(Defaults(compat=True)), present) == "compat"


def test_fake_is_no_kinder_than_kvikio(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 100)
    h = FakeKvikio().CuFile(f, "r")
    with pytest.raises(ValueError):
        h.pread(torch.empty(10, dtype=torch.uint8), 11, 0)
    fut = h.pread(torch.empty(20, dtype=torch.uint8), 20, 90)
    with pytest.raises(RuntimeError, match="EOF"):
        fut.get()
    ok = h.pread(torch.empty(10, dtype=torch.uint8), 10, 0)
    assert ok.get() == 10
    with pytest.raises(RuntimeError):
        ok.get()
    h.close()
    with pytest.raises(RuntimeError):
        h.pread(torch.empty(10, dtype=torch.uint8), 10, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU and its driver")
def test_restore_into_device_memory(make_snapshot, tensors):
    pytest.importorskip("kvikio")
    path, manifest = make_snapshot(pins=machine_pins("cuda"))
    buf = gpu.DeviceBuffer.allocate(manifest.total_bytes, "cuda")
    r = gpu.restore_to_device(path, device="cuda", buffer=buf)
    assert r.stats.mode in ("gds", "compat")
    for name, t in tensors.items():
        assert r.tensors[name].is_cuda and torch.equal(r.tensors[name].cpu(), t), name
    with open(path / "data-00000.bin", "r+b") as f:
        f.seek(10)
        f.write(b"\x99")
    with pytest.raises(SnapshotCorrupt) as err:
        gpu.restore_to_device(path, device="cuda", buffer=buf)
    assert err.value.chunk == 0
