"""Verified restore of a snapshot into one page-aligned host buffer.

Order of a restore: read and check the manifest (digest, signature, schema) → compare the pins
with this machine → check every data file is long enough → read all chunks in parallel with
the GIL released (ext/restore.pyx), hashing each as it lands → only if every chunk verified,
build the tensors as views into the buffer.  A failed restore raises and returns nothing.

Two ways in, chosen by whether the caller brings a buffer:

- **zygote** (``buffer=`` a prefaulted HostBuffer): pread (O_DIRECT when cold) into memory that
  was allocated and faulted in before the clock started; each piece is hashed as it lands.
- **fresh process** (no buffer), ``copy="auto"`` by default: the snapshot's data file is mapped
  private and writable, locked with mlock2(MLOCK_ONFAULT), and each piece is faulted in with
  MADV_POPULATE_READ and hashed right after (hash_ranges).  The tensors are then the page-cache
  pages themselves: a cold file is read by the kernel straight into the pages the tensors use,
  a cached one costs no copy and no fresh memory.  Pages evicted and read again after
  verification: cannot happen, the pages are locked until the buffer is closed.  A write
  to a tensor copies that page (copy-on-write; the file is never changed).  What the lock does
  not cover: another process writing into the snapshot file in place changes the unwritten
  pages, and truncating it kills this process with SIGBUS on the next read of any tensor past
  the new end, written (copied) pages included: truncation unmaps private copies too (checked:
  restore, truncate the data file, read the last element: exit by SIGBUS, with or without a
  write to it first).  The store never does either (snapshots are written to a new directory
  and renamed, files read-only; unlinking or replacing a snapshot is safe).  When the lock is refused (RLIMIT_MEMLOCK without
  CAP_IPC_LOCK) or the layout is not one file with identity offsets, the safe default is
  taken: a copy into fresh anonymous memory (4 KiB pages), a populate-ahead thread faulting the
  destination in ahead of the reads.  ``copy=True`` forces that copy.

Measured (bench/restore_throughput.py, 1 GiB, the 2-core development machine under load 7-8,
medians of 4 alternating rounds, each a fresh process): O_DIRECT limit 1.74 GB/s; fresh copy
into huge pages 0.29 (page-fault time 1.7 s/GiB: THP allocation is slow on this VM), into 4 KiB
pages 1.10, with populate-ahead 1.18, locked map 1.54; warm (cached) the same paths give 0.25,
1.06, 0.86 and 5.00 GB/s, against 1.24 GB/s for faulting fresh 4 KiB memory in at all.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import torch

from agent import _restore
from agent.errors import ConfigError, SnapshotCorrupt, SnapshotError, SnapshotNotFound
from agent.snapshot.format import ALIGN, DTYPES, Manifest, Pins
from agent.snapshot.manifest import open_regular, read_manifest
from agent.snapshot.pins import check_pins, machine_pins, pins_device

__all__ = ["HostBuffer", "Restored", "RestoreStats", "read_manifest", "restore_snapshot",
           "verify_chunks", "tensor_views"]


class HostBuffer:
    """Page-aligned, anonymous host memory (an mmap) that a restore reads into.

    A zygote allocates one ahead of need (``prefault=True`` also touches every page, so the
    restore does not pay the page faults).  Tensors restored into it are views: keep the
    buffer alive as long as they are used, and do not reuse it for another restore meanwhile.
    """

    def __init__(self, memory: mmap.mmap, capacity_bytes: int) -> None:
        self.memory = memory
        self.capacity_bytes = capacity_bytes
        self.locked = False          # True for a locked file map (map_locked)
        self.file_key: tuple[int, int, int, int] | None = None   # map_snapshot's data file

    @classmethod
    def allocate(cls, nbytes: int, *, prefault: bool = False, huge: bool | None = None) -> HostBuffer:
        """Allocate ``nbytes`` rounded up to ALIGN (at least one page). Raises ConfigError if < 0.

        ``huge`` (default: ``prefault``): ask for transparent huge pages.  A zygote's buffer
        (prefaulted before any restore) gets them for fewer TLB misses; a buffer filled while
        the clock runs does not: on the development VM faulting huge pages in cost 1.7-2.2 s of
        kernel time per GiB against 0.35 s for 4 KiB pages (module docstring)."""
        if nbytes < 0:
            raise ConfigError(f"buffer size {nbytes} bytes must be >= 0", name="nbytes", value=nbytes, limit=0)
        capacity = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        memory = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if (prefault if huge is None else huge) and capacity >= (2 << 20) and hasattr(mmap, "MADV_HUGEPAGE"):
            memory.madvise(mmap.MADV_HUGEPAGE)
        elif hasattr(mmap, "MADV_NOHUGEPAGE"):
            memory.madvise(mmap.MADV_NOHUGEPAGE)  # THP "always" would fault 2 MiB pages in too
        if prefault:
            try:
                _restore.populate(memory)             # MADV_POPULATE_WRITE, GIL released
            except OSError:                           # kernel before 5.14
                torch.frombuffer(memory, dtype=torch.uint8)[::ALIGN].zero_()
        return cls(memory, capacity)

    @classmethod
    def map_locked(cls, fd: int, nbytes: int) -> HostBuffer | None:
        """A private, writable map of the first ``nbytes`` of file ``fd``, locked with
        mlock2(MLOCK_ONFAULT) (pages are locked as they are faulted in); None when the lock is
        refused (RLIMIT_MEMLOCK) or the kernel lacks it.  ``nbytes`` must not pass the file's
        end (callers check the size): pages past it would raise SIGBUS."""
        try:
            memory = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:       # e.g. a filesystem without mmap: the copy path reads it instead
            return None
        try:
            _restore.lock_memory(memory, onfault=True)
        except OSError:
            memory.close()
            return None
        buf = cls(memory, nbytes)
        buf.locked = True
        return buf

    @classmethod
    def map_snapshot(cls, path: Path | str) -> HostBuffer | None:
        """A zygote's buffer that *is* the snapshot at ``path``: the locked private map of its
        one data file (:meth:`map_locked`), every page faulted in for reading ahead of need
        (MADV_POPULATE_READ: the page-cache pages themselves, no copy).  Replicas restored from
        the same snapshot on one node then share those pages read-only, the kernel divides them
        in every process's PSS, instead of each holding a private copy (the issue's "weights
        live once per node").  ``file_key`` (st_dev, st_ino, st_size, st_mtime_ns of the data
        file) lets :func:`restore_snapshot` verify in place when it is asked for that very file.
        Nothing here is trusted: the restore hashes every byte of the map before any tensor is
        built.  Returns None, having mapped nothing, when the manifest or the file cannot be
        read, the layout is not one file with identity offsets, the file is empty, or the lock
        is refused (RLIMIT_MEMLOCK); the caller then allocates an anonymous buffer."""
        path = Path(path)
        try:
            manifest = read_manifest(path)
            fds = _open_files(path, manifest, direct=False)
        except (SnapshotError, OSError):
            return None
        try:
            if not _mappable(manifest, fds):
                return None
            (_fd, fd_b), = fds.values()
            st = os.fstat(fd_b)
            buffer = cls.map_locked(fd_b, manifest.total_bytes)
        finally:
            _close(fds)
        if buffer is None:
            return None
        try:
            _restore.populate(buffer.memory, write=False)
        except OSError:                  # kernel before 5.14: the restore's hashing faults it in
            pass
        buffer.file_key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        return buffer

    def release(self) -> None:
        """Give the memory back now instead of when the last view of it is collected: unlock
        a locked map and close it; while tensors still view it (mmap refuses to close), drop its
        pages instead (MADV_DONTNEED: a private file map's unwritten pages are the page cache's,
        an anonymous map's read as zeros again).  Use no tensor of it afterwards."""
        if self.memory.closed:
            return
        if self.locked:
            try:
                _restore.lock_memory(self.memory, lock=False)
            except OSError:
                pass
            self.locked = False
        try:
            self.memory.close()
        except BufferError:
            if hasattr(mmap, "MADV_DONTNEED"):
                self.memory.madvise(mmap.MADV_DONTNEED)

    def as_tensor(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer as a uint8 tensor [nbytes] (a view, no copy)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.memory, dtype=torch.uint8, count=nbytes)


@dataclass(frozen=True)
class RestoreStats:
    bytes: int              # bytes read (the manifest's total_bytes)
    seconds: float          # wall time of the chunk reads (and verification)
    odirect: bool           # True when every chunk was read with O_DIRECT
    direct_chunks: int      # chunks read with O_DIRECT; the others were buffered reads
    chunks: int
    threads: int
    verified: bool
    mode: str = "buffer"    # "buffer" (the caller's, e.g. a zygote's), "copy" (fresh anonymous
                            # memory, populate-ahead) or "map" (locked private file map)

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (10^9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass
class Restored:
    tensors: dict[str, torch.Tensor]   # views into ``buffer``, in manifest order
    manifest: Manifest
    stats: RestoreStats
    buffer: HostBuffer | None   # None: restored into device memory (agent/snapshot/gpu.py)


# pread sizes.  Direct reads: large requests keep the device queue full.  Buffered reads (a
# copy out of the page cache): small enough that the piece is still in L2 when it is hashed.
DIRECT_PIECE_BYTES = 1 << 20
# Direct reads spend most of their time waiting on the device, so they get at least this many
# reader threads (the device's queue depth), whatever ``threads`` is: with 2 threads the
# device sits idle while both hash; with more, hashing hides behind the reads still in flight
# (development machine, 1 GiB cold: verification overhead 26 % with 2 threads, 4 % with 4,
# under 1 % with 8, which also keeps more reads queued when other processes take the CPUs).
DIRECT_IO_DEPTH = 8
BUFFERED_PIECE_BYTES = 256 << 10
RESIDENT_FOR_BUFFERED = 0.9     # page-cache share above which "auto" reads buffered
# The locked-map path: hashing threads (each faults its piece in, then hashes it), and the
# piece: small enough to hash while in L2, large enough that one madvise covers many pages.
# One more thread asks for the chunks not yet taken with MADV_WILLNEED, so the disk has reads
# queued while the hashing threads wait or are descheduled.  Measured cold, 1 GiB, load 12-15,
# 3 alternating rounds (GB/s): raw O_DIRECT 0.98; map, 2 threads, no read-ahead 0.26; with
# WILLNEED ahead 0.48; 4 threads and WILLNEED ahead 0.95; the populate-ahead copy 0.61.
MAP_THREADS = 4
MAP_AHEAD = "willneed"
MAP_PIECE_BYTES = 256 << 10


def page_cache_share(path: Path, manifest: Manifest, fds: dict[str, tuple[int, int]] | None = None) -> float:
    """Share (0..1) of the snapshot's data-file pages in the page cache (mincore).

    ``fds``: the descriptors :func:`_open_files` opened (their files are known to be regular);
    without them the files are opened and checked here.  A file that cannot be measured counts
    as not cached: this is only the heuristic that picks direct or buffered reads.
    """
    own = fds is None
    if fds is None:
        try:
            fds = _open_files(path, manifest, direct=False)
        except SnapshotError:
            return 0.0   # the restore itself reports what is wrong with the files
    try:
        sizes, cached = 0, 0.0
        for _fd_d, fd_b in fds.values():
            n = os.fstat(fd_b).st_size
            sizes += n
            try:
                cached += _restore.resident_fraction(fd_b) * n
            except OSError:
                pass
        return cached / sizes if sizes else 0.0
    finally:
        if own:
            _close(fds)


def _open_files(path: Path, manifest: Manifest, direct: bool = True) -> dict[str, tuple[int, int]]:
    """Open each data file buffered and, when ``direct`` and allowed, with O_DIRECT; check its length.

    Every data file must be a regular file (not a symlink, FIFO, directory or device: see
    manifest.open_regular), long enough for its last chunk, and together the files must hold at
    least ``total_bytes``.  All of this is checked before any buffer is allocated.
    """
    need: dict[str, tuple[int, int]] = {}
    for i, c in enumerate(manifest.chunks):
        end = c.offset + c.length
        if end > need.get(c.file, (0, -1))[0]:
            need[c.file] = (end, i)
    fds: dict[str, tuple[int, int]] = {}
    sizes: dict[str, int] = {}
    try:
        for name, (end, last) in need.items():
            fpath = path / name
            try:
                fd_b, st = open_regular(fpath, "data file", path)
            except SnapshotNotFound:
                raise
            except FileNotFoundError as exc:
                raise SnapshotCorrupt(f"{fpath}: data file missing (chunk {last} needs {end} bytes)",
                                      path=fpath, chunk=last, tensors=manifest.chunk_tensors(last),
                                      expected=end, actual=None) from exc
            except SnapshotCorrupt as exc:
                exc.chunk, exc.tensors = last, manifest.chunk_tensors(last)
                raise
            fds[name] = (-1, fd_b)
            sizes[name] = st.st_size
        on_disk = sum(sizes.values())
        for name, (end, last) in need.items():
            if sizes[name] < end:
                fpath = path / name
                raise SnapshotCorrupt(
                    f"{fpath}: truncated: expected at least {end} bytes, found {sizes[name]} "
                    f"(chunk {last}, tensors {manifest.chunk_tensors(last)[:5]}); manifest total_bytes "
                    f"{manifest.total_bytes}, data files on disk {on_disk} bytes", path=fpath,
                    chunk=last, tensors=manifest.chunk_tensors(last), expected=end, actual=sizes[name],
                    total_bytes=manifest.total_bytes, on_disk_bytes=on_disk)
        if manifest.total_bytes > on_disk:   # unreachable for a validated manifest; no allocation
            raise SnapshotCorrupt(
                f"{path}: manifest total_bytes {manifest.total_bytes} exceeds the {on_disk} bytes of its "
                f"data files on disk {sorted(sizes)}", path=path, chunk=None, tensors=[],
                expected=on_disk, actual=manifest.total_bytes, total_bytes=manifest.total_bytes,
                on_disk_bytes=on_disk)
        if direct:
            _add_direct(path, fds)
    except BaseException:
        _close(fds)
        raise
    return fds


def _add_direct(path: Path, fds: dict[str, tuple[int, int]]) -> None:
    """Give each checked buffered descriptor its O_DIRECT twin where one can be had."""
    for name, (_, fd_b) in list(fds.items()):
        fds[name] = (_open_direct(path / name, fd_b), fd_b)


def _open_direct(fpath: Path, fd_b: int) -> int:
    """An O_DIRECT descriptor of the same file as ``fd_b``, or -1 (refused, or the file changed)."""
    try:
        fd = os.open(fpath, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
                     | getattr(os, "O_DIRECT", 0))
    except OSError:  # tmpfs and some others refuse O_DIRECT: buffered it is
        return -1
    a, b = os.fstat(fd), os.fstat(fd_b)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) or not stat.S_ISREG(a.st_mode):
        os.close(fd)   # replaced since it was checked: read only through the checked descriptor
        return -1
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def _close(fds: dict[str, tuple[int, int]]) -> None:
    for fd_d, fd_b in fds.values():
        for fd in (fd_d, fd_b):
            if fd >= 0:
                os.close(fd)


def _check_results(path: Path, manifest: Manifest, indices: list[int], results: list, verify: bool) -> int:
    """Raise SnapshotCorrupt naming the first bad chunk (and how many were bad); return direct count."""
    bad: list[tuple[int, str, object, object]] = []   # (chunk, what, expected, actual)
    for i, (err, short, _direct, actual) in zip(indices, results, strict=True):
        c = manifest.chunks[i]
        if err:
            bad.append((i, f"read error {os.strerror(err)} (errno {err})", None, err))
        elif short:
            bad.append((i, "file ended inside the chunk", c.length, "short read"))
        elif verify and actual != c.checksum:
            bad.append((i, "XXH3-64 mismatch", f"{c.checksum:016x}", f"{actual:016x}"))
    if bad:
        i, why, expected, actual = bad[0]
        c = manifest.chunks[i]
        names = manifest.chunk_tensors(i)
        raise SnapshotCorrupt(
            f"{path / c.file}: chunk {i} (file offset {c.offset}, {c.length} bytes) {why}: "
            f"expected {expected}, actual {actual}; covers tensors {names[:8]}"
            + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            + (f"; {len(bad) - 1} more bad chunks: {[b[0] for b in bad[1:9]]}" if len(bad) > 1 else ""),
            path=path / c.file, chunk=i, chunks=[b[0] for b in bad], tensors=names,
            expected=expected, actual=actual)
    return sum(r[2] for r in results)


def tensor_views(manifest: Manifest, base: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each tensor of ``manifest`` as a view of ``base`` (uint8 [total_bytes], any device)."""
    out = {}
    for t in manifest.tensors:
        flat = base[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype])
        out[t.name] = flat.view(t.shape)
    return out


def restore_snapshot(path: Path | str, *, buffer: HostBuffer | None = None, verify: bool = True,
                     key: bytes | None = None, machine: Pins | None = None, threads: int = 2,
                     direct: bool | str = "auto", copy: bool | str = "auto", huge: bool = False,
                     accept: Callable[[Manifest], object] | None = None) -> Restored:
    """Restore the snapshot at ``path`` into host memory; tensors are views into one buffer.

    ``buffer``: preallocated HostBuffer of at least ``total_bytes`` (allocated when None).
    ``threads``: reader threads (direct reads use at least DIRECT_IO_DEPTH).
    ``machine``: this machine's pins (read with machine_pins when None).  ``direct``: True reads
    with O_DIRECT where the filesystem allows, False buffered, "auto" buffered only when the
    data is already in the page cache (a copy from memory beats re-reading the disk).
    ``copy`` (only without ``buffer``): "auto" restores into a locked private map of the data
    file where it can (module docstring: a fresh process's fastest verified path), else copies
    into fresh anonymous memory; True always copies, and so does an explicit ``direct``.
    ``huge``: the copy's fresh buffer asks for transparent huge pages (HostBuffer.allocate);
    off by default: measured both faster (2.23 against 1.95 GB/s cold, 1 GiB, load 2-4) and
    far slower (0.29 against 1.10, load 7-8) than 4 KiB pages on the development VM, so the
    benchmark measures it (bench/restore_peers.py rewarm_fresh_copy_huge) before it is chosen.
    ``accept(manifest)``: the caller's own check of the manifest, run after the pins and
    before any file is opened or memory allocated; what it raises propagates.  Raises SnapshotNotFound,
    SnapshotTampered, SnapshotIncompatible (before any data is read), SnapshotCorrupt (bad or
    truncated chunk: names the chunk, file and tensors), ConfigError (buffer too small).
    After a failure the buffer's contents are undefined and no tensors are returned.
    """
    path = Path(path)
    manifest = read_manifest(path, key)
    check_pins(manifest.pins, machine or machine_pins(pins_device(manifest.pins)), path)
    if accept is not None:
        accept(manifest)
    total = manifest.total_bytes
    if buffer is not None and buffer.capacity_bytes < total and buffer.file_key is None:
        raise ConfigError(f"{path}: buffer holds {buffer.capacity_bytes} bytes, snapshot needs {total}",
                          name="buffer", value=buffer.capacity_bytes, limit=total)
    # Data files are opened and their sizes checked against the chunks and total_bytes before
    # any memory is allocated: a hostile total_bytes fails here, not in mmap.
    fds = _open_files(path, manifest, direct=False)
    try:
        if buffer is not None and buffer.file_key is not None:
            if _same_file(buffer, manifest, fds):     # a zygote holding this snapshot's map
                return _verify_mapped(path, manifest, buffer, verify, threads)
            buffer = None     # the map of another snapshot (any size): never written into
        if buffer is None and copy == "auto" and direct == "auto" and _mappable(manifest, fds):
            mapped = _restore_mapped(path, manifest, fds, verify, threads)
            if mapped is not None:
                return mapped
        if direct == "auto":
            direct = page_cache_share(path, manifest, fds) < RESIDENT_FOR_BUFFERED if manifest.chunks else True
        if direct:
            _add_direct(path, fds)
        fresh = buffer is None
        if buffer is None:
            buffer = HostBuffer.allocate(total, huge=huge)
        jobs = [(*fds[c.file], c.offset, c.length, c.buffer_offset, c.checksum) for c in manifest.chunks]
        piece = DIRECT_PIECE_BYTES if direct else BUFFERED_PIECE_BYTES
        workers = max(threads, DIRECT_IO_DEPTH) if direct else threads
        start = time.perf_counter()
        # fresh memory: one more thread faults the destination in ahead of the reads
        results = _restore.read_chunks(buffer.memory, jobs, workers, verify, piece, fresh)
        seconds = time.perf_counter() - start
    finally:
        _close(fds)
    ndirect = _check_results(path, manifest, list(range(len(jobs))), results, verify)
    stats = RestoreStats(bytes=total, seconds=seconds, odirect=bool(jobs) and ndirect == len(jobs),
                         direct_chunks=ndirect, chunks=len(jobs), threads=workers, verified=verify,
                         mode="copy" if fresh else "buffer")
    return Restored(tensor_views(manifest, buffer.as_tensor(total)), manifest, stats, buffer)


def _mappable(manifest: Manifest, fds: dict[str, tuple[int, int]]) -> bool:
    """One data file whose bytes are the buffer's bytes (offset == buffer_offset), as the
    writer lays them out: then a map of the file is the buffer."""
    return (len(fds) == 1 and manifest.total_bytes > 0
            and all(c.offset == c.buffer_offset for c in manifest.chunks))


def _same_file(buffer: HostBuffer, manifest: Manifest, fds: dict[str, tuple[int, int]]) -> bool:
    """Whether ``buffer`` (:meth:`HostBuffer.map_snapshot`) maps the very data file ``fds``
    opened (same device, inode, size and modification time), laid out as ``manifest`` says."""
    if not _mappable(manifest, fds) or buffer.capacity_bytes != manifest.total_bytes:
        return False
    (_fd, fd_b), = fds.values()
    st = os.fstat(fd_b)
    return buffer.file_key == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _restore_mapped(path: Path, manifest: Manifest, fds: dict[str, tuple[int, int]], verify: bool,
                    threads: int) -> Restored | None:
    """The locked-map restore (module docstring); None when the lock is refused.  The file's
    size was checked against every chunk and total_bytes, so no mapped page is past its end.
    Raises SnapshotCorrupt naming the first bad chunk (its map is closed first)."""
    (_fd_d, fd_b), = fds.values()
    buffer = HostBuffer.map_locked(fd_b, manifest.total_bytes)
    if buffer is None:
        return None
    try:
        return _verify_mapped(path, manifest, buffer, verify, threads)
    except BaseException:
        buffer.memory.close()
        raise


def _verify_mapped(path: Path, manifest: Manifest, buffer: HostBuffer, verify: bool,
                   threads: int) -> Restored:
    """Hash every chunk where it lies in ``buffer``, a locked map of the snapshot's data file
    (faulting in what is not yet resident), then build the tensors as views of it.  Raises
    SnapshotCorrupt naming the first bad chunk; the map is left to the caller."""
    workers = max(threads, MAP_THREADS)
    start = time.perf_counter()
    hashes, errs = _restore.hash_ranges(buffer.memory, [(c.buffer_offset, c.length) for c in manifest.chunks],
                                        workers, MAP_AHEAD, "read", MAP_PIECE_BYTES, verify)
    seconds = time.perf_counter() - start
    _check_results(path, manifest, list(range(len(hashes))),
                   [(e, 0, 0, h) for e, h in zip(errs, hashes, strict=True)], verify)
    stats = RestoreStats(bytes=manifest.total_bytes, seconds=seconds, odirect=False, direct_chunks=0,
                         chunks=len(hashes), threads=workers, verified=verify, mode="map")
    return Restored(tensor_views(manifest, buffer.as_tensor(manifest.total_bytes)), manifest,
                    stats, buffer)


def verify_chunks(path: Path | str, manifest: Manifest, *, threads: int = 2) -> int:
    """Read and hash every chunk of the snapshot at ``path`` through a small reused buffer.

    Memory: ``threads`` × the largest chunk.  Returns the bytes verified; raises SnapshotCorrupt.
    """
    path = Path(path)
    if not manifest.chunks:
        return 0
    step = max(c.length for c in manifest.chunks)
    fds = _open_files(path, manifest)      # sizes checked before the buffer is allocated
    buffer = None
    try:
        buffer = HostBuffer.allocate(step * threads)
        for lo in range(0, len(manifest.chunks), threads):
            idx = list(range(lo, min(lo + threads, len(manifest.chunks))))
            jobs = [(*fds[manifest.chunks[i].file], manifest.chunks[i].offset, manifest.chunks[i].length,
                     k * step, manifest.chunks[i].checksum) for k, i in enumerate(idx)]
            _check_results(path, manifest, idx, _restore.read_chunks(buffer.memory, jobs, threads, True), True)
    finally:
        _close(fds)
        if buffer is not None:
            buffer.memory.close()
    return manifest.total_bytes
