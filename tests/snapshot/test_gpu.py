"""The kvikio device path: runs only where a GPU and its driver are present."""

from __future__ import annotations

import pytest
import torch

from agent.errors import DriverUnavailable
from agent.snapshot import gpu
from agent.snapshot.pins import machine_pins

HAVE_GPU = gpu.cuda_driver_present() and torch.cuda.is_available()


@pytest.mark.skipif(gpu.cuda_driver_present(), reason="the driver is present here")
def test_without_driver_the_device_path_says_so(make_snapshot):
    path, _ = make_snapshot()
    with pytest.raises(DriverUnavailable) as err:
        gpu.restore_to_device(path)
    assert err.value.missing == ["libcuda.so.1"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU and its driver")
def test_restore_into_device_memory(make_snapshot, tensors):
    pytest.importorskip("kvikio")
    path, manifest = make_snapshot(pins=machine_pins("cuda"))
    r = gpu.restore_to_device(path, device="cuda")
    for name, t in tensors.items():
        assert r.tensors[name].is_cuda and torch.equal(r.tensors[name].cpu(), t), name
    with open(path / "data-00000.bin", "r+b") as f:
        f.seek(10)
        f.write(b"\x99")
    with pytest.raises(Exception) as err:
        gpu.restore_to_device(path, device="cuda")
    assert getattr(err.value, "chunk", None) == 0
