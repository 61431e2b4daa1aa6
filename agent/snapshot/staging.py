"""Host staging memory for a restore into device memory, made ahead of need, and its stats.

:class:`Staging` is what the staged device restore (agent/snapshot/staged.py) reads into:
``sets`` groups of ``per_set`` slots, each slot ``slot_bytes`` of host memory starting on a
4 KiB boundary (O_DIRECT needs the logical block size; format.ALIGN) in memory backed by
huge pages where the kernel gives them (:func:`staging_memory`), page-locked when the
device is a GPU (the copy engine reads pinned memory by DMA at the link's rate; pageable
memory is first copied by the driver into its own pinned buffer: CUDA C++ Programming Guide,
"Page-Locked Host Memory").  One worker thread owns one set, its CUDA stream and one CUDA event
per slot, so a slot is refilled only after the copy out of it has finished, and no two threads
ever share a slot.  All slots are carved from one allocation.

A zygote makes its Staging in :meth:`agent.snapshot.gpu.DeviceBuffer.allocate`, off the
restore's clock: the pinning (the driver locks every page), the streams and the events (CUDA
creates an event on its first record: each is recorded once here) are all paid there.

On a device that is not a GPU (the tests' stand-in for device memory: a CPU or meta tensor)
nothing is pinned (the slots are faulted in at allocation, so their pages are resident as
pinned ones are) and there are no streams or events: copies are synchronous.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent.errors import ConfigError
from agent.snapshot.format import ALIGN, Manifest
from agent.snapshot.reader import RestoreStats, page_cache_share

SLOT_BYTES = 8 << 20
"""One slot: one pread (O_DIRECT) or 32 buffered pieces of 256 KiB, and one host-to-device
copy.  Per fill the worker's Python costs some tens of microseconds (the read call, the copy's
dispatch, the event), a few per cent of the 1-2 ms an 8 MiB fill takes at one core's 4-8 GB/s;
smaller slots spend more of it under the GIL, larger ones pin more memory."""
SLOTS_PER_THREAD = 2
"""Two: one being filled while the copy out of the other runs."""
COLD_READS = 16
"""Slot sets (so threads, so O_DIRECT reads in flight) of a cold staged restore, however few
the cores: 16 x 8 MiB in flight, as the raw-read limit's 8 x 16 MiB.  Measured on the
development VM (1 GiB, cold, read and hash only, 3 rounds each against the raw read of the
same run): 8 threads 0.85 x, 12 threads 0.92 x, 16 threads 0.94 x the raw read."""
MAX_STAGED_THREADS = 16
"""A cap on the staged workers: past it a PCIe 5 x16 link (~55 GB/s pinned) is already fed by
threads each doing 4+ GB/s."""


CACHE_PROBES = 64
"""4 KiB reads that judge whether a snapshot is in the page cache (:func:`cached_share`)."""


def cached_share(path: Path, manifest: Manifest, fds: dict[str, tuple[int, int]]) -> float:
    """Share (0..1) of CACHE_PROBES 4 KiB reads, spread evenly over the chunks, that the page
    cache answers without I/O: ``preadv`` with RWF_NOWAIT (Linux 4.14) fails with EAGAIN
    when the bytes are not cached.  ``fds``: reader._open_files's descriptors.  The restore
    asks this on its clock, and reader.page_cache_share (mincore over every page) cost 9 ms a
    GiB on the development VM, 0.15 s for an 8B model's 16 GB against the ~0.3 s its warm
    restore takes; 64 probes cost under a millisecond.  A probe that misses starts the
    kernel's read-ahead there (harmless: those pages are read next anyway).  Where RWF_NOWAIT
    is not supported the mincore measure answers."""
    chunks = manifest.chunks
    n = min(CACHE_PROBES, len(chunks))
    if n == 0:
        return 0.0
    probe, hits = bytearray(ALIGN), 0
    for k in range(n):
        c = chunks[k * len(chunks) // n]
        offset = c.offset + (c.length // 2) // ALIGN * ALIGN
        try:
            os.preadv(fds[c.file][1], [probe], offset, os.RWF_NOWAIT)
            hits += 1
        except BlockingIOError:
            pass
        except (AttributeError, OSError):     # no RWF_NOWAIT here (EOPNOTSUPP, EINVAL)
            return page_cache_share(path, manifest, fds)
    return hits / n


def staged_threads() -> int:
    """Worker threads for a warm staged restore: the cores this process may run on, less two
    (the caller's thread and the rest of the process), at least 2, at most MAX_STAGED_THREADS.
    A cold restore uses at least COLD_READS (its threads mostly wait on the device)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(2, min(MAX_STAGED_THREADS, cores - 2))


def staging_memory(nbytes: int, cuda: bool) -> tuple[torch.Tensor, Any]:
    """Host uint8 tensor [nbytes] for slots, and the object that owns it (keep it alive).

    An anonymous map (page-aligned) asked for transparent huge pages and faulted in now
    (reader.HostBuffer.allocate with prefault): an O_DIRECT read of a slot then spans a few
    2 MiB pages instead of 2048 4 KiB ones per 8 MiB (on the development VM, 8 threads of cold
    8 MiB reads went from 1.5 to 2.2-2.8 GB/s against 3.2 for the raw read, whose buffer is
    such a map).  On a GPU it is then page-locked with cudaHostRegister (flag 1,
    cudaHostRegisterPortable; through ``torch.cuda.cudart()``, as torch's own
    torch/cuda/_pin_memory_utils.py does), unregistered when the owner is collected; where
    the driver refuses, torch's pinned allocator serves instead (:func:`aligned_host`)."""
    from agent.snapshot.reader import HostBuffer

    owner = HostBuffer.allocate(nbytes, prefault=True, huge=True)
    tensor = owner.as_tensor(nbytes)
    if not cuda or nbytes == 0:
        return tensor, owner
    ptr = tensor.data_ptr()
    if int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)) != 0:
        del tensor
        owner.release()
        pinned = aligned_host(nbytes, pin=True)
        return pinned, pinned
    weakref.finalize(owner, _unregister, ptr)
    return tensor, owner


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:   # noqa: BLE001 - at exit the driver may be gone; nothing to undo then
        pass


def aligned_host(nbytes: int, pin: bool) -> torch.Tensor:
    """A host uint8 tensor [nbytes] whose first byte is on a 4 KiB boundary, page-locked when
    ``pin`` (torch's pinned allocator; its blocks are page-aligned, and the slice below is the
    fallback if one is not)."""
    raw = torch.empty(max(1, nbytes), dtype=torch.uint8, pin_memory=pin)
    if raw.data_ptr() % ALIGN == 0:
        return raw[:nbytes]
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


@dataclass(eq=False)
class Slot:
    """One staging slot: ``tensor`` uint8 [slot_bytes] (host), ``array`` the same bytes as a
    numpy array (what agent._restore.read_into writes through the buffer protocol), ``event``
    the CUDA event recorded after the last copy out of it (None off a GPU)."""

    tensor: torch.Tensor
    array: Any
    event: Any = None

    def wait(self) -> None:
        """Block (GIL released: torch's Event.synchronize) until the last copy out of this slot
        has finished; at once for a slot never copied from or off a GPU."""
        if self.event is not None:
            self.event.synchronize()


@dataclass(eq=False)
class Staging:
    """``sets`` x ``per_set`` slots of ``slot_bytes`` for ``device``, one CUDA stream per set."""

    device: torch.device
    slot_bytes: int
    sets: list[list[Slot]]
    streams: list[Any] = field(default_factory=list)   # torch.cuda.Stream per set, [] off a GPU
    memory: torch.Tensor | None = None                  # the one allocation every slot views
    workers: int = 0            # threads of a warm restore (0: staged_threads()); a cold one
                                # uses every set
    owner: Any = None           # what keeps ``memory`` mapped and registered (staging_memory)

    @classmethod
    def allocate(cls, device: torch.device | str, *, threads: int | None = None,
                 slot_bytes: int = SLOT_BYTES, per_set: int = SLOTS_PER_THREAD) -> Staging:
        """Slots for ``threads`` workers of a warm restore (default staged_threads()), at
        least COLD_READS sets so a cold restore can keep that many reads queued.  Raises
        ConfigError for a slot size that is not a positive multiple of 4 KiB or fewer than one
        slot per set."""
        device = torch.device(device)
        if slot_bytes <= 0 or slot_bytes % ALIGN:
            raise ConfigError(f"staging slot_bytes={slot_bytes} must be a positive multiple of "
                              f"{ALIGN}", name="slot_bytes", value=slot_bytes, limit=ALIGN)
        if per_set < 1:
            raise ConfigError(f"staging per_set={per_set} slots per thread; limit >= 1",
                              name="per_set", value=per_set, limit=1)
        workers = threads or staged_threads()
        nsets = max(workers, COLD_READS)
        cuda = device.type == "cuda"
        memory, owner = staging_memory(nsets * per_set * slot_bytes, cuda)
        streams = [torch.cuda.Stream(device) for _ in range(nsets)] if cuda else []
        sets = []
        for s in range(nsets):
            slots = []
            for k in range(per_set):
                lo = (s * per_set + k) * slot_bytes
                view = memory[lo:lo + slot_bytes]
                event = None
                if cuda:
                    event = torch.cuda.Event(blocking=True)   # a waiting worker sleeps
                    event.record(streams[s])                  # created now, not on the clock
                slots.append(Slot(view, view.numpy(), event))
            sets.append(slots)
        return cls(device, slot_bytes, sets, streams, memory, workers, owner)

    @property
    def threads(self) -> int:
        """Workers this staging can serve at once (one slot set each)."""
        return len(self.sets)

    @property
    def nbytes(self) -> int:
        return self.threads * len(self.sets[0]) * self.slot_bytes if self.sets else 0

    def quiesce(self) -> None:
        """Wait until no copy reads any slot (every stream's work, so also a copy whose event a
        failure kept from being recorded): after this the slots can be refilled by any thread,
        e.g. by the next restore after a failed one."""
        for stream in self.streams:
            stream.synchronize()
        for slots in self.sets:
            for slot in slots:
                slot.wait()


@dataclass(frozen=True)
class DeviceRestoreStats(RestoreStats):
    """RestoreStats of a restore into device memory.  ``mode``: "gds" | "compat" (kvikio, as
    agent.snapshot.gpu.io_path answers) | "staged"; ``strategy``: "kvikio" | "staged";
    ``figures``: the strategy's own settings and per-stage times (seconds summed over its
    threads), so a slow restore says where its time went:

    - staged: ``threads``, ``slot_bytes``, ``read_s`` (in pread), ``hash_s`` (in XXH3),
      ``slot_wait_s`` (waiting for a slot's previous copy: the link is the limit),
      ``issue_s`` (dispatching the copies), ``fills`` (slot fills), ``cold`` (O_DIRECT asked);
    - kvikio: ``num_threads``, ``task_size``, ``bounce_buffer_size``, ``auto_direct_io_read``,
      ``verify_wait_s`` (waiting for hashes after the reads)."""

    strategy: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
