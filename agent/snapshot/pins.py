"""Pins: what a restore depends on, read from this machine and compared before a byte is read."""

from __future__ import annotations

import sysconfig
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import torch

from agent.errors import SnapshotIncompatible
from agent.snapshot.format import FORMAT_VERSION, Pins


def rewarm_version() -> str:
    try:
        return metadata.version("rewarm")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _nvidia_driver() -> str:
    import pynvml  # nvidia-ml-py; only asked on GPU machines
    pynvml.nvmlInit()
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    finally:
        pynvml.nvmlShutdown()


def machine_pins(device: str = "cpu") -> Pins:
    """This machine's pins for restoring onto ``device`` ("cpu" or "cuda[:N]").

    For "cpu" the CUDA driver pin is "cpu" and the GPU pins are None, so a CPU snapshot
    restores on any machine with the same torch, CPU ISA target, Python ABI and rewarm.
    """
    cuda_driver, gpu_name, gpu_cc = "cpu", None, None
    if device.startswith("cuda"):
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        cuda_driver = _nvidia_driver()
        gpu_name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        gpu_cc = f"{major}.{minor}"
    return Pins(format_version=FORMAT_VERSION, torch=torch.__version__, cuda_driver=cuda_driver,
                gpu_name=gpu_name, gpu_cc=gpu_cc, cpu_isa=torch.backends.cpu.get_cpu_capability(),
                python_abi=sysconfig.get_config_var("SOABI") or "unknown", rewarm=rewarm_version())


def pins_device(pins: Pins) -> str:
    """The device whose pins to compare with: "cuda" for a GPU snapshot where a GPU is
    present, else "cpu" (a GPU snapshot then fails the check, naming the GPU pins)."""
    return "cuda" if pins.cuda_driver != "cpu" and torch.cuda.is_available() else "cpu"


def check_pins(snapshot: Pins, machine: Pins, path: Path | str | None) -> None:
    """Raise SnapshotIncompatible naming every pin that differs, with both values.

    ``err.mismatches`` is ``{pin: (snapshot_value, machine_value)}``.
    """
    a, b = asdict(snapshot), asdict(machine)
    mismatches = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    if mismatches:
        detail = "; ".join(f"{k}: snapshot {s!r}, machine {m!r}" for k, (s, m) in mismatches.items())
        raise SnapshotIncompatible(f"{path}: snapshot pins differ from this machine: {detail}",
                                   path=path, mismatches=mismatches)
