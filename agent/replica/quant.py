"""Weights at the precision the checkpoint ships: weight-only int4 and int8 on CPU.

A GGUF's blocks map onto torch's weight-only kernels without requantizing the int4 ones:

- **Q4_0 / Q4_1** (blocks of 32 weights along the input dimension K; ggml-quants.c
  ``dequantize_row_q4_0/q4_1``: ``w = d * (q - 8)`` and ``w = d * q + m``, q in [0, 15]) ->
  ``torch.ops.aten._weight_int4pack_mm_for_cpu``, whose dequantisation is
  ``w = (q - 8) * scale + zero`` per group of ``GROUP_SIZE`` (measured against a reference
  matmul: tests/replica/test_quant.py).  So Q4_0 is ``scale = d, zero = 0`` and Q4_1 is
  ``scale = d, zero = m + 8 d``: the same 4-bit codes, only the zero re-expressed.
- **Q8_0** (blocks of 32, ``w = d * q``) -> ``torch._weight_int8pack_mm``, which has one scale
  per output row: the block's values are re-expressed on a per-row scale ``max|w| / 127``
  (this one is a requantization; its drift from float32 is what the golden drift reports).

Layouts.  In a Hugging Face directory written by ``rewarm model import-gguf`` (plain, portable):

    <name>.qweight           uint8 [N, K/2]    int4 codes, byte j of a row holds k=2j (low
                                               nibble) and k=2j+1 (high nibble)
    <name>.scales_and_zeros  float32 [K/32, N, 2]   (scale, zero) per group and output row
    <name>.qweight           int8 [N, K]       (int8 tensors)
    <name>.scales            float32 [N]

In the runtime layout (what a snapshot stores and an AOT package binds; ``to_runtime``):

    <name>.weight_int4pack   uint8 [N, K/2]    the codes repacked by
                                               ``_convert_weight_to_int4pack_for_cpu`` (inner
                                               K tiles 1), the layout the CPU kernel reads
    <name>.scales_and_zeros  [K/32, N, 2] in the activation dtype (the kernel requires it)
    <name>.weight_int8       int8 [N, K];  <name>.scales  [N] in the activation dtype

The kernels' fast path takes bfloat16 activations (fp32 activations take a scalar fallback),
so a quantized checkpoint runs with ``config.dtype = "bfloat16"`` (activations and KV cache).
bench/engine_profile.py's ``kernels`` table times both weight-only kernels beside dense
bfloat16 and float32 matmuls at 1, 8 and 64 rows for SmolLM2-135M's shapes.  At the decode
batch sizes (1-8 rows) both beat dense bfloat16 on every layer matrix (576 x 576 at one row:
int4 8.9 us, int8 6.6, bf16 26.9; 3072 x 576: 30.3, 27.9, 81.8; 2 threads, load ~4, minimum
of interleaved rounds); at 64 rows dense bfloat16 is ~1.5x faster (3072 x 576: 508 us
against int4's 756), which only prefill reaches, and there widening each weight per call
would spend what it saves, so int4 stays; int8 and int4 are within noise of each other.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from agent.errors import InvalidCheckpoint
from agent.replica.config import WEIGHT_SCHEMES

GROUP_SIZE = 32
"""Weights per quantization group along K: ggml's QK4_0 / QK4_1 / QK8_0 (ggml-common.h)."""

SCHEMES = WEIGHT_SCHEMES
"""``dense``: every weight in ``config.dtype``.  ``int4``: linear weights as int4 (Q4_*) or
int8 (Q8_0) where the checkpoint has them, the token embedding (and tied LM head) int8,
norms in ``config.dtype``."""

INT4_KINDS = ("Q4_0", "Q4_1")
"""GGUF tensor types kept as int4 codes."""
HF_SUFFIXES = (".qweight", ".scales_and_zeros", ".scales")
RUNTIME_SUFFIXES = (".weight_int4pack", ".scales_and_zeros", ".weight_int8", ".scales")


# --- GGUF blocks -> codes ------------------------------------------------------------------------
def _halves(raw: np.ndarray, offset: int) -> np.ndarray:
    """The 16 bytes of nibbles at ``offset`` of each block -> codes [rows, blocks, 32] uint8
    (ggml's order: element j is the low nibble of byte j, element j + 16 its high nibble)."""
    qs = raw[..., offset:offset + 16]
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def q4_blocks(raw: np.ndarray, kind: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 tensor's bytes ``raw`` [n, k/32 * block_bytes] uint8 -> (codes [n, k]
    uint8 in [0, 15], scales_and_zeros [n, k/32, 2] float32) in the kernel's convention
    ``w = (q - 8) * scale + zero``.  Raises InvalidCheckpoint for another size or kind."""
    block = {"Q4_0": 18, "Q4_1": 20}.get(kind)
    if block is None or k % GROUP_SIZE or raw.shape != (n, k // GROUP_SIZE * block):
        raise InvalidCheckpoint(f"GGUF: {kind} tensor bytes {raw.shape} do not hold [{n}, {k}]",
                                path=None, field=kind, value=raw.shape, limit=(n, k))
    blocks = raw.reshape(n, k // GROUP_SIZE, block)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_0":
        zero = np.zeros_like(d)
        codes = _halves(blocks, 2)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8.0 * d
        codes = _halves(blocks, 4)
    return codes.reshape(n, k), np.stack([d, zero], axis=-1)


def q8_rows(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float weights [n, k] -> (int8 [n, k], per-row scales [n] float32), ``w ~ q * scale``
    with ``scale = max|w| / 127`` (an all-zero row gets scale 1)."""
    amax = np.abs(weight).max(axis=1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(weight / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (values 0..15) -> uint8 [N, K/2], k=2j in the low nibble of byte j."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 [N, K/2] -> int32 [N, K]."""
    p = packed.to(torch.int32)
    return torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(p.shape[0], -1)


# --- Hugging Face layout -> runtime layout -------------------------------------------------------
def quant_base(name: str) -> tuple[str, str] | None:
    """``("<module>", suffix)`` for a quantized tensor's name, else None."""
    for suffix in (*HF_SUFFIXES, *RUNTIME_SUFFIXES):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return None


def fuse_hf(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor] | None:
    """Fuse the quantized tensors of several projections of one input (Q/K/V, gate/up) along
    the output dimension N.  ``parts``: per projection ``{suffix: tensor}``.  None when they
    are not all quantized the same way (the caller widens them instead)."""
    kinds = {tuple(sorted(p)) for p in parts}
    if len(kinds) != 1:
        return None
    keys = kinds.pop()
    if ".scales_and_zeros" in keys and ".qweight" in keys:
        return {".qweight": torch.cat([p[".qweight"] for p in parts]),
                ".scales_and_zeros": torch.cat([p[".scales_and_zeros"] for p in parts], dim=1)}
    if ".scales" in keys and ".qweight" in keys:
        return {".qweight": torch.cat([p[".qweight"] for p in parts]),
                ".scales": torch.cat([p[".scales"] for p in parts])}
    return None


def dequantize_hf(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """One projection's HF-layout quantized tensors -> float32 weight [N, K] (exactly the
    values the kernels compute with, before the activation-dtype cast of the scales)."""
    if ".scales_and_zeros" in parts:
        q = unpack_nibbles(parts[".qweight"]).float()
        sz = parts[".scales_and_zeros"].float()            # [K/32, N, 2]
        scale = sz[..., 0].t().repeat_interleave(GROUP_SIZE, dim=1)
        zero = sz[..., 1].t().repeat_interleave(GROUP_SIZE, dim=1)
        return (q - 8) * scale + zero
    return parts[".qweight"].float() * parts[".scales"].float()[:, None]


def to_runtime(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-layout quantized tensors of one (possibly fused) linear -> runtime-layout suffixes."""
    if ".scales_and_zeros" in parts:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            unpack_nibbles(parts[".qweight"]).contiguous(), 1)
        return {".weight_int4pack": packed,
                ".scales_and_zeros": parts[".scales_and_zeros"].to(dtype).contiguous()}
    return {".weight_int8": parts[".qweight"].to(torch.int8).contiguous(),
            ".scales": parts[".scales"].to(dtype).contiguous()}


def runtime_quant_shapes(n: int, k: int, kind: str) -> dict[str, tuple[int, ...]]:
    """Runtime-layout suffix -> shape of one linear [n, k] stored as ``kind`` (int4|int8)."""
    if kind == "int4":
        return {".weight_int4pack": (n, k // 2), ".scales_and_zeros": (k // GROUP_SIZE, n, 2)}
    return {".weight_int8": (n, k), ".scales": (n,)}


INT8_DENSE_MIN_ROWS = 32
"""From this many rows on, an int8 matmul widens the weight and runs a dense GEMM instead of
``_weight_int8pack_mm``, whose cost grows linearly with the rows (it reads the whole weight
once per row: SmolLM2's 49152 x 576 LM head, bfloat16, 2 threads: 0.85 ms at 1 row, 2.6 ms at
8, 14 ms at 32, 430 ms at 512; widening costs ~20 ms at any row count; bench/engine_profile.py
prints the table)."""


def _int8_rows(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, w, scales)


def _int8_dense(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w.to(x.dtype)) * scales


def int8_mm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (w [N, K] int8 * scales [N])^T -> [M, N] in x's dtype; the kernel is chosen
    by M at run time (``torch.cond``, which torch.export and AOTInductor keep as a branch, so
    one package serves decode and prefill)."""
    return torch.cond(x.shape[0] >= INT8_DENSE_MIN_ROWS, _int8_dense, _int8_rows, (x, w, scales))


# --- modules -------------------------------------------------------------------------------------
class Int4Linear(nn.Module):
    """y = x W^T with W as int4 codes in groups of GROUP_SIZE along K.  x [..., K] -> [..., N]
    in x's dtype (bfloat16 for the fast kernel)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_int4pack", torch.empty(out_features, in_features // 2,
                                                            dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.empty(
            in_features // GROUP_SIZE, out_features, 2, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight_int4pack, GROUP_SIZE,
                                                       self.scales_and_zeros)
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """y = x W^T with W int8 and one scale per output row.  x [..., K] -> [..., N]."""

    weight_int8: torch.Tensor   # [N, K] int8 (a buffer)
    scales: torch.Tensor        # [N] bfloat16 (a buffer)

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_int8", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        return int8_mm(flat, self.weight_int8, self.scales).view(*x.shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """Token embedding with int8 rows and one scale per row; doubles as the tied LM head
    (:meth:`project`).  tokens [B, S] int64 -> [B, S, H] in the scales' dtype."""

    weight_int8: torch.Tensor   # [V, H] int8 (a buffer)
    scales: torch.Tensor        # [V] bfloat16 (a buffer)

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.register_buffer("weight_int8", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(num_embeddings, dtype=torch.bfloat16))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(tokens, self.weight_int8).to(self.scales.dtype)
        return rows * F.embedding(tokens, self.scales.unsqueeze(1))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> logits [..., V] (h's dtype): the tied LM head."""
        flat = h.reshape(-1, h.shape[-1])
        return int8_mm(flat, self.weight_int8, self.scales).view(*h.shape[:-1], -1)


def adopt_quantized(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Swap each ``nn.Linear`` / ``nn.Embedding`` of ``model`` (built on the meta device) whose
    runtime-layout weights are quantized for the matching module, so that
    ``load_state_dict(weights, strict=True)`` then adopts them."""
    for name, module in list(model.named_modules()):
        if not name:
            continue
        with torch.device("meta"):
            if f"{name}.weight_int4pack" in weights and isinstance(module, nn.Linear):
                new: nn.Module = Int4Linear(module.in_features, module.out_features)
            elif f"{name}.weight_int8" in weights and isinstance(module, nn.Linear):
                new = Int8Linear(module.in_features, module.out_features)
            elif f"{name}.weight_int8" in weights and isinstance(module, nn.Embedding):
                new = Int8Embedding(module.num_embeddings, module.embedding_dim)
            else:
                continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)


def scheme_of(weights: Mapping[str, torch.Tensor]) -> str:
    """``int4`` when any runtime-layout tensor is quantized, else ``dense``."""
    return "int4" if any(quant_base(n) for n in weights) else "dense"


def dense_runtime(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runtime-layout weights with every quantized matrix replaced by its float32 values
    (``<name>.weight`` [N, K]), others cast to float32: the weights a dense reference of the
    same model computes with.  An int4 matrix is read back through the kernel itself (the
    product with the identity, in bfloat16, so each value carries bfloat16 rounding)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        q = quant_base(name)
        if q is None:
            out[name] = t.float()
            continue
        base, suffix = q
        if suffix == ".weight_int4pack":
            sz = weights[base + ".scales_and_zeros"]
            k = t.shape[1] * 2
            eye = torch.eye(k, dtype=sz.dtype)
            out[base + ".weight"] = torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, t, GROUP_SIZE, sz).float().t().contiguous()
        elif suffix == ".weight_int8":
            out[base + ".weight"] = t.float() * weights[base + ".scales"].float()[:, None]
    return out
