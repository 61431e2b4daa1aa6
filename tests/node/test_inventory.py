import logging
from types import SimpleNamespace

import pytest

from agent.errors import ConfigError
from agent.node import inventory as inv
from agent.node.inventory import Inventory, read_gpus
from agent.snapshot.pins import machine_pins


class FakeNvml:
    """Stands in for the pynvml module (outside rewarm), with two H200s."""

    def __init__(self, fail_init=None, count=2):
        self.fail_init, self.count, self.shutdowns = fail_init, count, 0

    def nvmlInit(self):
        if self.fail_init:
            raise self.fail_init

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return b"570.86.15"

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-0000000{h}-1111-2222-3333-444444444444"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=150_000_000_000 + h)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (9, 0)


def test_reads_every_gpu():
    nvml = FakeNvml()
    gpus, reason = read_gpus(nvml)
    assert reason is None and nvml.shutdowns == 1
    assert [(g.device, g.name, g.memory_total_bytes, g.driver_version, g.compute_capability)
            for g in gpus] == [("cuda:0", "NVIDIA H200", 150_000_000_000, "570.86.15", "9.0"),
                               ("cuda:1", "NVIDIA H200", 150_000_000_001, "570.86.15", "9.0")]
    assert gpus[1].uuid.startswith("GPU-00000001")


def test_gpu_pins_come_from_nvml():
    node = Inventory.detect(FakeNvml())
    assert node.devices == ["cuda:0", "cuda:1"] and not node.cpu_only
    pins = node.pins("cuda:1")
    cpu = machine_pins("cpu")
    assert (pins.cuda_driver, pins.gpu_name, pins.gpu_cc) == ("570.86.15", "NVIDIA H200", "9.0")
    assert (pins.torch, pins.cpu_isa, pins.format_version) == (cpu.torch, cpu.cpu_isa,
                                                              cpu.format_version)
    with pytest.raises(ConfigError) as info:
        node.pins("cuda:2")
    assert info.value.value == "cuda:2"


def test_no_nvml_runs_cpu_and_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(inv, "_said_cpu_only", False)
    with caplog.at_level(logging.WARNING, logger="agent.node.inventory"):
        a = Inventory.detect(FakeNvml(fail_init=RuntimeError("NVML Shared Library Not Found")))
        b = Inventory.detect(FakeNvml(count=0))
    assert a.devices == ["cpu"] and a.cpu_only
    assert "Shared Library Not Found" in a.cpu_reason
    assert b.cpu_reason == "NVML reports no GPU"
    warnings = [r for r in caplog.records if "CPU replicas" in r.getMessage()]
    assert len(warnings) == 1
    assert a.pins("cpu") == machine_pins("cpu")
    assert a.describe()["devices"] == ["cpu"]


def test_real_pynvml_on_this_machine_never_raises():
    node = Inventory.detect(announce=False)
    assert node.devices  # cpu here, GPUs on a GPU node
