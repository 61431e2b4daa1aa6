"""Load a Hugging Face checkpoint into the runtime layout, streaming layer by layer.

The very first boot streams: a model with no snapshot anywhere pays one full boot,
so that boot reads ``*.safetensors`` with large sequential reads (one ``readinto`` per layer
group, never an mmap that page-faults 4 KiB at a time), converts each group to the runtime
layout (fused QKV / gate-up, runtime dtype) as it lands, and hands it on at once, so that the
caller can run the first request's prefill on early layers while later ones are still read
(:func:`stream_hf_weights`, used by :mod:`agent.replica.firstboot`).

The safetensors header is untrusted: its length is checked against the file and a limit before
it is read, and every entry's dtype, shape and byte range are checked before any tensor is made.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from collections.abc import Iterator

import torch

from agent.errors import InvalidCheckpoint
from agent.replica.config import LlamaConfig
from agent.replica.model import hf_expected_shapes, hf_to_runtime
from agent.replica.shapes import check_shapes

MAX_HEADER_BYTES = 100 << 20
"""Largest safetensors JSON header accepted (the safetensors library's own limit is 100 MB)."""

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8,
              "I8": torch.int8}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def read_header(path: Path) -> tuple[int, dict[str, dict]]:
    """Parse a safetensors header: ``(data_start_offset, {name: {dtype, shape, data_offsets}})``.

    Raises InvalidCheckpoint for a header length over :data:`MAX_HEADER_BYTES` or the file,
    bad JSON, an unknown dtype, or a byte range that is out of the file or disagrees with shape.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise InvalidCheckpoint(f"{path}: {size} bytes is too short for a safetensors file",
                                    path=path, field="header", value=size, limit=8)
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise InvalidCheckpoint(f"{path}: header length {n} exceeds limit "
                                    f"{min(MAX_HEADER_BYTES, size - 8)}", path=path,
                                    field="header", value=n, limit=min(MAX_HEADER_BYTES, size - 8))
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidCheckpoint(f"{path}: header is not JSON ({exc})", path=path,
                                    field="header", value=None, limit=None) from None
    if not isinstance(header, dict):
        raise InvalidCheckpoint(f"{path}: header is not a JSON object", path=path, field="header",
                                value=type(header).__name__, limit="object")
    header.pop("__metadata__", None)
    data_start, data_len = 8 + n, size - 8 - n
    for name, entry in header.items():
        dtype = _ST_DTYPES.get(str(entry.get("dtype"))) if isinstance(entry, dict) else None
        if dtype is None:
            raise InvalidCheckpoint(f"{path}: tensor {name!r} has unsupported dtype "
                                    f"{entry.get('dtype') if isinstance(entry, dict) else entry!r}",
                                    path=path, field=name, value=entry, limit=sorted(_ST_DTYPES))
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (_ints(shape) and _ints(offsets) and len(offsets) == 2):
            raise InvalidCheckpoint(f"{path}: tensor {name!r} needs a shape and two data_offsets of "
                                    f"non-negative integers, got {shape!r} and {offsets!r}",
                                    path=path, field=name, value=(shape, offsets), limit=None)
        begin, end = offsets
        nbytes = math.prod(entry["shape"]) * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise InvalidCheckpoint(f"{path}: tensor {name!r} bytes [{begin}, {end}) do not fit "
                                    f"shape {entry['shape']} ({nbytes} bytes) in {data_len} data bytes",
                                    path=path, field=name, value=(begin, end), limit=data_len)
        entry["torch_dtype"] = dtype
    return data_start, header


def _ints(value) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _group_key(name: str) -> tuple[int, int]:
    """Load order: embedding first, then layers 0..L-1, then final norm and LM head."""
    if (m := _LAYER.match(name)) is not None:
        return (1, int(m.group(1)))
    return (0, 0) if name.startswith("model.embed_tokens.") else (2, 0)


def stream_hf_weights(model_dir: Path | str, config: LlamaConfig | None = None
                      ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield ``(group, runtime_tensors)`` in load order: ``"embed"``, ``"layer.0"`` ...,  ``"final"``.

    Each group is read from its file with one sequential ``readinto`` covering the group's byte
    range, then renamed/fused/cast (``config.dtype``).  Shapes are checked against ``config``
    as each group lands; raises InvalidCheckpoint naming the tensor and both shapes.
    """
    model_dir = Path(model_dir)
    config = config or LlamaConfig.from_dir(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise InvalidCheckpoint(f"{model_dir}: no *.safetensors files", path=model_dir,
                                field="*.safetensors", value=0, limit=1)
    groups: dict[tuple[int, int], list[tuple[Path, int, str, dict]]] = {}
    for path in files:
        start, header = read_header(path)
        for name, entry in header.items():
            groups.setdefault(_group_key(name), []).append((path, start, name, entry))
    # Which matrices are stored quantized is read from the names (agent/replica/quant.py).
    expected = hf_expected_shapes(config, (n for g in groups.values() for _, _, n, _ in g))
    dtype = config.torch_dtype
    for key in sorted(groups):
        hf: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list] = {}
        for path, start, name, entry in groups[key]:
            by_file.setdefault(path, []).append((start, name, entry))
        for path, items in by_file.items():
            lo = min(s + e["data_offsets"][0] for s, _, e in items)
            hi = max(s + e["data_offsets"][1] for s, _, e in items)
            buf = torch.empty(hi - lo, dtype=torch.uint8)
            with open(path, "rb", buffering=0) as f:
                f.seek(lo)
                view = buf.numpy().data
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise InvalidCheckpoint(f"{path}: truncated at byte {lo + got}",
                                                path=path, field="data", value=lo + got, limit=hi)
                    got += n
            for s, name, entry in items:
                b, e = s + entry["data_offsets"][0] - lo, s + entry["data_offsets"][1] - lo
                hf[name] = buf[b:e].view(entry["torch_dtype"]).view(entry["shape"])
        check_shapes(hf, expected, where=str(model_dir), partial=True)
        group = "embed" if key[0] == 0 else f"layer.{key[1]}" if key[0] == 1 else "final"
        runtime = hf_to_runtime(hf, dtype)
        # Fused/cast tensors are fresh; renamed ones may still view the read buffer, which
        # would keep the whole buffer alive: give them their own storage.
        yield group, {k: (v.clone() if v._base is not None else v) for k, v in runtime.items()}
    # The whole set must be there: checked once all groups landed.
    seen = {name for g in groups.values() for _, _, name, _ in g}
    missing = sorted(set(expected) - seen)
    if missing:
        raise InvalidCheckpoint(f"{model_dir}: missing tensor {missing[0]!r} with shape "
                                f"{expected[missing[0]]} ({len(missing)} missing)",
                                path=model_dir, field=missing[0], value=None, limit=expected[missing[0]])


def load_hf_weights(model_dir: Path | str, config: LlamaConfig | None = None) -> dict[str, torch.Tensor]:
    """All runtime-layout tensors of ``model_dir`` (the tensors a snapshot stores).

    Raises InvalidCheckpoint for a malformed file or a tensor whose shape disagrees with
    config.json (naming the tensor and both shapes), or a missing tensor.
    """
    out: dict[str, torch.Tensor] = {}
    for _, tensors in stream_hf_weights(model_dir, config):
        out.update(tensors)
    return out
