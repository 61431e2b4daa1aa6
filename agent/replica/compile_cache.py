"""Where the just-in-time compiler keeps its caches: one directory per GPU type, CPU target
and torch version, shareable between nodes of the same kind.

torch.compile writes generated code and autotuning results to three caches, each found through
an environment variable: Inductor (``TORCHINDUCTOR_CACHE_DIR``: FX graph and C++/Triton code
cache), Triton (``TRITON_CACHE_DIR``: compiled GPU kernels) and the CUDA driver's JIT cache
(``CUDA_CACHE_PATH``: PTX compiled to SASS).  A cache written on one target must never be read
on another (code built for AVX-512 crashes a CPU without it), so the key names the target and
the torch version, e.g. ``<root>/torch-2.13.0+cpu/cpu/x86_64-avx512+avx512_vnni``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from collections.abc import MutableMapping

import torch

from agent.replica.targets import cpu_target, gpu_target

CACHE_ENV = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "CUDA_CACHE_PATH": "cuda",
}


def _safe(part: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", part).strip("_") or "_"


def cache_key(device: str = "cpu") -> str:
    """The relative directory for this machine: ``torch-<ver>/<gpu or cpu>/<cpu target>``."""
    gpu = gpu_target() if device.startswith("cuda") else None
    return "/".join([_safe(f"torch-{torch.__version__}"), _safe(gpu or "cpu"), _safe(cpu_target())])


def cache_dir(root: Path, device: str = "cpu") -> Path:
    """``root / cache_key(device)``; not created."""
    return Path(root) / cache_key(device)


def apply_cache_env(root: Path, device: str = "cpu",
                    environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Point the Inductor, Triton and CUDA caches under :func:`cache_dir` and create them.

    Call it before the first ``torch.compile`` of the process (Inductor reads the variables
    when it first needs a cache).  Returns the variables set; ``environ`` defaults to os.environ
    (pass a dict to prepare a child process's environment).
    """
    environ = os.environ if environ is None else environ
    base = cache_dir(root, device)
    chosen: dict[str, str] = {}
    for variable, sub in CACHE_ENV.items():
        path = base / sub
        path.mkdir(parents=True, exist_ok=True)
        environ[variable] = str(path)
        chosen[variable] = str(path)
    return chosen
