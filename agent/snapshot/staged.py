"""The staged device restore: read and hash in host slots, copy to the device by DMA.

One run moves a snapshot's chunks into a uint8 device tensor [total_bytes] through a
:class:`~agent.snapshot.staging.Staging`.  ``T`` worker threads (Python threads, one per slot
set; the reads and hashes run in agent._restore.read_into with the GIL released) each loop:

    take the next chunk (a shared counter, chunks in file order)
      for each slot-sized part of it, into the thread's slots in turn:
        wait for the slot's last copy out (its CUDA event)
        pread into the slot (O_DIRECT for a cold file, buffered where refused), hashing each
          piece with XXH3-64 as it lands (L2-sized pieces when buffered)
        copy slot -> its place in the device tensor on the thread's stream, record the event
      compare the chunk's XXH3-64 with the manifest's

Nothing is copied back from the device to verify it: the bytes are hashed where they land in
host memory, and the host-to-device DMA that moves them is covered by the link's own integrity
checks (PCIe's per-packet LCRC with replay of a bad packet), as every pinned copy is.  Before
the first copy each worker stream waits for the caller's current stream (work queued there may
still read the destination, e.g. a zygote's warm-up), and afterwards the caller's stream waits
for every worker stream; the run returns only when every copy has finished (each slot's event),
so its time is the time until the bytes are on the device and its slots are free.

A failure (a read error, the file ending inside a chunk, a checksum mismatch, an error from
torch or CUDA) stops every thread at its next slot; the run then joins all of them, waits for
the copies already issued and reports.  Results have the shape of agent._restore.read_chunks's
(``(err, short_read, used_direct, actual)`` per chunk), so reader._check_results names the bad
chunk, file and tensors exactly as the host path does.

Off a GPU (the Staging of a CPU or meta tensor) the copy is synchronous and there are no
streams or events: every step but the DMA runs as on the GPU node.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent import _restore
from agent.snapshot.format import Manifest
from agent.snapshot.reader import (BUFFERED_PIECE_BYTES, RESIDENT_FOR_BUFFERED, _add_direct,
                                   _check_results, _close, _open_files)
from agent.snapshot.staging import DeviceRestoreStats, Staging, cached_share, staged_threads

Job = tuple[int, int, int, int, int, int]
"""(fd_direct, fd_buffered, file_offset, length, dest_offset, expected XXH3-64): read_chunks's."""


@dataclass
class _Worker:
    """One thread's tallies (nanoseconds from read_into, seconds from perf_counter)."""

    read_ns: int = 0
    hash_ns: int = 0
    slot_wait_s: float = 0.0
    issue_s: float = 0.0
    fills: int = 0


@dataclass
class StagedRun:
    """What a run did: ``results[i]`` is chunk i's ``(err, short_read, used_direct, actual)``
    (None: not reached, because a failure stopped the run), ``error`` the first exception a
    worker raised (not a read or checksum failure: those are in ``results``)."""

    results: list[tuple[int, int, int, int] | None]
    threads: int
    workers: list[_Worker] = field(default_factory=list)
    error: BaseException | None = None

    def figures(self) -> dict[str, Any]:
        w = self.workers
        return {"threads": self.threads, "fills": sum(x.fills for x in w),
                "read_s": round(sum(x.read_ns for x in w) / 1e9, 4),
                "hash_s": round(sum(x.hash_ns for x in w) / 1e9, 4),
                "slot_wait_s": round(sum(x.slot_wait_s for x in w), 4),
                "issue_s": round(sum(x.issue_s for x in w), 4)}


class _Pipeline:
    """The shared state of one run: the job counter, the stop flag, the results."""

    def __init__(self, jobs: list[Job], dest: torch.Tensor, staging: Staging, verify: bool,
                 piece_bytes: int) -> None:
        self.jobs, self.dest, self.staging = jobs, dest, staging
        self.verify, self.piece_bytes = verify, piece_bytes
        self.cuda = dest.device.type == "cuda"
        self.lock = threading.Lock()
        self.next = 0
        self.stop = threading.Event()
        self.results: list[tuple[int, int, int, int] | None] = [None] * len(jobs)
        self.error: BaseException | None = None

    def take(self) -> int | None:
        with self.lock:
            if self.stop.is_set() or self.next >= len(self.jobs):
                return None
            i, self.next = self.next, self.next + 1
            return i

    def fail(self, error: BaseException | None = None) -> None:
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
        self.stop.set()

    def work(self, w: int, tally: _Worker) -> None:
        try:
            stream = self.staging.streams[w] if self.cuda else None
            ctx = (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext())
            with ctx:
                self._loop(self.staging.sets[w], stream, tally)
        except BaseException as exc:   # noqa: BLE001 - handed to the caller's thread
            self.fail(exc)

    def _loop(self, slots: list, stream: Any, tally: _Worker) -> None:
        hasher = _restore.Xxh3() if self.verify else None
        size, dest, fill = self.staging.slot_bytes, self.dest, 0
        while (i := self.take()) is not None:
            fd_d, fd_b, offset, length, dest_offset, expected = self.jobs[i]
            if hasher is not None:
                hasher.reset()
            done = direct = 0
            while done < length:
                if self.stop.is_set():
                    return
                slot = slots[fill % len(slots)]
                fill += 1
                t = time.perf_counter()
                slot.wait()
                tally.slot_wait_s += time.perf_counter() - t
                step = min(size, length - done)
                err, short, used_direct, read_ns, hash_ns = _restore.read_into(
                    slot.array, 0, step, fd_d, fd_b, offset + done, self.piece_bytes, size, hasher)
                tally.read_ns += read_ns
                tally.hash_ns += hash_ns
                tally.fills += 1
                if err or short:
                    self.results[i] = (err, short, 0, 0)
                    self.fail()
                    return
                direct += used_direct
                t = time.perf_counter()
                dest[dest_offset + done:dest_offset + done + step].copy_(slot.tensor[:step],
                                                                         non_blocking=self.cuda)
                if slot.event is not None:
                    slot.event.record(stream)
                tally.issue_s += time.perf_counter() - t
                done += step
            actual = hasher.digest() if hasher is not None else 0
            fills = -(-length // size)
            self.results[i] = (0, 0, int(direct == fills), actual)
            if hasher is not None and actual != expected:
                self.fail()
                return


def run_staged(jobs: list[Job], dest: torch.Tensor, staging: Staging, *, threads: int,
               verify: bool = True, piece_bytes: int = BUFFERED_PIECE_BYTES) -> StagedRun:
    """Read ``jobs`` into ``dest`` (uint8 [>= every dest_offset + length], on staging's device)
    through ``staging`` with ``min(threads, staging.threads, len(jobs))`` worker threads.

    ``piece_bytes``: a buffered read's piece (hashed while it is in L2); an O_DIRECT read reads
    a whole slot in one pread.  Returns when every thread has been joined and no copy is still
    reading a slot, whatever happened; read and checksum failures are in ``results`` (see
    :class:`StagedRun`), any other exception a worker raised is ``error``.  Raises ValueError
    for a job outside ``dest`` before any thread starts."""
    for i, (_fd_d, _fd_b, _off, length, dest_offset, _x) in enumerate(jobs):
        if dest_offset < 0 or length < 0 or dest_offset + length > dest.numel():
            raise ValueError(f"job {i}: destination [{dest_offset}, {dest_offset + length}) "
                             f"outside the device buffer of {dest.numel()} bytes")
    n = min(threads, staging.threads, len(jobs))
    pipe = _Pipeline(jobs, dest, staging, verify, piece_bytes)
    tallies = [_Worker() for _ in range(n)]
    if n == 0:
        return StagedRun(pipe.results, 0, tallies)
    consumer = torch.cuda.current_stream(dest.device) if pipe.cuda else None
    if consumer is not None:
        for stream in staging.streams[:n]:
            stream.wait_stream(consumer)    # queued work may still read the destination
    workers = [threading.Thread(target=pipe.work, args=(w, tallies[w]), name=f"staged-{w}",
                                daemon=True) for w in range(n)]
    started: list[threading.Thread] = []
    try:
        for t in workers:
            t.start()
            started.append(t)
    except BaseException as exc:   # noqa: BLE001 - no thread: stop the others, report it
        pipe.fail(exc)
    finally:
        for t in started:
            t.join()
        try:
            staging.quiesce()
        except BaseException as exc:   # noqa: BLE001 - a CUDA error; the first one is kept
            pipe.fail(exc)
    if consumer is not None:
        for stream in staging.streams[:n]:
            consumer.wait_stream(stream)
    return StagedRun(pipe.results, n, tallies, pipe.error)


def restore_staged(path: Path, manifest: Manifest, base: torch.Tensor, staging: Staging, *,
                   verify: bool) -> DeviceRestoreStats:
    """Read every chunk of the snapshot at ``path`` into ``base`` (uint8 [total_bytes] on the
    device) through ``staging``; the checks before (manifest, pins, buffer) are the caller's.

    Cold or warm is judged by staging.cached_share with the host path's threshold (O_DIRECT
    when under RESIDENT_FOR_BUFFERED of the data is in the page cache).  A warm read uses
    ``staging.workers`` threads (staged_threads() when 0), a cold one every slot set (at least
    staging.COLD_READS: its threads mostly wait on the device).  Every descriptor is closed
    before this returns or raises.  Raises SnapshotCorrupt (a data file missing or short; a
    chunk that could not be read, ended early or did not verify: naming the chunk, file,
    tensors, expected and actual, as the host path does), and what torch raises for a failed
    copy."""
    fds = _open_files(path, manifest, direct=False)
    try:
        cold = bool(manifest.chunks) and cached_share(path, manifest, fds) < RESIDENT_FOR_BUFFERED
        if cold:
            _add_direct(path, fds)
        workers = staging.threads if cold else (staging.workers or staged_threads())
        jobs = [(*fds[c.file], c.offset, c.length, c.buffer_offset, c.checksum) for c in manifest.chunks]
        start = time.perf_counter()
        run = run_staged(jobs, base, staging, threads=workers, verify=verify)
        seconds = time.perf_counter() - start
    finally:
        _close(fds)
    if run.error is not None:
        raise run.error
    done = [i for i, r in enumerate(run.results) if r is not None]
    ndirect = _check_results(path, manifest, done, [run.results[i] for i in done], verify)
    if len(done) != len(jobs):   # unreachable: a run stops early only after a failure
        raise RuntimeError(f"{path}: staged restore stopped after {len(done)} of {len(jobs)} chunks")
    figures = {**run.figures(), "slot_bytes": staging.slot_bytes, "cold": cold}
    return DeviceRestoreStats(bytes=manifest.total_bytes, seconds=seconds,
                              odirect=bool(jobs) and ndirect == len(jobs), direct_chunks=ndirect,
                              chunks=len(jobs), threads=run.threads, verified=verify,
                              mode="staged", strategy="staged", figures=figures)
