"""Compile targets: the CPU instruction-set family and the GPU architecture of this machine.

An AOTInductor package holds machine code for one target.  Code built with AVX-512 dies with
SIGILL on a CPU without it, and a CUDA cubin built for sm_90 does not load on sm_80, so every
package records the target it was built for and the loader compares it with
:func:`current_target` before it maps any code (see agent/replica/aot.py).

The CPU family is the instruction-set level torch's own kernels dispatch on
(``torch.backends.cpu.get_cpu_capability()``: ``DEFAULT``, ``AVX2``, ``AVX512``, ...) refined by
the /proc/cpuinfo flags Inductor's C++ backend uses (``avx512_vnni``, ``avx512_bf16``,
``amx_tile``), so two machines share a target exactly when the same generated code runs on both.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from agent.errors import ConfigError

# Flags that change the code Inductor's CPU backend may emit (torch/_inductor/cpu_vec_isa.py
# checks these same features before choosing a vector ISA).
EXTRA_CPU_FLAGS = ("avx512_vnni", "avx512_bf16", "amx_tile")
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The feature flags of the first CPU in ``cpuinfo`` (empty where the file is missing)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_target(cpuinfo: Path = CPUINFO) -> str:
    """This machine's CPU target, e.g. ``x86_64-avx512+avx512_vnni+avx512_bf16``.

    The form is ``<machine>-<torch cpu capability, lower case>[+<extra flag>...]``; extra flags
    are listed in :data:`EXTRA_CPU_FLAGS` order, so the string compares exactly.
    """
    capability = torch.backends.cpu.get_cpu_capability().lower()
    flags = cpu_flags(cpuinfo)
    extras = [flag for flag in EXTRA_CPU_FLAGS if flag in flags]
    return "+".join([f"{platform.machine()}-{capability}", *extras])


def gpu_target(device_index: int = 0) -> str | None:
    """The GPU architecture, e.g. ``sm_90:NVIDIA H100 80GB HBM3``; None without a CUDA device."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}:{torch.cuda.get_device_name(device_index)}"


def current_target(device: str = "cpu") -> str:
    """The target a package for ``device`` ("cpu" or "cuda[:N]") must have been built for.

    A CUDA package still contains host code, so its target names both: ``<gpu>/<cpu>``.
    Raises ConfigError (a ValueError) naming the device and the devices torch sees here when
    ``device`` is neither, or names a GPU torch does not see.
    """
    if device == "cpu":
        return cpu_target()
    gpu = None
    if device.startswith("cuda"):
        index = device.split(":", 1)[1] if ":" in device else "0"
        gpu = gpu_target(int(index)) if index.isdigit() else None
        if gpu is not None:
            return f"{gpu}/{cpu_target()}"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = ("torch sees no such CUDA device" if device.startswith("cuda")
           else "expected 'cpu' or 'cuda[:N]'")
    raise ConfigError(f"--device {device!r} cannot be used here: {why}; this machine has "
                      f"{gpus} CUDA device(s) visible to torch", name="device", value=device,
                      limit=["cpu"] + [f"cuda:{i}" for i in range(gpus)])
