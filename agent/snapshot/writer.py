"""Atomic snapshot writer.

``write_snapshot(dest, tensors, ...)`` writes into ``<dest>.partial/``, fsyncs the data file,
the manifest and the directory, drops the data from the page cache and reads it back from
disk, checking every chunk's XXH3-64 against the value computed from the source tensors, and
only then renames ``<dest>.partial`` to ``<dest>`` (and fsyncs the parent).  A snapshot is
*ready* exactly when ``<dest>/manifest.msgpack`` exists, so a crash at any moment leaves at
most a ``.partial`` directory, which :func:`clean_partials` removes at the next start.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from agent import _restore
from agent.errors import ConfigError, DiskFull, SnapshotError
from agent.snapshot.format import (ALIGN, FORMAT_VERSION, MANIFEST_NAME, TENSOR_ALIGN, ChunkEntry,
                                   GoldenCheck, Manifest, ModelIdentity, Pins, TensorEntry, dtype_name)
from agent.snapshot.manifest import encode_manifest, read_manifest
from agent.snapshot.pins import machine_pins
from agent.snapshot.reader import verify_chunks

DATA_NAME = "data-00000.bin"
PARTIAL_SUFFIX = ".partial"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clean_partials(root: Path | str) -> list[Path]:
    """Remove every ``*.partial`` directory directly under ``root`` (leftovers of a crash).

    Call once at start, before any writer runs.  Returns the directories removed.
    """
    root = Path(root)
    removed = []
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name.endswith(PARTIAL_SUFFIX) and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
                removed.append(p)
    return removed


def layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorEntry], int]:
    """Offsets of each tensor in the buffer (TENSOR_ALIGN-aligned) and the total (ALIGN-aligned)."""
    entries, cursor = [], 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ConfigError(f"tensor table entry {name!r}: expected str -> torch.Tensor, got "
                              f"{type(name).__name__} -> {type(t).__name__}", name=name, value=type(t), limit=None)
        shape = tuple(t.shape)
        strides = tuple(torch.empty(shape, dtype=torch.uint8, device="meta").stride()) if shape else ()
        nbytes = t.numel() * t.element_size()
        cursor = _align(cursor, TENSOR_ALIGN)
        entries.append(TensorEntry(name, dtype_name(t.dtype), shape, strides, cursor, nbytes))
        cursor += nbytes
    return entries, _align(cursor, ALIGN)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a contiguous uint8 CPU tensor [nbytes] (a copy only if needed)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def _write_data(fd: int, tensors: Mapping[str, torch.Tensor], entries: list[TensorEntry],
                total: int, chunk_bytes: int) -> list[ChunkEntry]:
    """Stream the buffer's bytes to ``fd`` one chunk at a time, hashing each chunk."""
    staging_mem = bytearray(min(chunk_bytes, max(total, 1)))
    staging = torch.frombuffer(staging_mem, dtype=torch.uint8)   # never empty (max(total, 1))
    view = memoryview(staging_mem)
    values = list(tensors.values())
    chunks, k = [], 0
    flats: dict[int, torch.Tensor] = {}
    for lo in range(0, total, chunk_bytes):
        hi = min(lo + chunk_bytes, total)
        staging[: hi - lo].zero_()
        while k < len(entries) and entries[k].offset + entries[k].nbytes <= lo:
            flats.pop(k, None)
            k += 1
        j = k
        while j < len(entries) and entries[j].offset < hi:
            e = entries[j]
            a, b = max(lo, e.offset), min(hi, e.offset + e.nbytes)
            if b > a:
                if j not in flats:
                    flats[j] = _flat_bytes(values[j])
                staging[a - lo:b - lo].copy_(flats[j][a - e.offset:b - e.offset])
            j += 1
        part = view[: hi - lo]
        done = 0
        while done < len(part):
            done += os.write(fd, part[done:])
        chunks.append(ChunkEntry(DATA_NAME, lo, hi - lo, lo, _restore.xxh3_64(part)))
    return chunks


def write_snapshot(dest: Path | str, tensors: Mapping[str, torch.Tensor], *, model: ModelIdentity,
                   golden: GoldenCheck | None = None, extra: dict | None = None, key: bytes | None = None,
                   pins: Pins | None = None, chunk_bytes: int = 16 << 20) -> Manifest:
    """Write ``tensors`` (any dtype in format.DTYPES, any layout) as a ready snapshot at ``dest``.

    ``chunk_bytes``: checksum and read unit, a positive multiple of ALIGN (default 16 MiB).
    ``pins``: what to record (machine_pins("cpu") when None).  ``extra``: msgpack-able data.
    Raises SnapshotError when ``dest`` exists, DiskFull (naming the path; nothing left behind),
    ConfigError for a bad argument, SnapshotCorrupt when the read-back does not verify.
    """
    dest = Path(dest)
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise ConfigError(f"chunk_bytes={chunk_bytes} must be a positive multiple of {ALIGN}",
                          name="chunk_bytes", value=chunk_bytes, limit=ALIGN)
    if dest.exists():
        raise SnapshotError(f"{dest} already exists; remove it before writing a new snapshot", path=dest)
    entries, total = layout(tensors)
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    try:
        st = os.statvfs(partial)
        free = st.f_bavail * st.f_frsize
        if free < total + (1 << 20):
            raise DiskFull(f"{partial}: snapshot needs {total} bytes (+1 MiB for the manifest), "
                           f"{free} bytes free", path=partial, needed_bytes=total, free_bytes=free)
        fd = os.open(partial / DATA_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            chunks = _write_data(fd, tensors, entries, total, chunk_bytes)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read-back comes from disk
        finally:
            os.close(fd)
        manifest = Manifest(FORMAT_VERSION, entries, chunks, pins or machine_pins("cpu"), model, golden,
                            extra=dict(extra or {}), created_s=time.time(), total_bytes=total)
        with open(partial / MANIFEST_NAME, "wb") as f:
            f.write(encode_manifest(manifest, key))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(partial)
        written = read_manifest(partial, key)
        if (written.tensors, written.chunks) != (manifest.tensors, manifest.chunks):
            raise SnapshotError(f"{partial / MANIFEST_NAME}: manifest read back differs from the one written",
                                path=partial)
        verify_chunks(partial, manifest)
        os.rename(partial, dest)
        _fsync_dir(dest.parent)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, DiskFull):
            raise
        if exc.errno in _NO_SPACE:
            raise DiskFull(f"{partial}: no space left writing the snapshot ({total} bytes): {exc}",
                           path=partial, needed_bytes=total, free_bytes=None) from exc
        raise
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return written
