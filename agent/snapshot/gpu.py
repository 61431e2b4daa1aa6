"""Restore straight into device memory with kvikio (GPUDirect Storage, or its POSIX compat mode).

Where the bytes go: every chunk of the snapshot is read by ``kvikio.CuFile.pread`` into its
place in one uint8 device tensor [total_bytes] (a zygote's :class:`DeviceBuffer`, allocated
ahead of need, or a fresh one).  With GDS (kvikio not in compat mode and the ``nvidia-fs``
kernel module loaded) the storage DMA lands in device memory; in kvikio's compat mode its own
threads ``pread`` into a pinned host bounce buffer and copy host-to-device
(kvikio ``docs/source/runtime_settings.rst``, "Compatibility Mode").  :func:`io_path` says
which, and :class:`~agent.snapshot.reader.RestoreStats` ``mode`` records it ("gds" | "compat").

Verification (``verify``): the same XXH3-64 per chunk as the host path, on the host.  Each
chunk, once its read has completed, is copied device-to-host (in chunk order, on one side
stream) into a free pinned bounce buffer and hashed on one of :func:`hash_threads` threads (the
GIL released, ``agent._restore.xxh3_64``), while later chunks' copies run and their reads are
still in kvikio's thread pool.  Cost model: with ``T`` hashing threads at ``h`` GB/s each and a
device-to-host copy rate ``d``, the verification streams at ``min(d, T x h)``, so a verified
restore takes about ``max(read_s, total_bytes / min(d, T x h))`` plus one chunk's copy and hash
at the end, against ``read_s`` unverified (``h`` measured 6.7 GB/s on one core of the 2-core
development VM, see :data:`MAX_HASH_THREADS`; ``d`` is the pinned copy rate of the GPU's link).
The D2H copy shares no direction with the reads (H2D, or the storage DMA), so on a full-duplex
link it costs link time only in the other direction.  A device-side hash would save the copy
but needs a CUDA XXH3 kernel the package does not ship.  bench/device_check.sh measures the
verified and unverified rates side by side, so the cost is a figure on the GPU node, not this
model's guess.  The signed manifest covers tampering either way.

kvikio loads libcuda.so.1 even for host buffers, so it is imported only after
:func:`cuda_driver_present` has found the driver; the ``kvikio`` argument of every function
replaces the module (tests pass tests/fake_kvikio.py, which writes into host tensors).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from agent import _restore
from agent.errors import (ConfigError, DriverUnavailable, SnapshotCorrupt, SnapshotIncompatible,
                          SnapshotNotFound, SnapshotTampered)
from agent.snapshot.format import Manifest, Pins
from agent.snapshot.manifest import read_manifest
from agent.snapshot.pins import check_pins, machine_pins
from agent.snapshot.reader import (Restored, RestoreStats, _close, _open_files, restore_snapshot,
                                   tensor_views)

log = logging.getLogger(__name__)

MAX_HASH_THREADS = 8
"""XXH3-64 ran at 6.7 GB/s on one core of the 2-core development VM (1 GiB, best of 3, load
8.6); eight threads keep verification above a PCIe 5 x16 link's ~50 GB/s where the cores run
as fast, and the bench reports verified and unverified rates side by side."""

NVIDIA_FS = Path("/proc/driver/nvidia-fs")
"""Present when the GDS kernel module (nvidia-fs) is loaded; without it cuFile reads through
its own compatibility path even when kvikio is not in compat mode."""


def cuda_driver_present() -> bool:
    """True when libcuda.so.1 can be loaded (the NVIDIA driver is installed)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def load_kvikio() -> Any:
    """The kvikio module.  Raises DriverUnavailable without libcuda.so.1 (kvikio would fail to
    load) or without kvikio itself (the optional ``gpu`` extra), naming what is missing."""
    if not cuda_driver_present():
        raise DriverUnavailable("libcuda.so.1 not found: the GPU restore path needs the NVIDIA driver",
                                call="dlopen", result=None, name="libcuda.so.1", missing=["libcuda.so.1"])
    try:
        import kvikio  # the optional `gpu` extra (kvikio-cu13)
        # `import kvikio` does not import its `defaults` submodule (kvikio 26.10
        # python/kvikio/kvikio/__init__.py imports only kvikio._lib.defaults), and io_path
        # reads it: import it by name, as kvikio's own docs do (`import kvikio.defaults`).
        import kvikio.defaults  # noqa: F401
    except ImportError as exc:
        raise DriverUnavailable(f"kvikio not importable ({exc}): install the gpu extra",
                                call="import", result=None, name="kvikio",
                                missing=["kvikio"]) from exc
    return kvikio


def io_path(kvikio: Any, nvidia_fs: Path = NVIDIA_FS) -> str:
    """"gds" when kvikio reads through cuFile and nvidia-fs is loaded, else "compat".

    ``kvikio.defaults.is_compat_mode_preferred()`` is kvikio's own answer (25.04 and later;
    older releases have ``defaults.compat_mode()``, an enum whose false value is OFF)."""
    defaults = kvikio.defaults
    if hasattr(defaults, "is_compat_mode_preferred"):
        compat = bool(defaults.is_compat_mode_preferred())
    else:
        compat = bool(defaults.compat_mode())
    return "gds" if not compat and nvidia_fs.exists() else "compat"


def _pinned(nbytes: int, device: torch.device) -> torch.Tensor:
    """A host uint8 tensor [nbytes], page-locked when ``device`` is a GPU (the copy engine
    reads pinned memory at full rate; pageable memory is staged by the driver)."""
    return torch.empty(max(1, nbytes), dtype=torch.uint8, pin_memory=device.type == "cuda")


@dataclass(eq=False)   # identity: a zygote's warmed engine is keyed by its buffer
class DeviceBuffer:
    """A zygote's restore destination in device memory, made ahead of need.

    ``tensor``: uint8 [capacity_bytes] on ``device``; ``bounce``: :func:`hash_threads` + 1
    host uint8 tensors [bounce_bytes] (pinned on a GPU) for verification; ``kvikio``: the module that reads
    (None when it could not be loaded: ``unavailable`` says why, and a restore then takes the
    host path).  Same interface as :class:`~agent.snapshot.reader.HostBuffer`
    (``capacity_bytes``, ``as_tensor``)."""

    tensor: torch.Tensor
    device: str
    bounce: list[torch.Tensor]
    kvikio: Any = None
    unavailable: str | None = None

    @classmethod
    def allocate(cls, nbytes: int, device: str, *, bounce_bytes: int = 16 << 20,
                 kvikio: Any = None) -> DeviceBuffer:
        """Allocate ``nbytes`` on ``device`` (this also makes the CUDA context) and the
        bounce buffers of ``bounce_bytes``; load kvikio (``kvikio``: the module to use instead).
        Raises ConfigError for a negative size, torch's OutOfMemoryError when the device
        lacks the memory."""
        for name, value in (("nbytes", nbytes), ("bounce_bytes", bounce_bytes)):
            if value < 0:
                raise ConfigError(f"DeviceBuffer {name}={value} is negative; limit >= 0",
                                  name=name, value=value, limit=0)
        dev = torch.device(device)
        # zeroed, not empty: a zygote warmed for a snapshot runs the golden calls on whatever
        # the buffer holds before its restore (agent/replica/zygote.py warm_zygote), and
        # uninitialised memory decoded as weights can give NaN logits, which its sampling
        # refuses (the warm-up was then skipped; seen as a flaky test on the CPU stand-in).
        # Zeroing happens ahead of need, off the restore's clock.
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        bounce = [_pinned(bounce_bytes, dev) for _ in range(hash_threads() + 1)]
        unavailable = None
        if kvikio is None:
            try:
                kvikio = load_kvikio()
            except DriverUnavailable as exc:
                kvikio, unavailable = None, exc.message
        return cls(tensor, device, bounce, kvikio, unavailable)

    @property
    def capacity_bytes(self) -> int:
        return self.tensor.numel()

    def as_tensor(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` as a uint8 tensor [nbytes] on the device (a view)."""
        return self.tensor[:nbytes]


class _Verifier:
    """XXH3-64 of chunks already in device memory, through ``len(bounce)`` pinned bounce
    buffers and ``len(bounce) - 1`` hashing threads: a chunk's device-to-host copy (in order,
    on one side stream) overlaps the hashes of the chunks before it, which run in parallel
    (``agent._restore.xxh3_64`` releases the GIL)."""

    def __init__(self, path: Path, manifest: Manifest, base: torch.Tensor,
                 bounce: list[torch.Tensor] | None) -> None:
        self.path, self.manifest, self.base = path, manifest, base
        need = max((c.length for c in manifest.chunks), default=1)
        if not bounce or len(bounce) < 2 or min(b.numel() for b in bounce) < need:
            bounce = [_pinned(need, base.device) for _ in range(hash_threads() + 1)]
        self.free = list(bounce)
        self.cuda = base.device.type == "cuda"
        self.stream = torch.cuda.Stream(base.device) if self.cuda else None
        self.pool = ThreadPoolExecutor(len(bounce) - 1, thread_name_prefix="verify")
        self.pending: deque[tuple[Future, torch.Tensor]] = deque()   # hashes under way, in order

    def add(self, i: int) -> None:
        """Copy chunk ``i`` (its read has completed) into a free bounce buffer and hash it on
        the pool; waits for the oldest hash when every buffer is in use (raising its
        SnapshotCorrupt)."""
        c = self.manifest.chunks[i]
        if not self.free:
            future, slot = self.pending.popleft()
            future.result()
            self.free.append(slot)
        slot = self.free.pop()
        dst, src = slot[:c.length], self.base[c.buffer_offset:c.buffer_offset + c.length]
        event = None
        if self.cuda:
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
        else:
            dst.copy_(src)
        self.pending.append((self.pool.submit(self._hash, i, dst, event), slot))

    def finish(self) -> None:
        """Wait for every hash; raises the first chunk's SnapshotCorrupt in chunk order."""
        while self.pending:
            future, slot = self.pending.popleft()
            future.result()
            self.free.append(slot)

    def close(self) -> None:
        """Stop the pool, waiting for hashes under way (they read the bounce buffers)."""
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _hash(self, i: int, data: torch.Tensor, event: Any) -> None:
        if event is not None:
            event.synchronize()
        c = self.manifest.chunks[i]
        actual = _restore.xxh3_64(data.numpy())
        if actual != c.checksum:
            raise SnapshotCorrupt(f"{self.path / c.file}: chunk {i} XXH3-64 expected {c.checksum:016x}, "
                                  f"actual {actual:016x}; covers tensors {self.manifest.chunk_tensors(i)[:8]}",
                                  path=self.path / c.file, chunk=i, tensors=self.manifest.chunk_tensors(i),
                                  expected=c.checksum, actual=actual)


def hash_threads() -> int:
    """Hashing threads for a verified device restore: the cores, at most MAX_HASH_THREADS."""
    return max(1, min(MAX_HASH_THREADS, os.cpu_count() or 1))


def restore_to_device(path: Path | str, *, device: str = "cuda", buffer: DeviceBuffer | None = None,
                      verify: bool = True, key: bytes | None = None, machine: Pins | None = None,
                      accept: Callable[[Manifest], object] | None = None,
                      kvikio: Any = None) -> Restored:
    """Restore the snapshot at ``path`` into device memory; tensors are views of one uint8
    tensor [total_bytes] on ``device`` (``buffer``'s when given, else a fresh allocation).

    Bytes as stored: each tensor keeps the dtype and shape the manifest records (whatever the
    weight scheme).  ``machine``: the pins to compare (machine_pins(device) when None);
    ``accept(manifest)``: the caller's check, run after the pins and before any file is opened
    or memory allocated.  ``kvikio``: the module (default: ``buffer.kvikio``, else
    :func:`load_kvikio`).  ``Restored.buffer`` is the DeviceBuffer or None (then the tensors
    keep the allocation alive); ``stats.mode`` is :func:`io_path`'s answer.
    Raises DriverUnavailable (no driver, no kvikio), SnapshotNotFound, SnapshotTampered,
    SnapshotIncompatible (pins; before any data is read), ConfigError (buffer too small or on
    another device), SnapshotCorrupt (a short read or a checksum mismatch, naming the chunk,
    file and tensors), and what kvikio raises (RuntimeError for an I/O error, e.g. EOF).
    After a failure the buffer's contents are undefined.
    """
    path = Path(path)
    if kvikio is None:
        kvikio = buffer.kvikio if buffer is not None and buffer.kvikio is not None else load_kvikio()
    manifest = read_manifest(path, key)
    check_pins(manifest.pins, machine or machine_pins(device), path)
    if accept is not None:
        accept(manifest)
    total = manifest.total_bytes
    if buffer is not None:
        if buffer.capacity_bytes < total:
            raise ConfigError(f"{path}: device buffer holds {buffer.capacity_bytes} bytes, snapshot "
                              f"needs {total}", name="buffer", value=buffer.capacity_bytes, limit=total)
        if torch.device(buffer.device) != torch.device(device):
            raise ConfigError(f"{path}: device buffer is on {buffer.device}, restore asked for {device}",
                              name="device", value=buffer.device, limit=device)
    _close(_open_files(path, manifest, direct=False))  # existence and length of every data file
    base = buffer.as_tensor(total) if buffer is not None else torch.empty(total, dtype=torch.uint8,
                                                                           device=device)
    mode = io_path(kvikio)
    start = time.perf_counter()
    handles = {name: kvikio.CuFile(path / name, "r") for name in sorted({c.file for c in manifest.chunks})}
    futures: list[Any] = []
    waited = 0                  # futures[:waited] have been waited for
    verifier = None
    try:
        for c in manifest.chunks:
            futures.append(handles[c.file].pread(base[c.buffer_offset:c.buffer_offset + c.length],
                                                 c.length, c.offset))
        verifier = _Verifier(path, manifest, base, buffer.bounce if buffer else None) if verify else None
        for i, c in enumerate(manifest.chunks):
            got = futures[i].get()
            waited = i + 1
            if got != c.length:
                raise SnapshotCorrupt(f"{path / c.file}: chunk {i} read {got} of {c.length} bytes",
                                      path=path / c.file, chunk=i, tensors=manifest.chunk_tensors(i),
                                      expected=c.length, actual=got)
            if verifier is not None:
                verifier.add(i)
        if verifier is not None:
            verifier.finish()
    finally:
        for future in futures[waited:]:
            _settle(future)
        for h in handles.values():
            h.close()
        if verifier is not None:
            verifier.close()
    if base.device.type == "cuda":
        torch.cuda.synchronize(base.device)
    seconds = time.perf_counter() - start
    stats = RestoreStats(bytes=total, seconds=seconds, odirect=mode == "gds", direct_chunks=0,
                         chunks=len(manifest.chunks), threads=0, verified=verify, mode=mode)
    return Restored(tensor_views(manifest, base), manifest, stats, buffer)  # type: ignore[arg-type]


def _settle(future: Any) -> None:
    """Wait for a read still in flight before its file is closed (kvikio: "must wait for
    futures before exiting block"); its error was already raised, or is not ours to raise."""
    try:
        future.get()
    except Exception:  # noqa: BLE001 - the first failure is the one being raised
        pass


def restore_for_device(snapshot: Path, buffer: Any, device: str, *, verify: bool = True,
                       threads: int = 2, accept: Callable[[Manifest], object] | None = None,
                       ) -> tuple[Restored, str, str | None]:
    """Read a snapshot's bytes for a replica on ``device``, verified: ``(restored, io, fallback)``.

    ``buffer``: a zygote's DeviceBuffer or HostBuffer, or None.

    On a GPU (``device`` "cuda[:N]", or a DeviceBuffer) the bytes go through kvikio into the
    DeviceBuffer (a fresh device allocation when it is too small), ``io`` "gds" or "compat";
    when that fails for a reason the host path does not share (no kvikio, a failed or short
    read, a chunk that did not verify in device memory, no device memory) the host path reads
    them again into host memory, verifying every chunk anew, ``io`` "host" and ``fallback`` the
    reason.  A refusal the host path would repeat (not found, tampered, pins, not a replica
    snapshot) is raised at once.  The host path's errors propagate (the node agent then tries
    its next rung: another copy or a cold boot)."""
    on_device = isinstance(buffer, DeviceBuffer)
    fallback = None
    if on_device or device != "cpu":
        target = buffer if on_device else None
        try:
            if target is not None and read_manifest(snapshot).total_bytes > target.capacity_bytes:
                target = None             # too large for the zygote's buffer: a fresh one
            restored = restore_to_device(snapshot, device=device, buffer=target, verify=verify,
                                         accept=accept, kvikio=buffer.kvikio if on_device else None)
            return restored, restored.stats.mode, None
        except (SnapshotIncompatible, SnapshotNotFound, SnapshotTampered):
            raise
        except (OSError, RuntimeError, ValueError) as exc:  # DriverUnavailable, SnapshotCorrupt,
            fallback = f"{type(exc).__name__}: {exc}"       # ConfigError, kvikio, out of memory
            log.warning("%s: device restore onto %s failed (%s); reading through host memory",
                        snapshot, device, fallback, extra={"snapshot": str(snapshot)})
    host = None if on_device else buffer
    restored = restore_snapshot(snapshot, buffer=host, verify=verify, threads=threads, accept=accept)
    return restored, "host", fallback

