"""``rewarm model import-gguf``: a llama GGUF file -> the Hugging Face layout.

By default keeps the checkpoint's quantization: Q4_0/Q4_1 matrices as their 4-bit codes with
per-group scale and zero, Q8_0 as per-row int8 (agent/replica/quant.py, which says how each
maps onto torch's weight-only kernels), everything else in bfloat16, and the config says
``weight_scheme: int4, torch_dtype: bfloat16``.  With ``dtype`` (``--dtype float32|bfloat16``)
it dequantizes every tensor with the ``gguf`` package instead.  It renames llama.cpp's
tensor names to Hugging Face's, and **undoes the RoPE permutation** llama.cpp's converter
applies to the Q and K projections: ``convert_hf_to_gguf.py`` reorders each head's rows from
Hugging Face's "rotate half" layout (first half, second half) to interleaved pairs, i.e.
``w.reshape(n_head, 2, d/2, in).swapaxes(1, 2)``; the inverse is
``w.reshape(n_head, d/2, 2, in).swapaxes(1, 2)``.  (The Paris test proves the direction.)

Writes ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` and ``generation_config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from agent.errors import InvalidCheckpoint
from agent.replica import quant
from agent.replica.config import LlamaConfig
from agent.replica.model import hf_expected_shapes
from agent.replica.tokenizer import build_from_gguf, save_tokenizer
from agent.replica.shapes import check_shapes

_NAMES = {  # llama.cpp name inside block i -> Hugging Face name inside model.layers.i
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute(w, n_head)``: w [n_head * d, in] -> same shape."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise InvalidCheckpoint(f"GGUF: metadata {key!r} missing", path=None, field=key,
                                    value=None, limit=None)
        return default
    return field.contents()


def config_from_gguf(reader, dtype: str = "float32") -> LlamaConfig:
    """LlamaConfig from the ``llama.*`` metadata.  Raises InvalidCheckpoint for another arch."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise InvalidCheckpoint(f"GGUF: architecture {arch!r} is not 'llama'", path=None,
                                field="general.architecture", value=arch, limit="llama")
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, "llama.vocab_size", len(tokens)))
    if len(tokens) != vocab:
        raise InvalidCheckpoint(f"GGUF: {len(tokens)} tokens in tokenizer.ggml.tokens, "
                                f"llama.vocab_size says {vocab}", path=None,
                                field="tokenizer.ggml.tokens", value=len(tokens), limit=vocab)
    return LlamaConfig(
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=int(_field(reader, "llama.attention.head_count")),
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv")),
        vocab_size=vocab,
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        # GGUF stores these as float32: take the shortest decimal that rounds to it (1e-05,
        # not 9.9999997e-06), which is what the original config.json said.
        rms_norm_eps=float(str(np.float32(_field(reader, "llama.attention.layer_norm_rms_epsilon")))),
        rope_theta=float(str(np.float32(_field(reader, "llama.rope.freq_base", 10000.0)))),
        tie_word_embeddings="output.weight" not in names,
        dtype=dtype,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        eos_token_id=int(_field(reader, "tokenizer.ggml.eos_token_id", -1)),
    )


def gguf_tensors(reader, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Tensors under Hugging Face names, Q/K un-permuted: dequantized to ``config.dtype`` for
    a dense config, kept quantized where the GGUF is (agent/replica/quant.py) for ``int4``."""
    from gguf import quants

    from agent.progress import bar

    out: dict[str, torch.Tensor] = {}
    with bar(len(reader.tensors), "import-gguf: dequantize", unit="tensor") as shown:
        for t in reader.tensors:
            _gguf_tensor(t, config, out, quants)
            shown.update(1)
    check_shapes(out, hf_expected_shapes(config, out), where="GGUF")
    return out


def _gguf_tensor(t, config: LlamaConfig, out: dict[str, torch.Tensor], quants) -> None:
    """One GGUF tensor ``t`` into ``out`` under its Hugging Face name (see :func:`gguf_tensors`)."""
    kind = t.tensor_type.name
    if t.name == "token_embd.weight":
        name = "model.embed_tokens.weight"
    elif t.name == "output_norm.weight":
        name = "model.norm.weight"
    elif t.name == "output.weight":
        name = "lm_head.weight"
    elif t.name.startswith("blk."):
        _, idx, rest = t.name.split(".", 2)
        if rest not in _NAMES:
            raise InvalidCheckpoint(f"GGUF: unknown tensor {t.name!r}", path=None,
                                    field=t.name, value=None, limit=sorted(_NAMES))
        name = f"model.layers.{int(idx)}.{_NAMES[rest]}"
    else:
        return  # e.g. rope_freqs: derived from rope_theta here
    heads = {"attn_q.weight": config.num_attention_heads,
             "attn_k.weight": config.num_key_value_heads}.get(t.name.split(".", 2)[-1])
    fix = (lambda a: unpermute_rope(a, heads)) if heads else (lambda a: a)  # noqa: E731
    base = name.removesuffix(".weight")
    if config.weight_scheme == "int4" and kind in quant.INT4_KINDS:
        n, k = int(t.shape[1]), int(t.shape[0])          # GGUF lists dims innermost first
        codes, sz = quant.q4_blocks(np.asarray(t.data).reshape(n, -1), kind, n, k)
        codes, sz = fix(codes), fix(sz)                  # a row permutation: codes and groups alike
        out[base + ".qweight"] = quant.pack_nibbles(torch.from_numpy(np.ascontiguousarray(codes)))
        out[base + ".scales_and_zeros"] = torch.from_numpy(
            np.ascontiguousarray(sz.transpose(1, 0, 2)))  # [K/32, N, 2]
        return
    w = fix(np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    if config.weight_scheme == "int4" and kind == "Q8_0" and w.ndim == 2:
        q8, scale = quant.q8_rows(w)
        out[base + ".qweight"] = torch.from_numpy(np.ascontiguousarray(q8))
        out[base + ".scales"] = torch.from_numpy(scale)
        return
    out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C")).to(config.torch_dtype)


GGUF_MAGIC = b"GGUF"


def open_gguf(path: Path):
    """A ``gguf.GGUFReader`` over ``path``.  Raises InvalidCheckpoint naming the path when it
    is not a file, when its first four bytes are not ``GGUF`` (naming the bytes found), and
    when the reader refuses it (unsupported version, truncated header...)."""
    from gguf import GGUFReader

    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise InvalidCheckpoint(f"{path}: {what}; expected a GGUF file", path=path,
                                field="path", value=what, limit="a GGUF file")
    with path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise InvalidCheckpoint(f"{path}: not a GGUF file: magic {magic!r}, expected "
                                f"{GGUF_MAGIC!r}", path=path, field="magic", value=magic,
                                limit=GGUF_MAGIC)
    try:
        return GGUFReader(str(path))
    except (ValueError, IndexError, OverflowError) as exc:
        raise InvalidCheckpoint(f"{path}: unreadable GGUF: {exc}", path=path, field="header",
                                value=str(exc), limit="a GGUF file gguf can read") from exc


def import_gguf(path: Path | str, out_dir: Path | str, *, dtype: str | None = None) -> Path:
    """Convert GGUF ``path`` into a Hugging Face directory ``out_dir`` (written atomically).

    ``dtype`` None keeps the GGUF's quantization: a file with Q4_0/Q4_1 matrices becomes
    ``weight_scheme`` int4 with bfloat16 activations, one without stays dense float32;
    ``"float32"`` / ``"bfloat16"`` dequantizes every matrix to that dtype.

    Returns ``out_dir``.  Raises InvalidCheckpoint for a missing path, a file that is not
    GGUF (naming the magic found), and a non-llama or malformed file.
    """
    path, out_dir = Path(path), Path(out_dir)
    reader = open_gguf(path)
    config = config_from_gguf(reader, dtype or "float32")
    if dtype is None and any(t.tensor_type.name in quant.INT4_KINDS for t in reader.tensors):
        config = dataclasses.replace(config, dtype="bfloat16", weight_scheme="int4")
    tensors = gguf_tensors(reader, config)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    config.write(tmp)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    tok = build_from_gguf(tokens, list(_field(reader, "tokenizer.ggml.merges")), types)
    bos, eos = config.bos_token_id, config.eos_token_id
    template = reader.fields.get("tokenizer.chat_template")
    save_tokenizer(tok, tmp, bos=tokens[bos] if bos and 0 < bos < len(tokens) else None,
                   eos=tokens[eos] if eos and 0 < eos < len(tokens) else None,
                   chat_template=template.contents() if template is not None else None)
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos}) + "\n")
    (tmp / "SOURCE").write_text(f"imported from {path.name} ({path.stat().st_size} bytes)\n")
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
