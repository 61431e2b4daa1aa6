"""A Llama-family decoder whose forward is a pure function of its inputs and the KV cache.

The KV cache is an *input*, not module state: a compiled (AOT) model cannot keep state, so
the conversation's memory has to be passed in.  Signature::

    forward(tokens, input_pos, cache_batch_idx, k_caches, v_caches, logit_pos) -> logits

    tokens           [B, S]  int64   token ids of B active sequences, S new tokens each
    input_pos        [B, S]  int64   absolute position of each token in its sequence
    cache_batch_idx  [B]     int64   the cache slot (row of every cache tensor) of each sequence
    k_caches         list of num_hidden_layers tensors [C, T, Hkv, D] in ``config.dtype``
    v_caches         same shapes as k_caches
    logit_pos        [B, K]  int64   the positions within this call (indices into S, each in
                                     [0, S)) whose logits are wanted, per row
    logits           [B, K, vocab_size] float32: ``logits[b, k]`` is the next-token logits after
                                     ``tokens[b, logit_pos[b, k]]``

Four sizes vary independently: B (active batch), C (cache batch, the number of slots), S
(new tokens) and K (logit positions).  T (``max_seq_len``), Hkv and D are fixed per engine.

**Logits only where they are read**: the hidden states of the ``logit_pos`` positions are
gathered after the last layer, and only they go through the final norm and the LM head
(:meth:`Transformer.head`).  Serving samples one position per row (K = 1: a prefill call's
last prompt token of each row, a decode step's only token; :func:`last_positions`); the
golden check's teacher-forced replay reads every position (K = S: :func:`every_position`).
The LM head is the largest matmul of a small model (SmolLM2-135M: vocabulary 49,152 x hidden
576 = 28.3 M weights against 30 layers of 3.5 M, 21 % of the multiply-adds per token; at 64
rows its int8 kernel took 37 ms beside 45 ms for the 30 layers' int4 matmuls on two cores,
bench/results/engine_profile.json ``kernels``), and at K = 1 a prefill call of S tokens pays
it once per row instead of S times.  At K = S (``logit_pos`` every position in order) the
gathered states are the whole [B, S, hidden], so the norm and the LM head run on the same
values in the same shape as without the gather (in eager, the same bits:
tests/replica/test_model.py).

**The cache is written in place**: each layer writes its new K and V rows with
``index_put_`` at ``[cache_batch_idx[b], input_pos[b, s]]``, i.e. the forward mutates its
``k_caches`` / ``v_caches`` inputs (torch.export records input mutation; AOTInductor performs
it on the caller's tensors).  Attention then reads, for all B sequences together, the live
context only: positions ``[0, L)`` of each active slot with ``L = max(input_pos) + 1`` (the
longest sequence's context, rounded up to a block of 16: :func:`live_context`), and masks key positions
``t > input_pos[b, s]`` (causal, and hides whatever a previous occupant of the slot left
behind, since a sequence always writes positions 0..p in order).  Reading ``[0, T)`` instead
would cost every decode step the whole slot whatever the context (at T=512 and B=8 the gather
and the two attention matmuls were half of an eager step's kernel time, bench/engine_profile.py).
``L`` is a data-dependent size (unbacked under torch.export, bounded by ``[1, T]``); no Python
branch depends on data, so the control flow is fixed for every (B, C, S, K).

Runtime layout (the tensors a snapshot stores; ``load_hf_weights`` and the load hook produce it):
Q/K/V fused into ``attention.wqkv`` [n_q + 2 n_kv, hidden] and gate/up fused into
``feed_forward.w13`` [2 * intermediate, hidden], as gpt-fast does, so each layer runs two
matmuls instead of five.  Tied embeddings keep one tensor (``tok_embeddings.weight``).  A
quantized checkpoint (``config.weight_scheme == "int4"``) stores each matrix as weight-only
int4 or int8 codes instead (``<name>.weight_int4pack`` + ``.scales_and_zeros``, or
``.weight_int8`` + ``.scales``); :meth:`Transformer.from_weights` swaps in the modules of
agent/replica/quant.py for them, and activations and KV cache are ``config.dtype``.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from agent.replica.config import LlamaConfig
from agent.replica.shapes import check_shapes

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Hugging Face name (inside a layer) -> runtime name, for the tensors that are not fused.
_HF_RENAME = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
_HF_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_HF_W13 = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_HF_QKV_BASE = tuple(k.removesuffix(".weight") for k in _HF_QKV)
_HF_W13_BASE = tuple(k.removesuffix(".weight") for k in _HF_W13)


def _linears(config: LlamaConfig) -> dict[str, tuple[tuple[str, ...], int, int]]:
    """Runtime linear name (in a layer) -> (its Hugging Face parts, N, K)."""
    h, i = config.hidden_size, config.intermediate_size
    return {"attention.wqkv": (_HF_QKV_BASE, config.n_q + 2 * config.n_kv, h),
            "attention.wo": (("self_attn.o_proj",), h, config.n_q),
            "feed_forward.w13": (_HF_W13_BASE, 2 * i, h),
            "feed_forward.w2": (("mlp.down_proj",), h, i)}


def _matrix_shapes(base: str, n: int, k: int, names, hf: bool) -> dict[str, tuple[int, ...]]:
    """Shapes of one weight matrix [n, k] under ``base``: dense ``.weight`` unless ``names``
    holds its quantized form (HF layout: ``.qweight`` + ``.scales_and_zeros`` | ``.scales``;
    runtime: ``.weight_int4pack`` + ``.scales_and_zeros`` | ``.weight_int8`` + ``.scales``)."""
    from agent.replica import quant

    if hf and base + ".qweight" in names:
        if base + ".scales_and_zeros" in names:
            return {base + ".qweight": (n, k // 2),
                    base + ".scales_and_zeros": (k // quant.GROUP_SIZE, n, 2)}
        return {base + ".qweight": (n, k), base + ".scales": (n,)}
    if not hf and base + ".weight_int4pack" in names:
        return {base + s: v for s, v in quant.runtime_quant_shapes(n, k, "int4").items()}
    if not hf and base + ".weight_int8" in names:
        return {base + s: v for s, v in quant.runtime_quant_shapes(n, k, "int8").items()}
    return {base + ".weight": (n, k)}


def hf_expected_shapes(config: LlamaConfig, names=()) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face Llama checkpoint of this config must hold, with its shape.
    ``names``: the tensor names present, which say which matrices are stored quantized
    (agent/replica/quant.py); by default every matrix is dense."""
    h, i = config.hidden_size, config.intermediate_size
    names = set(names)
    shapes = _matrix_shapes("model.embed_tokens", config.vocab_size, h, names, True)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes.update(_matrix_shapes("lm_head", config.vocab_size, h, names, True))
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        for base, rows, cols in (("self_attn.q_proj", config.n_q, h), ("self_attn.k_proj", config.n_kv, h),
                                 ("self_attn.v_proj", config.n_kv, h), ("self_attn.o_proj", h, config.n_q),
                                 ("mlp.gate_proj", i, h), ("mlp.up_proj", i, h), ("mlp.down_proj", h, i)):
            shapes.update(_matrix_shapes(p + base, rows, cols, names, True))
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return shapes


def _fuse(parts: dict[str, torch.Tensor], bases: tuple[str, ...],
          cast) -> dict[str, torch.Tensor] | None:
    """Fuse the projections ``bases`` of one layer (popped from ``parts``) along N into runtime
    suffixes; quantized ones stay quantized when all are the same kind, else all are widened
    to dense.  None when a part is missing (a partial dict)."""
    from agent.replica import quant

    dense = [b + ".weight" for b in bases]
    if all(k in parts for k in dense):
        return {".weight": cast(torch.cat([parts.pop(k) for k in dense]))}
    quantized = []
    for b in bases:
        got = {s: parts[b + s] for s in quant.HF_SUFFIXES if b + s in parts}
        if not got and b + ".weight" not in parts:
            return None
        quantized.append(got)
    fused = quant.fuse_hf(quantized) if all(quantized) else None
    for b in bases:
        for s in (*quant.HF_SUFFIXES, ".weight"):
            parts.pop(b + s, None)
    if fused is None:   # mixed kinds: widen every part to dense
        return {".weight": cast(torch.cat([quant.dequantize_hf(q) if q else parts[b + ".weight"]
                                           for b, q in zip(bases, quantized, strict=True)]))}
    return fused


def hf_to_runtime(hf: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Rename and fuse a (possibly partial) Hugging Face state dict into the runtime layout.

    Works on any subset that holds whole layers (the streaming loader calls it per layer).
    Floating tensors are cast to ``dtype`` when given; quantized ones (agent/replica/quant.py)
    keep their codes, are fused along N and repacked for the CPU kernels, their scales cast to
    ``dtype``.  Shapes are checked by :func:`check_shapes`.
    """
    from agent.replica import quant

    out: dict[str, torch.Tensor] = {}
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    act = dtype if dtype is not None else torch.float32
    layers: dict[int, dict[str, torch.Tensor]] = {}
    top: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in hf.items():
        q = quant.quant_base(name)
        if name == "model.embed_tokens.weight":
            out["tok_embeddings.weight"] = cast(tensor)
        elif name == "model.norm.weight":
            out["norm.weight"] = cast(tensor)
        elif name == "lm_head.weight":
            out["output.weight"] = cast(tensor)
        elif (m := _HF_LAYER.match(name)) is not None:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = tensor
        elif q is not None and q[0] in ("model.embed_tokens", "lm_head"):
            top.setdefault(q[0], {})[q[1]] = tensor
        else:
            out[name] = cast(tensor)  # already runtime-named; the module will reject strays
    for base, parts in top.items():
        new = "tok_embeddings" if base == "model.embed_tokens" else "output"
        if ".scales_and_zeros" in parts:   # no int4 embedding kernel: int8 rows instead
            w = quant.dequantize_hf(parts).numpy()
            q8, scale = quant.q8_rows(w)
            parts = {".qweight": torch.from_numpy(q8), ".scales": torch.from_numpy(scale)}
        out.update({new + s: t for s, t in quant.to_runtime(parts, act).items()})
    for i, parts in sorted(layers.items()):
        p = f"layers.{i}."
        for runtime, bases in (("attention.wqkv", _HF_QKV_BASE), ("feed_forward.w13", _HF_W13_BASE)):
            fused = _fuse(parts, bases, cast)
            if fused is None:
                continue
            if ".weight" in fused:
                out[p + runtime + ".weight"] = fused[".weight"]
            else:
                out.update({p + runtime + s: t for s, t in quant.to_runtime(fused, act).items()})
        single: dict[str, dict[str, torch.Tensor]] = {}
        for k, tensor in parts.items():
            q = quant.quant_base(k)
            if q is not None:
                single.setdefault(q[0], {})[q[1]] = tensor
            else:
                out[p + _HF_RENAME.get(k, k)] = cast(tensor)
        for base, qparts in single.items():
            new = _HF_RENAME[base + ".weight"].removesuffix(".weight")
            out.update({p + new + s: t for s, t in quant.to_runtime(qparts, act).items()})
    return out


def runtime_shapes(config: LlamaConfig, names=()) -> dict[str, tuple[int, ...]]:
    """Every runtime-layout tensor name with its shape; ``names`` (the tensors present) say
    which matrices are quantized (see :func:`hf_expected_shapes`)."""
    h = config.hidden_size
    names = set(names)
    shapes = _matrix_shapes("tok_embeddings", config.vocab_size, h, names, False)
    shapes["norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes.update(_matrix_shapes("output", config.vocab_size, h, names, False))
    for n in range(config.num_hidden_layers):
        p = f"layers.{n}."
        shapes.update({p + "attention_norm.weight": (h,), p + "ffn_norm.weight": (h,)})
        for base, (_, rows, cols) in _linears(config).items():
            shapes.update(_matrix_shapes(p + base, rows, cols, names, False))
    return shapes


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, Hugging Face "rotate half" convention.  x [B, S, H, D], cos/sin [B, S, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


CONTEXT_BLOCK = 16
"""Attention reads the cache in blocks of this many positions (see :func:`live_context`)."""


def live_context(input_pos: torch.Tensor, max_seq_len: int):
    """L: the cache positions attention reads in this call, ``max(input_pos) + 1`` rounded up
    to a multiple of :data:`CONTEXT_BLOCK` (``input_pos`` [B, S] int64); the whole slot
    ``max_seq_len`` when that is not a multiple of the block (or no more than one).

    Rounding to blocks keeps L a multiple of 16, so a compiler never has to ask whether the
    size is 1 (AOTInductor's lowering of the attention matmuls refuses an unbacked size that
    might be), and it costs at most 15 masked positions.  Under torch.export the block count is
    an unbacked size declared to lie in [1, max_seq_len / 16] (``torch._check``); positions are
    checked against ``max_seq_len`` before a call (agent/replica/aot_inputs.py, the engine's
    slot reservation).  Returns an int (a SymInt under export)."""
    if max_seq_len % CONTEXT_BLOCK or max_seq_len <= CONTEXT_BLOCK:
        return max_seq_len
    blocks = (input_pos.max() // CONTEXT_BLOCK + 1).item()
    torch._check(blocks >= 1)
    torch._check(blocks <= max_seq_len // CONTEXT_BLOCK)
    return blocks * CONTEXT_BLOCK


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads (GQA), softmax in float32.

    q [B, S, H, D]; keys/values [B, T, Hkv, D] (H a multiple of Hkv; query head h reads KV head
    h // (H / Hkv), the ``repeat_interleave`` convention of Hugging Face Llama); mask
    [B, 1, S, T] bool (True: visible; T here is the live context L of the forward).  Returns
    [B, S, H * D] in q's dtype.

    Written with bmm rather than ``F.scaled_dot_product_attention``, and every transpose
    materialised with ``clone(memory_format=torch.contiguous_format)`` before it is viewed:
    Inductor's SDPA layout constraint and views of strided tensors compare sizes symbolically,
    which guards B != 1 and S != 1 and makes an AOT package refuse the engine's own B=1 prefill
    and S=1 decode (agent/replica/aot.py).  The query heads of one KV head are stacked along
    the rows ([B, Hkv, rep * S, D]), so no key or value is repeated.
    """
    bsz, seqlen, n_heads, head_dim = q.shape
    n_kv, t = keys.shape[2], keys.shape[1]
    rep = n_heads // n_kv
    dense = torch.contiguous_format
    qg = q.permute(0, 2, 1, 3).clone(memory_format=dense).view(bsz * n_kv, rep * seqlen, head_dim)
    kg = keys.permute(0, 2, 1, 3).clone(memory_format=dense).view(bsz * n_kv, t, head_dim)
    vg = values.permute(0, 2, 1, 3).clone(memory_format=dense).view(bsz * n_kv, t, head_dim)
    scores = torch.bmm(qg, kg.transpose(1, 2)).float() * (head_dim ** -0.5)  # [B*Hkv, rep*S, T]
    scores = scores.view(bsz, n_kv, rep, seqlen, t).masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(bsz * n_kv, rep * seqlen, t)
    out = torch.bmm(probs, vg).view(bsz, n_heads, seqlen, head_dim)          # [B, H, S, D]
    return out.permute(0, 2, 1, 3).clone(memory_format=dense).view(bsz, seqlen, n_heads * head_dim)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.n_q, self.n_kv = config.n_q, config.n_kv
        self.wqkv = nn.Linear(config.hidden_size, self.n_q + 2 * self.n_kv, bias=False)
        self.wo = nn.Linear(self.n_q, config.hidden_size, bias=False)

    def forward(self, x, cos, sin, input_pos, cache_batch_idx, k_cache, v_cache, mask):
        # x [B, S, hidden]; k_cache/v_cache [C, T, Hkv, D]; mask [B, 1, S, L] bool, L <= T
        bsz, seqlen = x.shape[0], x.shape[1]
        # View the fused projection as heads first, then split: a view of a contiguous tensor
        # needs no stride reasoning, where viewing a split (a strided slice) makes Inductor
        # guard each dynamic size != 1 (see attend).
        qkv = self.wqkv(x).view(bsz, seqlen, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)                        # [B, S, H|Hkv, D]
        # Write the new rows into the caller's cache: slot cache_batch_idx[b], position input_pos[b, s].
        slot = cache_batch_idx.unsqueeze(1).expand(bsz, seqlen)           # [B, S]
        k_cache.index_put_((slot, input_pos), k.to(k_cache.dtype))
        v_cache.index_put_((slot, input_pos), v.to(v_cache.dtype))
        live = mask.shape[-1]                                              # L <= T
        keys = k_cache[:, :live].index_select(0, cache_batch_idx)          # [B, L, Hkv, D]
        values = v_cache[:, :live].index_select(0, cache_batch_idx)
        return self.wo(attend(q, keys.to(q.dtype), values.to(q.dtype), mask))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.w13 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.intermediate, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, h, cos, sin, input_pos, cache_batch_idx, k_cache, v_cache, mask):
        h = h + self.attention(self.attention_norm(h), cos, sin, input_pos, cache_batch_idx,
                               k_cache, v_cache, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder.  Parameters only; no buffers, no KV cache (see the module docstring).

    ``load_state_dict`` also accepts the Hugging Face layout: the load pre-hook renames and
    fuses it (as gpt-fast does in its load hook), so both layouts load the same module.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False)
        self._register_load_state_dict_pre_hook(self._load_hook)

    @staticmethod
    def _load_hook(state_dict, prefix, *args) -> None:
        if prefix or not any(k.startswith("model.") or k == "lm_head.weight" for k in state_dict):
            return
        converted = hf_to_runtime(dict(state_dict))
        state_dict.clear()
        state_dict.update(converted)

    @classmethod
    def from_weights(cls, config: LlamaConfig, weights: dict[str, torch.Tensor]) -> Transformer:
        """Build on the meta device and adopt ``weights`` without copying (``assign=True``).

        ``weights`` is the runtime layout (or Hugging Face layout).  Raises InvalidCheckpoint
        naming the tensor and both shapes when one does not match ``config``.
        """
        from agent.replica.quant import adopt_quantized

        with torch.device("meta"):
            model = cls(config)
        if any(k.startswith("model.") for k in weights):
            quantized = any(k.endswith(".qweight") for k in weights)
            weights = hf_to_runtime(weights, config.torch_dtype if quantized else None)
        check_shapes(weights, runtime_shapes(config, weights), where="runtime weights")
        adopt_quantized(model, weights)
        model.load_state_dict(weights, assign=True, strict=True)
        return model.eval().requires_grad_(False)

    def rope_cos_sin(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, S, 1, D] float32 for positions ``input_pos`` [B, S] (theta from config).

        Computed in float64 and rounded to float32: the compiled package's vectorised float32
        ``cos``/``sin`` differ from ATen's by one ulp in more than half of the values (measured
        over positions 0..511 of SmolLM2's head_dim 64), which after bfloat16 rounding flipped
        prefill logits by up to 0.8 between the package and its eager forward; two float64
        results 1 ulp apart round to the same float32 except in rare ties."""
        d = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (
            torch.arange(0, d, 2, dtype=torch.float64, device=input_pos.device) / d))
        angles = input_pos.unsqueeze(-1).double() * inv_freq               # [B, S, D/2]
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(2)          # [B, S, 1, D]
        return angles.cos().float(), angles.sin().float()

    @staticmethod
    def causal_mask(input_pos: torch.Tensor, context_len: int) -> torch.Tensor:
        """[B, 1, S, L] bool (L = ``context_len``): key position t is visible to the query at
        p iff t <= p."""
        t = torch.arange(context_len, device=input_pos.device)
        return (t.view(1, 1, 1, -1) <= input_pos.unsqueeze(1).unsqueeze(-1))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: h [B, K, hidden] -> logits [B, K, V] float32."""
        from agent.replica.quant import Int8Embedding

        h = self.norm(h)
        if self.output is not None:
            return self.output(h).float()
        if isinstance(self.tok_embeddings, Int8Embedding):
            return self.tok_embeddings.project(h).float()
        return F.linear(h, self.tok_embeddings.weight).float()

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, cache_batch_idx: torch.Tensor,
                k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                logit_pos: torch.Tensor) -> torch.Tensor:
        """See the module docstring for shapes: logits [B, K, V] float32 at ``logit_pos``
        [B, K].  Mutates ``k_caches``/``v_caches`` in place.  Eager raises RuntimeError for a
        ``logit_pos`` outside [0, S) (``torch.gather``'s bounds check); a compiled package
        relies on its caller's check (agent/replica/aot_inputs.py)."""
        cos, sin = self.rope_cos_sin(input_pos)
        mask = self.causal_mask(input_pos, live_context(input_pos, k_caches[0].shape[1]))
        h = self.embed(tokens)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches, strict=True):
            h = layer(h, cos, sin, input_pos, cache_batch_idx, k_cache, v_cache, mask)
        # [B, S, hidden] -> [B, K, hidden]: the states whose logits are read
        picked = h.gather(1, logit_pos.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        return self.head(picked)


def every_position(batch: int, seq: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``logit_pos`` [batch, seq] int64 (contiguous) asking for the logits of every position
    of a call: ``[[0, 1, ..., seq - 1]] * batch`` (the teacher-forced replay, the drift
    measurement)."""
    return torch.arange(seq, dtype=torch.int64, device=device).repeat(batch, 1)


def last_positions(lengths: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``logit_pos`` [len(lengths), 1] int64 asking, per row, for the logits after its last
    real token: position ``lengths[i] - 1`` of row ``i`` (a prefill call's rows are padded past
    their chunk; a decode step's rows are one token, ``lengths`` all 1)."""
    return torch.tensor([[n - 1] for n in lengths], dtype=torch.int64, device=device)


def new_kv_caches(config: LlamaConfig, max_seqs: int, max_seq_len: int,
                  device: torch.device | str = "cpu") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed caches: two lists of ``num_hidden_layers`` tensors [max_seqs, max_seq_len, Hkv, D].

    On the CPU all of them are views of one anonymous private map (:func:`zero_pages`): zero
    without a write, each 4 KiB page backed by memory only when a token's keys or values are
    first written there, so an idle replica holds none of its KV cache (SmolLM2-135M, 8 slots of
    512 tokens in bfloat16: 94 MB that ``torch.zeros`` made resident in every replica and
    zygote).  Reading positions never written (the live context rounds up to 16 tokens) reads
    the kernel's zero page.  On a GPU, ``torch.zeros``."""
    shape = (max_seqs, max_seq_len, config.num_key_value_heads, config.head_dim)
    n = 2 * config.num_hidden_layers
    if torch.device(device).type != "cpu":
        caches = [torch.zeros(shape, dtype=config.torch_dtype, device=device) for _ in range(n)]
    else:
        caches = list(zero_pages((n, *shape), config.torch_dtype).unbind(0))
    return caches[:n // 2], caches[n // 2:]


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of ``shape`` and ``dtype`` over a fresh anonymous private map
    (mmap(2) guarantees it reads as zeros), backed page by page as it is written, with
    transparent huge pages off for it (MADV_NOHUGEPAGE: under THP "always" a 2 MiB page would be
    backed for each token written).  The tensor keeps the map alive."""
    import mmap

    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        memory.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype, count=math.prod(shape)).view(shape)
