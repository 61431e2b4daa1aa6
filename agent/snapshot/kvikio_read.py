"""The kvikio device restore: ``CuFile.pread`` into device memory, kvikio's thread pool tuned.

Every chunk of the snapshot is read by ``kvikio.CuFile.pread`` (python/kvikio/kvikio/cufile.py)
into its place in the uint8 device tensor.  With GDS (kvikio not in compat mode and nvidia-fs
loaded) the storage DMA lands in device memory: the only path that skips host memory.  In
kvikio's compat mode each task of ``task_size`` bytes is read by one pool thread with pread
into a pinned bounce buffer, copied host-to-device and the thread's stream synchronised, in
that order (cpp/include/kvikio/detail/posix_io.hpp ``posix_device_io``): a thread overlaps
nothing, so the pool's size is what parallelises the reads.  kvikio's defaults (1 thread,
4 MiB tasks: docs/source/runtime_settings.rst) made this path run at 0.13 x the link.

Settings (:func:`kvikio_settings`), applied with ``kvikio.defaults.set(dict)`` as the context
manager it returns (python/kvikio/kvikio/defaults.py: the values change when ``set`` is called
and the old ones come back when the block ends), around the reads only:

- ``num_threads``: the staged path's thread count (staging.staged_threads(): cores - 2);
- ``task_size``: KVIKIO_TASK_BYTES, so a 16 MiB chunk spreads over two pool threads and each
  task costs one pread, one copy and one stream synchronise;
- ``bounce_buffer_size``: at least the task size, so a task is one bounce-buffer fill; never
  below what is set already (kvikio frees and reallocates its whole pinned pool when the size
  changes: cpp/include/kvikio/bounce_buffer.hpp ``_ensure_buffer_size``);
- ``auto_direct_io_read``: True for a cold snapshot (O_DIRECT reads into kvikio's page-aligned
  pinned bounce buffers instead of filling the page cache), as the host path's rule decides.

A new pool size makes kvikio join its threads and start new ones (cpp/include/kvikio/defaults.hpp
``set_thread_pool_nthreads``), under a millisecond for 14 threads; each new thread makes its own
CUDA stream on first use (posix_io.hpp ``StreamsByThread``), which kvikio never destroys.

Verification: the same XXH3-64 per chunk as the host path, on the host.  Each chunk, once its
read has completed, is copied device-to-host (in chunk order, on one side stream) into a free
pinned bounce buffer and hashed on one of :func:`hash_threads` threads (GIL released), while
later chunks' reads run.  The copy back crosses the link in the other direction (H2D is the
reads'), so on a full-duplex link it costs link time only there, but each byte touches host
memory twice more than the staged path's (agent/snapshot/gpu.py, cost model).
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from agent import _restore
from agent.errors import SnapshotCorrupt
from agent.snapshot.format import Manifest
from agent.snapshot.reader import RESIDENT_FOR_BUFFERED, _close, _open_files
from agent.snapshot.staging import DeviceRestoreStats, aligned_host, cached_share, staged_threads

MAX_HASH_THREADS = 8
"""XXH3-64 ran at 6.7 GB/s on one core of the 2-core development VM (1 GiB, best of 3, load
8.6); eight threads keep verification above a PCIe 5 x16 link's ~55 GB/s where the cores run
as fast."""
KVIKIO_TASK_BYTES = 8 << 20
"""kvikio's task size for a device restore (its default is 4 MiB)."""


def hash_threads() -> int:
    """Hashing threads for a verified kvikio restore: the cores, at most MAX_HASH_THREADS."""
    return max(1, min(MAX_HASH_THREADS, os.cpu_count() or 1))


def bounce_buffers(nbytes: int, device: torch.device) -> list[torch.Tensor]:
    """:func:`hash_threads` + 1 host uint8 tensors [nbytes] for the verifier (pinned on a GPU)."""
    return [aligned_host(max(1, nbytes), pin=device.type == "cuda") for _ in range(hash_threads() + 1)]


def kvikio_settings(kvikio: Any, *, cold: bool, threads: int | None = None) -> dict[str, Any]:
    """The ``kvikio.defaults.set`` dict for one restore (module docstring)."""
    task = KVIKIO_TASK_BYTES
    return {"num_threads": threads or staged_threads(), "task_size": task,
            "bounce_buffer_size": max(task, int(kvikio.defaults.get("bounce_buffer_size"))),
            "auto_direct_io_read": cold}


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
            bounce = bounce_buffers(need, base.device)
        self.free = list(bounce)
        self.cuda = base.device.type == "cuda"
        self.stream = torch.cuda.Stream(base.device) if self.cuda else None
        self.pool = ThreadPoolExecutor(len(bounce) - 1, thread_name_prefix="verify")
        self.pending: deque[tuple[Future, torch.Tensor]] = deque()   # hashes under way, in order
        self.wait_s = 0.0

    def add(self, i: int) -> None:
        """Copy chunk ``i`` (its read has completed) into a free bounce buffer and hash it on
        the pool; waits for the oldest hash when every buffer is in use (raising its
        SnapshotCorrupt)."""
        c = self.manifest.chunks[i]
        if not self.free:
            future, slot = self.pending.popleft()
            t = time.perf_counter()
            future.result()
            self.wait_s += time.perf_counter() - t
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
        t = time.perf_counter()
        while self.pending:
            future, slot = self.pending.popleft()
            future.result()
            self.free.append(slot)
        self.wait_s += time.perf_counter() - t

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


def restore_kvikio(path: Path, manifest: Manifest, base: torch.Tensor, kvikio: Any, *,
                   mode: str, verify: bool, bounce: list[torch.Tensor] | None = None,
                   threads: int | None = None) -> DeviceRestoreStats:
    """Read every chunk of the snapshot at ``path`` into ``base`` (uint8 [total_bytes] on the
    device) with ``kvikio`` (the module, or a stand-in with its API), verifying each chunk
    through ``bounce`` (replaced when too small); ``mode``: agent.snapshot.gpu.io_path's
    answer.  The checks before (manifest, pins, buffer, files) are the caller's.  Every
    CuFile is closed, every read waited for and kvikio's settings restored before this returns
    or raises.  Raises SnapshotCorrupt (a short read or a checksum mismatch, naming the chunk,
    file and tensors), and what kvikio raises (RuntimeError for an I/O error, e.g. EOF)."""
    fds = _open_files(path, manifest, direct=False)
    try:
        cold = bool(manifest.chunks) and cached_share(path, manifest, fds) < RESIDENT_FOR_BUFFERED
    finally:
        _close(fds)
    settings = kvikio_settings(kvikio, cold=cold, threads=threads)
    if base.device.type == "cuda":
        torch.cuda.current_stream(base.device).synchronize()  # queued work may read the buffer
    start = time.perf_counter()
    futures: list[Any] = []
    waited = 0                  # futures[:waited] have been waited for
    verifier = None
    with kvikio.defaults.set(settings):
        handles: dict[str, Any] = {}
        try:
            for name in sorted({c.file for c in manifest.chunks}):
                handles[name] = kvikio.CuFile(path / name, "r")
            for c in manifest.chunks:
                futures.append(handles[c.file].pread(base[c.buffer_offset:c.buffer_offset + c.length],
                                                     c.length, c.offset))
            verifier = _Verifier(path, manifest, base, bounce) if verify else None
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
    figures = {**settings, "verify_wait_s": round(verifier.wait_s, 4) if verifier else 0.0}
    return DeviceRestoreStats(bytes=manifest.total_bytes, seconds=seconds, odirect=mode == "gds",
                              direct_chunks=0, chunks=len(manifest.chunks),
                              threads=settings["num_threads"], verified=verify, mode=mode,
                              strategy="kvikio", figures=figures)


def _settle(future: Any) -> None:
    """Wait for a read still in flight before its file is closed (kvikio: "must wait for
    futures before exiting block"); its error was already raised, or is not ours to raise."""
    try:
        future.get()
    except Exception:  # noqa: BLE001 - the first failure is the one being raised
        pass
