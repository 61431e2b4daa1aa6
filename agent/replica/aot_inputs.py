"""What an AOT package may be called with, recorded at build and checked before every call.

AOTInductor's generated code trusts its inputs unless ``AOTI_RUNTIME_CHECK_INPUTS=1`` (off by
default, and read once per loaded package): a batch larger than it was compiled for, or a
float16 KV cache where it expects float32, is read and written out of bounds.  So the package
records its inputs (``package.json`` ``ranges`` and ``kv``, and the ranges again inside the
package's own metadata, see agent/replica/aot.py) and :meth:`InputSpec.check` refuses a call
outside them with :class:`~agent.errors.PackageInputError` before the compiled code runs::

    tokens           [B, S]            int64   B in ranges["batch"], S in ranges["seq"]
    input_pos        [B, S]            int64   every value in [0, T)
    cache_batch_idx  [B]               int64   every value in [0, C)
    k_caches         layers x [C, T, Hkv, D]   kv dtype, contiguous, C in ranges["cache_batch"]
    v_caches         the same
    logit_pos        [B, K]            int64   K in ranges["seq"], every value in [0, S)

All on the package's device.  K, the logit positions (agent/replica/model.py), is a dynamic size
of its own, compiled over the range of S (one row's positions at most; :data:`LOGITS_RANGE`).
The index checks read the extremes of three small tensors back in one transfer (on a GPU, one
synchronisation per call): the price of refusing an out-of-bounds read or write instead of
making it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from collections.abc import Mapping, Sequence

import torch

from agent.errors import InvalidCheckpoint, PackageInputError

DIMS = ("batch", "seq", "cache_batch")
"""The ranges a package records (agent/replica/model.py's B, S and C)."""
LOGITS_RANGE = "seq"
"""The recorded range K (``logit_pos``'s positions per row) is compiled over: S's."""


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_ranges(value: Any, where: Any) -> dict[str, tuple[int, int]]:
    """``{"batch": [lo, hi], "seq": [lo, hi], "cache_batch": [lo, hi]}`` checked (integers,
    1 <= lo <= hi).  Raises InvalidCheckpoint naming the key and the value."""
    if not isinstance(value, Mapping) or set(value) != set(DIMS):
        raise InvalidCheckpoint(f"{where}: ranges {value!r:.120} must map exactly {DIMS}",
                                path=where, field="ranges", value=value, limit=DIMS)
    out = {}
    for name in DIMS:
        pair = value[name]
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(map(_int, pair))
                and 1 <= pair[0] <= pair[1]):
            raise InvalidCheckpoint(f"{where}: range {name}={pair!r:.80} must be [lo, hi] "
                                    "integers with 1 <= lo <= hi", path=where, field=name,
                                    value=pair, limit="[lo, hi]")
        out[name] = (int(pair[0]), int(pair[1]))
    return out


@dataclass(frozen=True)
class InputSpec:
    """The inputs one package accepts (see the module docstring)."""

    package: str
    ranges: Mapping[str, tuple[int, int]]
    layers: int
    max_seq_len: int            # T, fixed
    kv_heads: int               # Hkv, fixed
    head_dim: int               # D, fixed
    kv_dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], device: str, where: Any) -> InputSpec:
        """From ``package.json``'s ``ranges`` and ``kv``.  Raises InvalidCheckpoint when they
        are missing or malformed."""
        kv = manifest.get("kv")
        keys = ("layers", "max_seq_len", "kv_heads", "head_dim", "dtype")
        if not isinstance(kv, Mapping) or any(k not in kv for k in keys):
            raise InvalidCheckpoint(f"{where}: kv {kv!r:.120} must give {keys}", path=where,
                                    field="kv", value=kv, limit=keys)
        if not all(_int(kv[k]) and kv[k] >= 1 for k in keys[:4]):
            raise InvalidCheckpoint(f"{where}: kv sizes {kv!r:.120} must be integers >= 1",
                                    path=where, field="kv", value=kv, limit=1)
        dtype = getattr(torch, str(kv["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidCheckpoint(f"{where}: kv dtype {kv['dtype']!r} is not a torch dtype",
                                    path=where, field="kv.dtype", value=kv["dtype"], limit=None)
        return cls(str(where), parse_ranges(manifest.get("ranges"), where), kv["layers"],
                   kv["max_seq_len"], kv["kv_heads"], kv["head_dim"], dtype, torch.device(device))

    def _refuse(self, argument: str, field: str, value: Any, limit: Any, why: str) -> None:
        raise PackageInputError(f"{self.package}: {argument} {field} {value} {why} {limit}; "
                                "refused before the compiled code ran", package=self.package,
                                argument=argument, field=field, value=value, limit=limit)

    def _tensor(self, argument: str, t: Any, rank: int, dtype: torch.dtype) -> None:
        if not isinstance(t, torch.Tensor):
            self._refuse(argument, "type", type(t).__name__, "torch.Tensor", "is not a")
        if t.dim() != rank:
            self._refuse(argument, "rank", t.dim(), rank, "is not the package's")
        if t.dtype != dtype:
            self._refuse(argument, "dtype", str(t.dtype), str(dtype), "is not the package's")
        if t.device.type != self.device.type or (
                self.device.index is not None and t.device.index != self.device.index):
            self._refuse(argument, "device", str(t.device), str(self.device), "is not the package's")
        if not t.is_contiguous():
            self._refuse(argument, "strides", tuple(t.stride()), "contiguous", "are not")

    def _size(self, argument: str, name: str, value: int) -> None:
        lo, hi = self.ranges[name]
        if not lo <= value <= hi:
            self._refuse(argument, name, value, [lo, hi], "is outside the compiled range")

    def check(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache_batch_idx: torch.Tensor,
              k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor],
              logit_pos: torch.Tensor) -> None:
        """Raise PackageInputError naming the first argument that the package cannot take."""
        self._tensor("tokens", tokens, 2, torch.int64)
        batch, seq = tokens.shape
        self._size("tokens", "batch", batch)
        self._size("tokens", "seq", seq)
        self._tensor("input_pos", input_pos, 2, torch.int64)
        if tuple(input_pos.shape) != (batch, seq):
            self._refuse("input_pos", "shape", tuple(input_pos.shape), (batch, seq), "is not tokens'")
        self._tensor("cache_batch_idx", cache_batch_idx, 1, torch.int64)
        if cache_batch_idx.shape[0] != batch:
            self._refuse("cache_batch_idx", "batch", cache_batch_idx.shape[0], batch, "is not tokens'")
        for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
            if len(caches) != self.layers:
                self._refuse(name, "length", len(caches), self.layers, "is not the package's layers")
        cache = k_caches[0]
        self._tensor("k_caches[0]", cache, 4, self.kv_dtype)
        cache_batch = cache.shape[0]
        self._size("k_caches[0]", "cache_batch", cache_batch)
        shape = (cache_batch, self.max_seq_len, self.kv_heads, self.head_dim)
        for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
            for i, c in enumerate(caches):
                argument = f"{name}[{i}]"
                self._tensor(argument, c, 4, self.kv_dtype)
                if tuple(c.shape) != shape:
                    self._refuse(argument, "shape", tuple(c.shape), shape, "is not")
        self._tensor("logit_pos", logit_pos, 2, torch.int64)
        if logit_pos.shape[0] != batch:
            self._refuse("logit_pos", "batch", logit_pos.shape[0], batch, "is not tokens'")
        lo, hi = self.ranges[LOGITS_RANGE]
        if not lo <= logit_pos.shape[1] <= hi:
            self._refuse("logit_pos", "logits", logit_pos.shape[1], [lo, hi],
                         "is outside the compiled range")
        # Values last: they are data (on a GPU, reading them back synchronises: once, for all).
        extremes = torch.stack([*torch.aminmax(cache_batch_idx), *torch.aminmax(input_pos),
                                *torch.aminmax(logit_pos)]).tolist()
        for (argument, limit, why), (lo, hi) in zip(
                (("cache_batch_idx", cache_batch, "is outside the cache's slots"),
                 ("input_pos", self.max_seq_len, "is outside the cache's positions"),
                 ("logit_pos", seq, "is outside the call's positions")),
                (extremes[0:2], extremes[2:4], extremes[4:6]), strict=True):
            if lo < 0 or hi >= limit:
                self._refuse(argument, "value", lo if lo < 0 else hi, [0, limit - 1], why)
