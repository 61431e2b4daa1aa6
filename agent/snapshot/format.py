"""Snapshot format v1: the data structures and their validated (de)serialisation.

A snapshot is a directory::

    <name>/
      manifest.msgpack     envelope {magic, format_version, body, sha256, hmac}
      data-00000.bin       chunks, each a multiple of ALIGN bytes, tensors packed inside

The *buffer* is the snapshot's logical byte space, ``total_bytes`` long: the data files laid
end to end.  Every chunk maps ``[buffer_offset, buffer_offset + length)`` of it to ``offset`` in
``file``; the chunks tile the buffer without gaps or overlaps, in order, and the chunks of one
file lie at increasing, non-overlapping file offsets (so the chunks' lengths, ``total_bytes``,
can never exceed the data files' sizes).  Every tensor is a contiguous,
row-major run ``[offset, offset + nbytes)`` of the buffer, aligned to TENSOR_ALIGN, so that a
restore yields each tensor as a view into one host buffer.  Tensors with bytes lie in manifest
order and never overlap (no two names alias the same bytes).

``manifest.msgpack`` and every data file must be regular files directly in the snapshot
directory: a symbolic link, directory, FIFO or device in their place is refused (the reader
opens them with O_NOFOLLOW | O_NONBLOCK and checks S_ISREG), so a chunk's plain file name
really confines its reads to the snapshot directory.

The envelope's ``body`` is the msgpack of the manifest; ``sha256`` is its SHA-256 (corruption)
and ``hmac`` its HMAC-SHA256 under the node key when one is configured (tamper evidence).
Chunks carry XXH3-64 checksums (fast enough to verify at disk speed; not a defence against a
forger, which is what the signed manifest is for).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from agent.errors import SnapshotCorrupt, SnapshotIncompatible

FORMAT_VERSION = 1
ALIGN = 4096                 # chunk and file alignment: O_DIRECT needs the logical block size
TENSOR_ALIGN = 64            # every tensor starts on a cache line (and any dtype's itemsize)
MAGIC = "rewarm-snapshot"
MANIFEST_NAME = "manifest.msgpack"
MAX_MANIFEST_BYTES = 64 << 20    # a 100k-tensor model's table is a few MiB
MAX_ENTRIES = 1 << 20            # tensors or chunks in one manifest
MAX_NDIM = 16
MAX_METHOD_CHARS = 64            # golden.method: a short name
_FILE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")

# The dtypes a weight can have, by the name the manifest stores (str(dtype) without "torch.").
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
        "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name for ``dtype``; raises SnapshotCorrupt if it cannot be stored."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise SnapshotCorrupt(f"dtype {dtype} cannot be stored; supported: {sorted(DTYPES)}",
                              path=None, chunk=None, tensors=[], expected=sorted(DTYPES),
                              actual=name)
    return name


@dataclass(frozen=True)
class Pins:
    """What a restore depends on; compared field by field with the machine before restoring."""

    format_version: int
    torch: str
    cuda_driver: str            # NVIDIA driver version, or "cpu"
    gpu_name: str | None
    gpu_cc: str | None          # compute capability "9.0", or None
    cpu_isa: str                # torch's CPU capability: "AVX512", "AVX2", "DEFAULT", ...
    python_abi: str             # SOABI, e.g. "cpython-311-x86_64-linux-gnu"
    rewarm: str


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    version: str
    source_digest: str          # "sha256:<hex>" of the source checkpoint


@dataclass(frozen=True)
class GoldenCheck:
    """Token ids a restored replica must reproduce: prompts [P][S_p], expected [P][max_tokens].

    ``method`` names how ``expected`` was recorded, and so how it must be checked (the replica
    decides which it accepts: agent/replica/golden.py); ``""`` is what a manifest written
    before the field existed decodes to."""

    prompts: list[list[int]]
    seed: int
    max_tokens: int
    expected: list[list[int]]
    method: str = ""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str                  # a key of DTYPES
    shape: tuple[int, ...]
    strides: tuple[int, ...]    # in elements, always row-major contiguous in v1
    offset: int                 # bytes into the buffer
    nbytes: int                 # product(shape) * itemsize


@dataclass(frozen=True)
class ChunkEntry:
    file: str                   # data file name inside the snapshot directory
    offset: int                 # bytes into that file
    length: int                 # bytes; a multiple of ALIGN
    buffer_offset: int          # bytes into the buffer
    checksum: int               # XXH3-64 of the chunk's bytes
    compressed_offset: int | None = None   # remote tier: bytes into "<file>.zst"
    compressed_length: int | None = None   # remote tier: zstd frame length


@dataclass(frozen=True)
class Manifest:
    format_version: int
    tensors: list[TensorEntry]
    chunks: list[ChunkEntry]
    pins: Pins
    model: ModelIdentity
    golden: GoldenCheck | None
    extra: dict = field(default_factory=dict)
    created_s: float = 0.0      # Unix time
    total_bytes: int = 0        # buffer length, a multiple of ALIGN

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tensors"] = [[t.name, t.dtype, list(t.shape), list(t.strides), t.offset, t.nbytes]
                        for t in self.tensors]
        d["chunks"] = [[c.file, c.offset, c.length, c.buffer_offset, c.checksum,
                        c.compressed_offset, c.compressed_length] for c in self.chunks]
        return d

    def chunk_tensors(self, index: int) -> list[str]:
        """Names of the tensors whose bytes overlap chunk ``index``."""
        c = self.chunks[index]
        lo, hi = c.buffer_offset, c.buffer_offset + c.length
        return [t.name for t in self.tensors if t.nbytes and t.offset < hi and t.offset + t.nbytes > lo]


# --- validation of decoded (untrusted) data ---------------------------------------------

def _bad(path: Any, what: str, expected: Any, actual: Any) -> SnapshotCorrupt:
    return SnapshotCorrupt(f"{path}: manifest field {what}: expected {expected}, got {actual!r:.200}",
                           path=path, chunk=None, tensors=[], expected=expected, actual=actual)


def _typed(path: Any, what: str, value: Any, kind: type | tuple, nullable: bool = False) -> Any:
    if value is None and nullable:
        return None
    if isinstance(value, bool) and kind is int or not isinstance(value, kind):
        raise _bad(path, what, getattr(kind, "__name__", str(kind)), type(value).__name__)
    return value


def _int(path: Any, what: str, value: Any, lo: int = 0, hi: int = 1 << 62, nullable=False) -> Any:
    value = _typed(path, what, value, int, nullable)
    if value is not None and not lo <= value <= hi:
        raise _bad(path, what, f"an integer in [{lo}, {hi}]", value)
    return value


def _list(path: Any, what: str, value: Any, limit: int | None = None) -> list:
    value = _typed(path, what, value, list)
    limit = MAX_ENTRIES if limit is None else limit
    if len(value) > limit:
        raise _bad(path, what, f"at most {limit} entries", len(value))
    return value


def _record(path: Any, what: str, value: Any, cls: Any) -> dict:
    value = _typed(path, what, value, dict)
    names = set(cls.__dataclass_fields__)
    if set(value) != names:
        raise _bad(path, what, sorted(names), sorted(map(str, value)))
    return value


def manifest_from_dict(d: Any, path: Any = None) -> Manifest:
    """Build a Manifest from decoded msgpack, checking every type, range and the layout.

    Raises SnapshotCorrupt naming the field, the expected and the actual value.
    """
    d = _record(path, "manifest", d, Manifest)
    version = _int(path, "format_version", d["format_version"])
    if version != FORMAT_VERSION:
        raise SnapshotIncompatible(
            f"{path}: manifest body format_version {version}, this rewarm reads {FORMAT_VERSION}",
            path=path, mismatches={"format_version": (version, FORMAT_VERSION)})
    p = _record(path, "pins", d["pins"], Pins)
    pins = Pins(**{k: _typed(path, f"pins.{k}", v, int if k == "format_version" else str,
                             nullable=k in ("gpu_name", "gpu_cc")) for k, v in p.items()})
    m = _record(path, "model", d["model"], ModelIdentity)
    model = ModelIdentity(**{k: _typed(path, f"model.{k}", v, str) for k, v in m.items()})
    golden = None
    if d["golden"] is not None:
        g = d["golden"]
        if isinstance(g, dict) and "method" not in g:      # written before the field existed
            g = {**g, "method": ""}
        g = _record(path, "golden", g, GoldenCheck)
        method = _typed(path, "golden.method", g["method"], str)
        if len(method) > MAX_METHOD_CHARS:
            raise _bad(path, "golden.method", f"at most {MAX_METHOD_CHARS} characters", len(method))
        lists = {k: [[_int(path, f"golden.{k}", x, 0, 1 << 31) for x in _list(path, f"golden.{k}", row)]
                     for row in _list(path, f"golden.{k}", g[k], 4096)] for k in ("prompts", "expected")}
        golden = GoldenCheck(seed=_int(path, "golden.seed", g["seed"], -(1 << 63), (1 << 64) - 1),
                             max_tokens=_int(path, "golden.max_tokens", g["max_tokens"]),
                             method=method, **lists)
    total = _int(path, "total_bytes", d["total_bytes"])
    tensors, names, prev = [], set(), None     # prev: the last tensor with bytes
    for i, row in enumerate(_list(path, "tensors", d["tensors"])):
        what = f"tensors[{i}]"
        if not isinstance(row, list) or len(row) != 6:
            raise _bad(path, what, "a list of 6 fields", row)
        name, dt, shape, strides, off, nbytes = row
        _typed(path, f"{what}.name", name, str)
        if name in names:
            raise _bad(path, f"{what}.name", "unique tensor names", name)
        names.add(name)
        if dt not in DTYPES:
            raise _bad(path, f"{name}.dtype", sorted(DTYPES), dt)
        shape = tuple(_int(path, f"{name}.shape", s) for s in _list(path, f"{name}.shape", shape, MAX_NDIM))
        strides = tuple(_int(path, f"{name}.strides", s) for s in _list(path, f"{name}.strides", strides, MAX_NDIM))
        off, nbytes = _int(path, f"{name}.offset", off), _int(path, f"{name}.nbytes", nbytes)
        want = math.prod(shape) * DTYPES[dt].itemsize
        if nbytes != want:
            raise _bad(path, f"{name}.nbytes", f"product{list(shape)} x itemsize = {want}", nbytes)
        if off % TENSOR_ALIGN or off + nbytes > total:
            raise _bad(path, f"{name}.offset", f"a multiple of {TENSOR_ALIGN} with offset+nbytes <= {total}", off)
        if nbytes and prev is not None and off < prev.offset + prev.nbytes:
            raise SnapshotCorrupt(
                f"{path}: manifest tensors {prev.name!r} [{prev.offset}, {prev.offset + prev.nbytes}) and "
                f"{name!r} [{off}, {off + nbytes}) overlap or are out of order: expected {name}.offset "
                f">= {prev.offset + prev.nbytes}, got {off}", path=path, chunk=None,
                tensors=[prev.name, name], expected=prev.offset + prev.nbytes, actual=off)
        tensors.append(TensorEntry(name, dt, shape, strides, off, nbytes))
        if nbytes:
            prev = tensors[-1]
    chunks, cursor = [], 0
    file_end: dict[str, tuple[int, int]] = {}   # file -> (end of its last chunk, index)
    for i, row in enumerate(_list(path, "chunks", d["chunks"])):
        what = f"chunks[{i}]"
        if not isinstance(row, list) or len(row) != 7:
            raise _bad(path, what, "a list of 7 fields", row)
        fname = _typed(path, f"{what}.file", row[0], str)
        if not _FILE_NAME.match(fname):
            raise _bad(path, f"{what}.file", "a plain file name", fname)
        off, length, boff = (_int(path, f"{what}.{k}", v) for k, v in zip(("offset", "length", "buffer_offset"), row[1:4], strict=True))
        if off % ALIGN or length % ALIGN or length == 0:
            raise _bad(path, what, f"offset and length multiples of {ALIGN}, length > 0", (off, length))
        if boff != cursor:
            raise _bad(path, f"{what}.buffer_offset", f"{cursor} (chunks tile the buffer)", boff)
        cursor += length
        end, last = file_end.get(fname, (0, None))
        if off < end:
            raise SnapshotCorrupt(
                f"{path}: manifest chunks[{last}] and chunks[{i}] overlap or are out of order in "
                f"{fname}: expected chunks[{i}].offset >= {end}, got {off}", path=path, chunk=i,
                chunks=[last, i], tensors=[], expected=end, actual=off)
        file_end[fname] = (off + length, i)
        chunks.append(ChunkEntry(fname, off, length, boff, _int(path, f"{what}.checksum", row[4], 0, (1 << 64) - 1),
                                 _int(path, f"{what}.compressed_offset", row[5], nullable=True),
                                 _int(path, f"{what}.compressed_length", row[6], nullable=True)))
    if cursor != total:
        raise _bad(path, "total_bytes", f"sum of chunk lengths = {cursor}", total)
    return Manifest(version, tensors, chunks, pins, model, golden,
                    extra=_typed(path, "extra", d["extra"], dict),
                    created_s=float(_typed(path, "created_s", d["created_s"], (int, float))),
                    total_bytes=total)
