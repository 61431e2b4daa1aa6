"""The remote tier: a snapshot as zstd-compressed chunks on a shared path.

Layout of ``<remote_root>/<name>/``: ``manifest.msgpack`` (the local manifest with each chunk's
``compressed_offset`` and ``compressed_length`` filled in, re-signed with the key) and, per data
file, ``<file>.zst``: one zstd frame per chunk, end to end, each frame declaring its content
size.  Staging decompresses each frame into ``<local_dest>.partial/``, checking the frame
(exactly one frame spanning exactly ``compressed_length`` bytes, content size equal to the
chunk's length, decoded into a buffer of that size and no larger) and the chunk's XXH3-64;
chunks already present and correct in the partial directory are skipped, so an interrupted
stage resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import BinaryIO
from collections.abc import Callable
from pathlib import Path

import zstandard

from agent import _restore
from agent.errors import SnapshotCorrupt, SnapshotError
from agent.snapshot.format import MANIFEST_NAME, ChunkEntry, Manifest
from agent.snapshot.manifest import encode_manifest, read_manifest
from agent.snapshot.reader import verify_chunks

ZSTD_MAGIC = 0xFD2FB528
Progress = Callable[[int, int], None]   # (bytes_done, bytes_total)


def max_compressed_bytes(length: int) -> int:
    """zstd's worst-case frame size for ``length`` input bytes (ZSTD_COMPRESSBOUND, zstd.h)."""
    return length + (length >> 8) + ((128 << 10) - length >> 11 if length < (128 << 10) else 0) + 64


def zstd_frame_size(data: bytes) -> int:
    """Compressed size of the zstd frame at the start of ``data``, from its block headers.

    Layout from RFC 8878 §3.1.1.  Raises ValueError when the frame is malformed or cut off.
    """
    if len(data) < 6 or int.from_bytes(data[:4], "little") != ZSTD_MAGIC:
        raise ValueError("not a zstd frame (magic)")
    fhd = data[4]
    fcs_flag, single, checksum, did_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[did_flag] + ((1 if single else 0), 2, 4, 8)[fcs_flag]
    while True:
        if pos + 3 > len(data):
            raise ValueError("frame cut off inside a block header")
        bh = int.from_bytes(data[pos:pos + 3], "little")
        last, btype, bsize = bh & 1, (bh >> 1) & 3, bh >> 3
        if btype == 3:
            raise ValueError("reserved block type")
        pos += 3 + (1 if btype == 1 else bsize)
        if pos > len(data):
            raise ValueError("frame cut off inside a block")
        if last:
            return pos + 4 * checksum


def decompress_chunk(data: bytes, length: int, where: str) -> bytes:
    """Decompress one chunk's frame to exactly ``length`` bytes; anything else is corruption."""
    def corrupt(why: str, expected, actual) -> SnapshotCorrupt:
        return SnapshotCorrupt(f"{where}: {why}: expected {expected}, actual {actual}", path=where,
                               chunk=None, tensors=[], expected=expected, actual=actual)
    try:
        size = zstd_frame_size(data)
    except ValueError as exc:
        raise corrupt(f"bad zstd frame ({exc})", "one complete frame", f"{len(data)} bytes") from exc
    if size != len(data):
        raise corrupt("trailing bytes or extra frames after the zstd frame", size, len(data))
    declared = zstandard.frame_content_size(data)
    if declared != length:
        raise corrupt("zstd frame content size differs from the manifest's chunk length", length, declared)
    try:  # the content size is declared, so the output buffer is exactly `length` bytes
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=length)
    except zstandard.ZstdError as exc:
        raise corrupt(f"zstd decompression failed ({exc})", length, "error") from exc
    if len(out) != length:
        raise corrupt("decompressed length", length, len(out))
    return out


def push(snapshot_dir: Path | str, remote_root: Path | str, *, key: bytes | None = None,
         level: int = 3) -> Path:
    """Copy a ready local snapshot to ``remote_root/<name>`` as zstd chunks; returns that path.

    Every chunk is verified before it is compressed.  Atomic like the writer (``.partial`` +
    rename).  Raises SnapshotError when the remote snapshot exists, SnapshotCorrupt.
    """
    src = Path(snapshot_dir)
    manifest = read_manifest(src, key)
    verify_chunks(src, manifest)
    dest = Path(remote_root) / src.name
    if dest.exists():
        raise SnapshotError(f"{dest} already exists in the remote tier", path=dest)
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
    chunks: list[ChunkEntry] = []
    outs: dict[str, BinaryIO] = {}
    try:
        for c in manifest.chunks:
            if c.file not in outs:
                outs[c.file] = open(partial / (c.file + ".zst"), "wb")
            with open(src / c.file, "rb") as f:
                f.seek(c.offset)
                frame = cctx.compress(f.read(c.length))
            out = outs[c.file]
            chunks.append(dataclasses.replace(c, compressed_offset=out.tell(), compressed_length=len(frame)))
            out.write(frame)
        for out in outs.values():
            out.flush()
            os.fsync(out.fileno())
        remote = dataclasses.replace(manifest, chunks=chunks)
        with open(partial / MANIFEST_NAME, "wb") as f:
            f.write(encode_manifest(remote, key))
            f.flush()
            os.fsync(f.fileno())
        os.rename(partial, dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        for out in outs.values():
            out.close()
    return dest


def stage(remote_snapshot_dir: Path | str, local_dest: Path | str, progress: Progress | None = None, *,
          key: bytes | None = None) -> Manifest:
    """Stage a remote snapshot to ``local_dest`` (resumable), verifying every chunk.

    ``progress(bytes_done, bytes_total)`` is called after each chunk.  Returns the local
    manifest (compressed fields cleared, signed with ``key``).  Raises SnapshotCorrupt naming
    the chunk on any bad frame or checksum; the partial directory is kept for a resume.
    """
    src, dest = Path(remote_snapshot_dir), Path(local_dest)
    remote = read_manifest(src, key)
    if dest.exists():
        raise SnapshotError(f"{dest} already exists", path=dest)
    partial = dest.with_name(dest.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    done = 0
    files: dict[str, int] = {}
    try:
        for i, c in enumerate(remote.chunks):
            where = f"{src / (c.file + '.zst')} chunk {i}"
            if c.compressed_offset is None or c.compressed_length is None:
                raise SnapshotCorrupt(f"{where}: no compressed offset/length in the remote manifest",
                                      path=src, chunk=i, tensors=remote.chunk_tensors(i), expected="int", actual=None)
            if c.compressed_length > max_compressed_bytes(c.length):
                raise SnapshotCorrupt(f"{where}: compressed length {c.compressed_length} over the bound "
                                      f"{max_compressed_bytes(c.length)}", path=src, chunk=i,
                                      tensors=remote.chunk_tensors(i), expected=max_compressed_bytes(c.length),
                                      actual=c.compressed_length)
            if c.file not in files:
                files[c.file] = os.open(partial / c.file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fd = files[c.file]
            have = os.pread(fd, c.length, c.offset)
            if len(have) != c.length or _restore.xxh3_64(have) != c.checksum:
                with open(src / (c.file + ".zst"), "rb") as f:
                    f.seek(c.compressed_offset)
                    frame = f.read(c.compressed_length)
                if len(frame) != c.compressed_length:
                    raise SnapshotCorrupt(f"{where}: remote file truncated: expected {c.compressed_length} "
                                          f"bytes, read {len(frame)}", path=src, chunk=i,
                                          tensors=remote.chunk_tensors(i), expected=c.compressed_length,
                                          actual=len(frame))
                try:
                    data = decompress_chunk(frame, c.length, where)
                except SnapshotCorrupt as exc:
                    exc.chunk, exc.tensors = i, remote.chunk_tensors(i)
                    raise
                actual = _restore.xxh3_64(data)
                if actual != c.checksum:
                    raise SnapshotCorrupt(f"{where}: XXH3-64 expected {c.checksum:016x}, actual {actual:016x}; "
                                          f"covers tensors {remote.chunk_tensors(i)[:8]}", path=src, chunk=i,
                                          tensors=remote.chunk_tensors(i), expected=c.checksum, actual=actual)
                os.pwrite(fd, data, c.offset)
            done += c.length
            if progress:
                progress(done, remote.total_bytes)
        for fd in files.values():
            os.fsync(fd)
    finally:
        for fd in files.values():
            os.close(fd)
    local = dataclasses.replace(remote, chunks=[dataclasses.replace(c, compressed_offset=None, compressed_length=None)
                                                for c in remote.chunks])
    with open(partial / MANIFEST_NAME, "wb") as f:
        f.write(encode_manifest(local, key))
        f.flush()
        os.fsync(f.fileno())
    verify_chunks(partial, local)
    os.rename(partial, dest)
    return local
