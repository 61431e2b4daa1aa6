"""Import an HF-layout checkpoint (config.json + *.safetensors) into a snapshot.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON header + the data section.
Every header is validated before any tensor is allocated: N within the file and under
MAX_HEADER_BYTES; a JSON object without duplicate keys; each tensor a known dtype, a shape of
non-negative integers, each at most MAX_DIM and their product (zeros counted as 1) at most
MAX_ELEMENTS, and ``data_offsets`` whose length equals product(shape) × itemsize; the
ranges, sorted, tile the data section exactly (inside it, no overlap, no hole).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
from pathlib import Path

import torch

from agent.errors import InvalidCheckpoint
from agent.snapshot.format import GoldenCheck, Manifest, ModelIdentity

MAX_HEADER_BYTES = 100 << 20      # the safetensors library's own cap
MAX_CONFIG_BYTES = 16 << 20
MAX_NDIM = 16
# Every dimension, and the product of the dimensions with zero-length ones counted as 1 (the
# largest stride, so also the element count), must fit the snapshot manifest's integer range
# [0, 2^62] (format._int): below 2^63, so torch's int64 sizes and strides never overflow, and
# every header accepted here can be written as a manifest.  A shape [0, 2^70] has no bytes but
# would crash the import in torch (TypeError: Overflow when unpacking long long).
MAX_DIM = 1 << 62
MAX_ELEMENTS = 1 << 62

# safetensors dtype name -> torch dtype (names from the safetensors format specification)
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}


def _bad(path, field, value, limit, why: str) -> InvalidCheckpoint:
    return InvalidCheckpoint(f"{path}: {field}: {why} (got {value!r:.120}, expected {limit!r:.120})",
                             path=path, field=field, value=value, limit=limit)


def _no_duplicates(path):
    def hook(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise _bad(path, k, k, "unique names", "duplicate key in the header")
            seen[k] = v
        return seen
    return hook


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_safetensors_header(path: Path | str) -> dict:
    """The validated header of a safetensors file.

    Returns ``{"header_bytes": N, "data_start": 8 + N, "metadata": {str: str}, "tensors":
    {name: {"dtype": torch.dtype, "shape": [..], "begin": int, "end": int}}}`` with offsets
    relative to the data section, in file order.  Raises InvalidCheckpoint naming the file,
    the tensor or field, the value and the limit.
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise _bad(path, "header length", size, ">= 8 bytes", "file too short for the header length")
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES:
            raise _bad(path, "header length", n, MAX_HEADER_BYTES, "header length over the cap")
        if 8 + n > size:
            raise _bad(path, "header length", n, size - 8, "header runs past the end of the file")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path))
    except InvalidCheckpoint:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _bad(path, "header", str(exc)[:80], "a UTF-8 JSON object", "header is not valid JSON") from exc
    if not isinstance(header, dict):
        raise _bad(path, "header", type(header).__name__, "object", "header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad(path, "__metadata__", metadata, "{str: str}", "metadata must map strings to strings")
    data_size = size - 8 - n
    tensors = {}
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, name, info, "{dtype, shape, data_offsets}", "malformed tensor entry")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in ST_DTYPES:
            raise _bad(path, name, dtype, sorted(ST_DTYPES), "unknown dtype")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(s) and s >= 0 for s in shape):
            raise _bad(path, name, shape, f"at most {MAX_NDIM} non-negative integers", "bad shape")
        if any(s > MAX_DIM for s in shape):
            raise _bad(path, name, max(shape), MAX_DIM, f"shape {str(shape)[:80]}: a dimension over the cap")
        if math.prod(max(s, 1) for s in shape) > MAX_ELEMENTS:
            raise _bad(path, name, math.prod(max(s, 1) for s in shape), MAX_ELEMENTS,
                       f"shape {str(shape)[:80]}: product of the dimensions (zeros counted as 1) over the cap")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise _bad(path, name, offs, "[begin, end] with 0 <= begin <= end", "bad data_offsets")
        want = math.prod(shape) * ST_DTYPES[dtype].itemsize
        if offs[1] - offs[0] != want:
            raise _bad(path, name, offs[1] - offs[0], want,
                       f"{dtype}{shape} needs product(shape) x itemsize bytes; data_offsets {offs} cover")
        if offs[1] > data_size:
            raise _bad(path, name, offs[1], data_size, "data_offsets end past the data section")
        tensors[name] = {"dtype": ST_DTYPES[dtype], "shape": shape, "begin": offs[0], "end": offs[1]}
    cursor = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1]["begin"], kv[1]["end"])):
        if t["begin"] != cursor:
            why = "overlaps the previous tensor" if t["begin"] < cursor else "leaves a hole before it"
            raise _bad(path, name, t["begin"], cursor, f"data range {why}")
        cursor = t["end"]
    if cursor != data_size:
        raise _bad(path, "data section", data_size, cursor, "bytes after the last tensor (a hole)")
    return {"header_bytes": n, "data_start": 8 + n, "metadata": metadata, "tensors": tensors}


def load_safetensors(path: Path | str) -> dict[str, torch.Tensor]:
    """All tensors of a validated safetensors file (CPU), as views of a private, copy-on-write
    map of it: pages are read when used, so importing a checkpoint larger than memory streams."""
    header = read_safetensors_header(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data_size = sum(t["end"] - t["begin"] for t in header["tensors"].values())
        if size != header["data_start"] + data_size:
            raise _bad(Path(path), "file size", size, header["data_start"] + data_size,
                       "file changed since its header was validated")
        if data_size:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            base = torch.frombuffer(mm, dtype=torch.uint8, offset=header["data_start"], count=data_size)
        else:
            base = torch.empty(0, dtype=torch.uint8)
    out = {}
    for name, t in header["tensors"].items():
        itemsize = t["dtype"].itemsize
        raw = base[t["begin"]:t["end"]]
        if t["begin"] % itemsize:   # safetensors does not promise alignment: copy to align
            raw = raw.clone()
        out[name] = raw.view(t["dtype"]).view(t["shape"])
    return out


def import_hf(hf_dir: Path | str, dest: Path | str, *, key: bytes | None = None, name: str | None = None,
              version: str | None = None, golden: GoldenCheck | None = None,
              chunk_bytes: int = 16 << 20) -> Manifest:
    """Import ``hf_dir`` (config.json + *.safetensors) as a snapshot at ``dest``.

    Model identity: ``name`` (default: config's ``_name_or_path`` or the directory name),
    ``version`` (default: the first 12 hex digits of the digest), ``source_digest`` =
    "sha256:" + SHA-256 over config.json and each safetensors file (names and bytes, sorted).
    The config is stored in ``extra["config"]``.  Raises InvalidCheckpoint.

    The result is a weights-only snapshot (HF-layout tensors, no golden check unless
    ``golden`` is given, no engine or model configuration in the replica's form): for storage
    and restore throughput.  A replica refuses to restore it (zygote.check_replica_manifest);
    replicas restore snapshots captured from a warmed replica (zygote.capture).
    """
    from agent.snapshot.writer import write_snapshot
    hf_dir = Path(hf_dir)
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise _bad(cfg_path, "config.json", None, "a file", "missing")
    if cfg_path.stat().st_size > MAX_CONFIG_BYTES:
        raise _bad(cfg_path, "config.json", cfg_path.stat().st_size, MAX_CONFIG_BYTES, "config too large")
    try:
        config = json.loads(cfg_path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _bad(cfg_path, "config.json", str(exc)[:80], "a JSON object", "invalid JSON") from exc
    if not isinstance(config, dict):
        raise _bad(cfg_path, "config.json", type(config).__name__, "object", "not a JSON object")
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise _bad(hf_dir, "*.safetensors", 0, ">= 1 file", "no safetensors files")
    from agent.progress import bar

    digest = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    with bar(sum(p.stat().st_size for p in files), "import: digest") as shown:
        for p in [cfg_path, *files]:
            digest.update(p.name.encode() + b"\0")
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
                    shown.update(len(block) if p != cfg_path else 0)
    with bar(len(files), "import: load", unit="file") as shown:
        for p in files:
            for tname, t in load_safetensors(p).items():
                if tname in tensors:
                    raise _bad(p, tname, tname, "unique across files", "duplicate tensor name")
                tensors[tname] = t
            shown.update(1)
    hexd = digest.hexdigest()
    model = ModelIdentity(name or str(config.get("_name_or_path") or hf_dir.name), version or hexd[:12],
                          "sha256:" + hexd)
    return write_snapshot(dest, tensors, model=model, golden=golden, key=key, chunk_bytes=chunk_bytes,
                          extra={"config": config, "source_files": [p.name for p in files]})
