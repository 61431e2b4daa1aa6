"""What this node has to run replicas on: GPUs through NVML (pynvml), else the CPU.

Each GPU's name, UUID, memory, driver version and compute capability are read once at start.
They are also the device pins a snapshot's manifest is compared with (see
``agent/snapshot/pins.py``): :meth:`Inventory.pins` fills the GPU fields from NVML so that the
agent needs no CUDA context to decide whether a snapshot fits a device.  On a machine without
NVML (no driver, no GPU) the agent runs CPU replicas and says so once, at start.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from agent.errors import ConfigError
from agent.snapshot.format import Pins
from agent.snapshot.pins import machine_pins

log = logging.getLogger(__name__)
_said_cpu_only = False


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML reports it; ``memory_total_bytes`` in bytes, ``compute_capability``
    as "major.minor"."""

    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    driver_version: str
    compute_capability: str

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_gpus(nvml: Any = None) -> tuple[list[Gpu], str | None]:
    """The GPUs NVML sees, and why there are none (None when NVML answered).

    ``nvml``: the pynvml module (injectable for tests).  Never raises for a missing driver.
    """
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[no-redef]  # nvidia-ml-py, in place of the injected one
        except ImportError as exc:
            return [], f"pynvml not importable ({exc})"
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return [], f"NVML unavailable ({exc})"
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(Gpu(index=index, name=_text(nvml.nvmlDeviceGetName(handle)),
                            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                            memory_total_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
                            driver_version=driver, compute_capability=f"{major}.{minor}"))
        return gpus, None if gpus else "NVML reports no GPU"
    finally:
        nvml.nvmlShutdown()


class Inventory:
    """The node's devices: ``devices`` is ``["cuda:0", ...]`` or ``["cpu"]``."""

    def __init__(self, gpus: list[Gpu], cpu_reason: str | None = None) -> None:
        self.gpus = list(gpus)
        self.cpu_reason = cpu_reason

    @classmethod
    def detect(cls, nvml: Any = None, *, announce: bool = True) -> Inventory:
        """Read NVML; with no GPU, log once per process that replicas run on the CPU."""
        global _said_cpu_only
        gpus, reason = read_gpus(nvml)
        if not gpus and announce and not _said_cpu_only:
            log.warning("no GPU: %s; this agent runs CPU replicas", reason)
            _said_cpu_only = True
        return cls(gpus, reason)

    @property
    def devices(self) -> list[str]:
        return [g.device for g in self.gpus] or ["cpu"]

    @property
    def cpu_only(self) -> bool:
        return not self.gpus

    def gpu(self, device: str) -> Gpu:
        """The GPU behind ``"cuda:N"``. Raises ConfigError naming the devices there are."""
        for g in self.gpus:
            if g.device == device or (device == "cuda" and g.index == 0):
                return g
        raise ConfigError(f"device {device!r} not on this node; devices: {self.devices}",
                          name="device", value=device, limit=self.devices)

    def pins(self, device: str = "cpu") -> Pins:
        """The pins a snapshot restored onto ``device`` must match (GPU fields from NVML)."""
        base = machine_pins("cpu")
        if device == "cpu":
            return base
        g = self.gpu(device)
        return dataclasses.replace(base, cuda_driver=g.driver_version, gpu_name=g.name,
                                   gpu_cc=g.compute_capability)

    def describe(self) -> dict[str, Any]:
        """msgpack-able summary for ``status`` answers and registry meta."""
        return {"devices": self.devices, "cpu_reason": self.cpu_reason,
                "gpus": [dataclasses.asdict(g) for g in self.gpus]}
