"""Restore a snapshot straight into device memory, verified, at the rate the node's link allows.

Every chunk of the snapshot lands in its place in one uint8 device tensor [total_bytes] (a
zygote's :class:`DeviceBuffer`, allocated ahead of need, or a fresh one), each chunk's XXH3-64
compared with the manifest's before any tensor is handed out.  Two strategies do the reading;
``strategy`` (argument, :attr:`DeviceBuffer.strategy`, or the operator's environment variable
``REWARM_RESTORE_STRATEGY``) is "staged", "kvikio" or "auto" (the default):

- **staged** (agent/snapshot/staged.py; ``RestoreStats.mode`` "staged"): ``T`` threads each
  pread chunks into their own pinned, 4 KiB-aligned host slots (O_DIRECT for a cold file),
  hash every piece as it lands (L2-sized pieces, GIL released) and copy the slot to the device
  on their own CUDA stream.  No copy back: the bytes are hashed where they land in host
  memory, and the DMA that moves them is protected by the link's own integrity checks.
- **kvikio** (agent/snapshot/kvikio_read.py; mode :func:`io_path`'s "gds" or "compat"):
  ``kvikio.CuFile.pread`` into device memory with kvikio's thread pool and task size set for
  the node; with GDS the storage DMA lands in device memory, in compat mode kvikio's own
  threads read into its pinned bounce buffers and copy.  Verification copies each chunk back
  device-to-host and hashes it there.
- **auto**: "kvikio" where :func:`io_path` says "gds" (the only path that skips host memory),
  else "staged" on a GPU.  On a device that is not a GPU (the tests' stand-in for device
  memory, a CPU tensor) auto keeps "kvikio": the node agent's and the zygote's tests reach the
  device restore's fallbacks through a fake kvikio there; the staged path runs on a CPU
  device when asked for by name.

Cost model (GB/s = 10^9 bytes/s; ``r`` one core's pread out of the page cache, ``h`` one
core's XXH3-64, ``L`` the pinned host-to-device rate, ``D`` the storage's O_DIRECT rate, ``M``
host memory bandwidth):

- staged, warm: a thread fills a slot at ``1 / (1/r + 1/h)`` (read, then hash from L2), ``T``
  threads at once, bounded by ``min(T / (1/r + 1/h), L, M / 3)``: each byte crosses host memory
  three times (page cache read, slot write-back, DMA read).  Unverified drops the ``1/h``.
  Each slot fill also runs some Python under the GIL (the read call, the copy's dispatch, the
  event), one thread at a time: ``S / o`` for ``o`` seconds of it per fill must stay above
  ``L`` (``o`` = 11 us for the slice and copy dispatch on the development VM: 760 GB/s at 8 MiB).
- staged, cold: ``min(D, ...)``: ``max(T, 16)`` threads keep as many slot-sized O_DIRECT
  reads queued; hashing a slot (``S/h``) is a small share of waiting for it (``S x T / D``).
- kvikio compat: a pool thread reads a task then copies it, in turn, so ``min(T / (1/r +
  1/L_thread), L)`` unverified; verified, every byte also goes device-to-host and is hashed
  (two more host-memory crossings, ``M / 5``), and the hashing threads share the cores.
- kvikio GDS: ``min(D, L)``, the device reading straight into device memory; verification
  as in compat.

Figures: on one H200 node (16 cores, driver 580, no nvidia-fs) kvikio with one thread read
warm at 7.14 GB/s unverified against a pinned copy's ``L`` = 55.2 GB/s, so ``r`` is about
``1 / (1/7.14 - 1/55.2)`` = 8.2 GB/s; ``D`` = 2.11 GB/s (raw O_DIRECT, same bytes).  ``h``:
XXH3-64 (AVX-512 kernel) over 256 KiB pieces just read, still in L2, ran at 47 GB/s per core
on the development VM (a warm staged restore of 1 GiB spent 0.023 core-seconds hashing:
``DeviceRestoreStats.figures``); from memory under load it was 6.7 GB/s.  ``M``: eight channels
of DDR5-4800 give 8 x 38.4 = 307 GB/s by the transfer rate, so ``M / 3`` stays above ``L``.
With ``T`` = 14, ``r`` = 8.2 and a cautious ``h`` = 20 the staged model gives 14 x 5.8 = 81
GB/s of threads, so ``L`` bounds it: the target is 0.7 x ``L``.  bench/throughput_check.py
measures every term on the node (bench/device_check.sh), both strategies side by side, and
notes the per-stage times each restore records
(:class:`~agent.snapshot.staging.DeviceRestoreStats`).

kvikio loads libcuda.so.1 even for host buffers, so it is imported only after
:func:`cuda_driver_present` has found the driver; the ``kvikio`` argument of every function
replaces the module (tests pass tests/fake_kvikio.py, which writes into host tensors).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from agent.errors import (ConfigError, DriverUnavailable, SnapshotIncompatible, SnapshotNotFound,
                          SnapshotTampered)
from agent.snapshot.format import Manifest, Pins
from agent.snapshot.kvikio_read import bounce_buffers, hash_threads, restore_kvikio
from agent.snapshot.manifest import read_manifest
from agent.snapshot.pins import check_pins, machine_pins
from agent.snapshot.reader import (Restored, _close, _open_files, restore_snapshot,
                                   tensor_views)
from agent.snapshot.staged import restore_staged
from agent.snapshot.staging import SLOT_BYTES, Staging

__all__ = ["DeviceBuffer", "DriverUnavailable", "STRATEGIES", "STRATEGY_ENV", "choose_strategy",
           "cuda_driver_present", "device_pins", "hash_threads", "io_path", "load_kvikio",
           "restore_for_device", "restore_to_device"]

log = logging.getLogger(__name__)

STRATEGY_ENV = "REWARM_RESTORE_STRATEGY"
"""The operator's choice of device-restore strategy, when no argument gives one."""
STRATEGIES = ("auto", "staged", "kvikio")
BOUNCE_BYTES = 16 << 20
"""The kvikio strategy's verification bounce buffers: one 16 MiB chunk (the writer's default)."""

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


_PINS: dict[str, Pins] = {}


def device_pins(device: str) -> Pins:
    """machine_pins(device), read once per process and device string: none of the pins can
    change while the process runs (torch, Python and rewarm are loaded; the driver cannot be
    replaced under a live CUDA context), and on a GPU reading them starts and stops NVML
    (agent/snapshot/pins.py), work that does not belong on every restore's clock.  A zygote's
    :meth:`DeviceBuffer.allocate` reads them ahead of need."""
    pins = _PINS.get(device)
    if pins is None:
        pins = _PINS[device] = machine_pins(device)
    return pins


def choose_strategy(requested: str | None = None, device: str = "cuda", kvikio: Any = None, *,
                    nvidia_fs: Path = NVIDIA_FS) -> str:
    """The strategy a restore onto ``device`` uses: "staged" or "kvikio" (module docstring).

    ``requested`` (else ``$REWARM_RESTORE_STRATEGY``, else "auto"): one of STRATEGIES.
    ``kvikio``: the module auto asks :func:`io_path` (loaded here when None and nvidia-fs is
    loaded; without nvidia-fs no read can be GDS).  Raises ConfigError for an unknown name,
    saying where it came from."""
    source = "argument" if requested else STRATEGY_ENV
    name = requested or os.environ.get(STRATEGY_ENV) or "auto"
    if name not in STRATEGIES:
        raise ConfigError(f"device restore strategy {name!r} (from the {source}) is not one of "
                          f"{list(STRATEGIES)}", name="strategy", value=name, limit=list(STRATEGIES))
    if name != "auto":
        return name
    if torch.device(device).type != "cuda":
        return "kvikio"
    if not nvidia_fs.exists():
        return "staged"
    if kvikio is None:
        try:
            kvikio = load_kvikio()
        except DriverUnavailable:
            return "staged"
    return "kvikio" if io_path(kvikio, nvidia_fs) == "gds" else "staged"


@dataclass(eq=False)   # identity: a zygote's warmed engine is keyed by its buffer
class DeviceBuffer:
    """A zygote's restore destination in device memory, made ahead of need.

    ``tensor``: uint8 [capacity_bytes] on ``device``; ``bounce``: the kvikio strategy's
    :func:`hash_threads` + 1 host uint8 tensors (pinned on a GPU) for verification;
    ``kvikio``: the module that reads (None when it could not be loaded: ``unavailable`` says
    why; the kvikio strategy then takes the host path, the staged one does not need it);
    ``strategy``: "staged" | "kvikio", chosen at allocation (None: chosen at each restore);
    ``staging``: the staged strategy's pinned slots, streams and events.  Same interface as
    :class:`~agent.snapshot.reader.HostBuffer` (``capacity_bytes``, ``as_tensor``)."""

    tensor: torch.Tensor
    device: str
    bounce: list[torch.Tensor]
    kvikio: Any = None
    unavailable: str | None = None
    strategy: str | None = None
    staging: Staging | None = None

    @classmethod
    def allocate(cls, nbytes: int, device: str, *, bounce_bytes: int = BOUNCE_BYTES,
                 kvikio: Any = None, strategy: str | None = None, slot_bytes: int = SLOT_BYTES,
                 threads: int | None = None) -> DeviceBuffer:
        """Allocate ``nbytes`` on ``device`` (this also makes the CUDA context), load kvikio
        (``kvikio``: the module to use instead), choose the strategy (:func:`choose_strategy`)
        and make what it needs (:meth:`prepare`): the staged slots of ``slot_bytes`` for
        ``threads`` workers, or the kvikio bounce buffers of ``bounce_bytes``.  Raises
        ConfigError for a negative or misaligned size or an unknown strategy, torch's
        OutOfMemoryError when the device lacks the memory."""
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
        unavailable = None
        if kvikio is None:
            try:
                kvikio = load_kvikio()
            except DriverUnavailable as exc:
                kvikio, unavailable = None, exc.message
        chosen = choose_strategy(strategy, device, kvikio)
        buf = cls(tensor, device, [], kvikio, unavailable, chosen)
        buf.prepare(chosen, bounce_bytes=bounce_bytes, slot_bytes=slot_bytes, threads=threads)
        if dev.type == "cuda":
            try:
                device_pins(device)          # read now, off the restore's clock
            except Exception as exc:  # noqa: BLE001 - the restore reads them again and raises
                log.warning("%s: machine pins not read ahead (%s: %s)", device, type(exc).__name__, exc)
        return buf

    def prepare(self, strategy: str, *, bounce_bytes: int = BOUNCE_BYTES,
                slot_bytes: int = SLOT_BYTES, threads: int | None = None) -> None:
        """Make what ``strategy`` needs if it is not there yet (a restore with another strategy
        than the buffer's calls this on its own clock).  Raises ConfigError (bad sizes)."""
        dev = torch.device(self.device)
        if strategy == "staged" and self.staging is None:
            self.staging = Staging.allocate(dev, threads=threads, slot_bytes=slot_bytes)
        elif strategy == "kvikio" and not self.bounce:
            self.bounce = bounce_buffers(bounce_bytes, dev)

    @property
    def capacity_bytes(self) -> int:
        return self.tensor.numel()

    def as_tensor(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` as a uint8 tensor [nbytes] on the device (a view)."""
        return self.tensor[:nbytes]


def restore_to_device(path: Path | str, *, device: str = "cuda", buffer: DeviceBuffer | None = None,
                      verify: bool = True, key: bytes | None = None, machine: Pins | None = None,
                      accept: Callable[[Manifest], object] | None = None,
                      kvikio: Any = None, strategy: str | None = None) -> Restored:
    """Restore the snapshot at ``path`` into device memory; tensors are views of one uint8
    tensor [total_bytes] on ``device`` (``buffer``'s when given, else a fresh allocation).

    Bytes as stored: each tensor keeps the dtype and shape the manifest records (whatever the
    weight scheme).  ``machine``: the pins to compare (:func:`device_pins` when None);
    ``accept(manifest)``: the caller's check, run after the pins and before any file is opened
    or memory allocated.  ``strategy``: "staged" | "kvikio" | "auto" (default: the buffer's,
    else :func:`choose_strategy`).  ``kvikio``: the module for the kvikio strategy (default:
    ``buffer.kvikio``, else :func:`load_kvikio`).  ``Restored.buffer`` is the DeviceBuffer or
    None (then the tensors keep the allocation alive); ``stats`` is a DeviceRestoreStats,
    ``mode`` "staged", or :func:`io_path`'s "gds" | "compat" for kvikio.  Without a buffer the
    staged slots are allocated on the clock.
    Raises DriverUnavailable (no driver; no kvikio for the kvikio strategy; torch without
    CUDA), SnapshotNotFound, SnapshotTampered, SnapshotIncompatible (pins; before any data is
    read), ConfigError (buffer too small or on another device, unknown strategy),
    SnapshotCorrupt (a short read, a read error or a checksum mismatch, naming the chunk, file
    and tensors), and what kvikio or torch raise (RuntimeError for an I/O error, e.g. EOF).
    After a failure the buffer's contents are undefined; its slots are reusable.
    """
    path = Path(path)
    dev = torch.device(device)
    if dev.type == "cuda" and not cuda_driver_present():
        raise DriverUnavailable("libcuda.so.1 not found: the GPU restore path needs the NVIDIA driver",
                                call="dlopen", result=None, name="libcuda.so.1", missing=["libcuda.so.1"])
    if kvikio is None and buffer is not None:
        kvikio = buffer.kvikio
    if strategy is None and buffer is not None:
        strategy = buffer.strategy
    chosen = choose_strategy(strategy, device, kvikio)
    if chosen == "kvikio" and kvikio is None:
        kvikio = load_kvikio()
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DriverUnavailable(f"torch {torch.__version__} cannot use CUDA here: device memory "
                                "is allocated and copied into with torch", call="torch.cuda.is_available",
                                result=None, name="torch", missing=["torch with CUDA"])
    manifest = read_manifest(path, key)
    check_pins(manifest.pins, machine or device_pins(device), path)
    if accept is not None:
        accept(manifest)
    total = manifest.total_bytes
    if buffer is not None:
        if buffer.capacity_bytes < total:
            raise ConfigError(f"{path}: device buffer holds {buffer.capacity_bytes} bytes, snapshot "
                              f"needs {total}", name="buffer", value=buffer.capacity_bytes, limit=total)
        if torch.device(buffer.device) != dev:
            raise ConfigError(f"{path}: device buffer is on {buffer.device}, restore asked for {device}",
                              name="device", value=buffer.device, limit=device)
    _close(_open_files(path, manifest, direct=False))  # existence and length of every data file
    base = buffer.as_tensor(total) if buffer is not None else torch.empty(total, dtype=torch.uint8,
                                                                           device=dev)
    if chosen == "staged":
        if buffer is not None:
            buffer.prepare("staged")
        staging = buffer.staging if buffer is not None and buffer.staging else Staging.allocate(dev)
        stats = restore_staged(path, manifest, base, staging, verify=verify)
    else:
        stats = restore_kvikio(path, manifest, base, kvikio, mode=io_path(kvikio), verify=verify,
                               bounce=buffer.bounce if buffer is not None else None)
    return Restored(tensor_views(manifest, base), manifest, stats, buffer)  # type: ignore[arg-type]


def restore_for_device(snapshot: Path, buffer: Any, device: str, *, verify: bool = True,
                       threads: int = 2, accept: Callable[[Manifest], object] | None = None,
                       strategy: str | None = None) -> tuple[Restored, str, str | None]:
    """Read a snapshot's bytes for a replica on ``device``, verified: ``(restored, io, fallback)``.

    ``buffer``: a zygote's DeviceBuffer or HostBuffer, or None.  ``strategy``: as
    :func:`restore_to_device`'s.

    On a GPU (``device`` "cuda[:N]", or a DeviceBuffer) the bytes go into the DeviceBuffer (a
    fresh device allocation when it is too small), ``io`` "staged", "gds" or "compat"; when
    that fails for a reason the host path does not share (no driver or kvikio, a failed or
    short read, a chunk that did not verify, no device memory) the host path reads them again
    into host memory, verifying every chunk anew, ``io`` "host" and ``fallback`` the reason.
    A refusal the host path would repeat (not found, tampered, pins, not a replica snapshot) is
    raised at once.  The host path's errors propagate (the node agent then tries its next
    rung: another copy or a cold boot)."""
    on_device = isinstance(buffer, DeviceBuffer)
    fallback = None
    if on_device or device != "cpu":
        target = buffer if on_device else None
        try:
            if target is not None and read_manifest(snapshot).total_bytes > target.capacity_bytes:
                target = None             # too large for the zygote's buffer: a fresh one
            restored = restore_to_device(snapshot, device=device,
                                         buffer=target, verify=verify, accept=accept,
                                         kvikio=buffer.kvikio if on_device else None,
                                         strategy=strategy or (buffer.strategy if on_device else None))
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
