"""Restore straight into device memory with kvikio (GPUDirect Storage, or its POSIX compat mode).

kvikio loads libcuda.so.1 even for host buffers, so it is imported only after
:func:`cuda_driver_present` has found the driver; nothing on the CPU path imports this module's
kvikio side.  Verification: each chunk lands in device memory; when ``verify`` is set it is
copied back through one pinned host bounce buffer and hashed with the same XXH3-64 as the host
path (costs a device-to-host copy of the snapshot; the signed manifest still covers tampering).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from agent import _restore
from agent.errors import DriverUnavailable, SnapshotCorrupt
from agent.snapshot.format import Pins
from agent.snapshot.manifest import read_manifest
from agent.snapshot.pins import check_pins, machine_pins
from agent.snapshot.reader import Restored, RestoreStats, _open_files, _close, tensor_views


def cuda_driver_present() -> bool:
    """True when libcuda.so.1 can be loaded (the NVIDIA driver is installed)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _kvikio():
    if not cuda_driver_present():
        raise DriverUnavailable("libcuda.so.1 not found: the GPU restore path needs the NVIDIA driver",
                                call="dlopen", result=None, name="libcuda.so.1", missing=["libcuda.so.1"])
    import kvikio  # the optional `gpu` extra
    return kvikio


def restore_to_device(path: Path | str, *, device: str = "cuda", verify: bool = True, key: bytes | None = None,
                      machine: Pins | None = None) -> Restored:
    """Restore the snapshot at ``path`` into one uint8 CUDA tensor [total_bytes]; views per tensor.

    Raises DriverUnavailable without the driver, and the errors of restore_snapshot.
    ``Restored.buffer`` is None here: the tensors keep the device allocation alive.
    """
    kvikio = _kvikio()
    path = Path(path)
    manifest = read_manifest(path, key)
    check_pins(manifest.pins, machine or machine_pins(device), path)
    _close(_open_files(path, manifest))  # existence and length of every data file
    total = manifest.total_bytes
    base = torch.empty(total, dtype=torch.uint8, device=device)
    start = time.perf_counter()
    handles = {name: kvikio.CuFile(path / name, "r") for name in {c.file for c in manifest.chunks}}
    try:
        futures = [handles[c.file].pread(base[c.buffer_offset:c.buffer_offset + c.length], c.length, c.offset)
                   for c in manifest.chunks]
        got = [f.get() for f in futures]
    finally:
        for h in handles.values():
            h.close()
    torch.cuda.synchronize(base.device)
    bounce = torch.empty(max((c.length for c in manifest.chunks), default=1), dtype=torch.uint8).pin_memory()
    for i, c in enumerate(manifest.chunks):
        if got[i] != c.length:
            raise SnapshotCorrupt(f"{path / c.file}: chunk {i} read {got[i]} of {c.length} bytes",
                                  path=path / c.file, chunk=i, tensors=manifest.chunk_tensors(i),
                                  expected=c.length, actual=got[i])
        if verify:
            bounce[:c.length].copy_(base[c.buffer_offset:c.buffer_offset + c.length])
            actual = _restore.xxh3_64(bounce[:c.length].numpy())
            if actual != c.checksum:
                raise SnapshotCorrupt(f"{path / c.file}: chunk {i} XXH3-64 expected {c.checksum:016x}, "
                                      f"actual {actual:016x}; covers tensors {manifest.chunk_tensors(i)[:8]}",
                                      path=path / c.file, chunk=i, tensors=manifest.chunk_tensors(i),
                                      expected=c.checksum, actual=actual)
    seconds = time.perf_counter() - start
    stats = RestoreStats(bytes=total, seconds=seconds, odirect=False, direct_chunks=0,
                         chunks=len(manifest.chunks), threads=0, verified=verify)
    return Restored(tensor_views(manifest, base), manifest, stats, None)
