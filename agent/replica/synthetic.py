"""``rewarm model make-synthetic``: deterministic seeded weights in the Hugging Face layout.

For tests and size sweeps, where the real model is too small or too slow.  ``13b-shaped`` is
a 13B model's geometry (docs/architecture.md, "Sizing": 40 layers, 8 KV heads, head dim 128,
KV 160 KB per token in 16-bit) with hidden size, MLP width and vocabulary scaled down by
``scale`` so that it fits a development machine; ``scale=1`` is the full 40 x 5120 shape
(Llama-2-13B's, with the document's 8 KV heads: 11.3 B parameters, 22.7 GB in bf16).

``llama3-8b-shaped`` is Llama-3-8B's geometry (hidden 4096, 32 layers, 32 query heads and 8
KV heads of 128, MLP 14336, vocabulary 128256, untied head, RoPE theta 500000, bfloat16:
8,030,261,248 parameters, 16.06 GB), for the GPU device check's serving path at that size.

Weights come from ``torch.Generator(seed)``: embeddings N(0, 1), matrices N(0, 1/fan_in) (so
activations keep unit scale and logits are peaked enough that sampling depends on the weights,
which the golden-check tests need), norms are ones.  The same seed gives the same bytes.
:func:`write_safetensors` streams them to one file a tensor at a time (the largest tensor is
all it holds in memory, where ``save_file`` holds every tensor and its bytes), generated on
any device: on a GPU the 8B shape is written at the disk's speed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from agent.errors import ConfigError
from agent.replica.config import LlamaConfig
from agent.replica.model import hf_expected_shapes

PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                 tie_word_embeddings=True, rope_theta=10000.0),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4096, max_position_embeddings=1024,
                  tie_word_embeddings=False, rope_theta=10000.0),
    # 13B: 40 layers, 40 query heads and 8 KV heads of 128, hidden 5120, MLP 13824, vocab 32000.
    "13b-shaped": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                       vocab_size=32000, max_position_embeddings=4096,
                       tie_word_embeddings=False, rope_theta=10000.0, dtype="bfloat16"),
    # Llama-3-8B: 32 layers, 32 query heads and 8 KV heads of 128, hidden 4096, MLP 14336,
    # vocab 128256 (its config.json on the Hugging Face hub, meta-llama/Meta-Llama-3-8B).
    "llama3-8b-shaped": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             vocab_size=128256, max_position_embeddings=8192,
                             tie_word_embeddings=False, rope_theta=500000.0, dtype="bfloat16",
                             bos_token_id=128000, eos_token_id=128001),
}


def preset_config(preset: str, scale: int = 1, dtype: str | None = None) -> LlamaConfig:
    """The config of ``preset``; ``scale`` divides hidden size, MLP width, query heads and vocab
    (13b-shaped only: layers, KV heads and head dim stay).  Raises ConfigError for an unknown
    preset or a scale that does not divide the shape."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; one of {sorted(PRESETS)}", name="preset",
                          value=preset, limit=sorted(PRESETS))
    fields = dict(PRESETS[preset])
    if scale != 1:
        heads = fields["num_attention_heads"] // scale
        if preset != "13b-shaped" or scale < 1 or heads < fields["num_key_value_heads"] \
                or heads % fields["num_key_value_heads"]:
            raise ConfigError(f"scale={scale} does not fit preset {preset!r}: only 13b-shaped "
                              f"scales, and its query heads must stay a multiple of its 8 KV "
                              f"heads (scale 1 or 5)", name="scale", value=scale,
                              limit=fields["num_attention_heads"] // fields["num_key_value_heads"])
        fields.update(num_attention_heads=heads, hidden_size=heads * fields["head_dim"],
                      intermediate_size=fields["intermediate_size"] // scale,
                      vocab_size=fields["vocab_size"] // scale)
    if dtype is not None:
        fields["dtype"] = dtype
    return LlamaConfig(**fields)


def synthetic_tensors(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors for ``config``: embeddings N(0, 1), other matrices
    N(0, 1/fan_in), norms ones."""
    return dict(iter_synthetic(config, seed))


def iter_synthetic(config: LlamaConfig, seed: int = 0,
                   device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of :func:`synthetic_tensors` in name order, each made on ``device``
    when it is reached (a generator on ``device``: on the CPU the very values of
    :func:`synthetic_tensors`, on a GPU that device's random stream)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in sorted(hf_expected_shapes(config).items()):
        if len(shape) == 1:
            yield name, torch.ones(shape, dtype=config.torch_dtype, device=device)
        else:
            std = 1.0 if name == "model.embed_tokens.weight" else shape[1] ** -0.5
            yield name, (torch.randn(shape, generator=gen, device=device) * std).to(
                config.torch_dtype)


_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_safetensors(path: Path, config: LlamaConfig, seed: int = 0, *,
                      device: str = "cpu") -> int:
    """Write :func:`iter_synthetic`'s tensors to ``path`` in the safetensors format (an
    8-byte little-endian header length, the JSON header padded with spaces to a multiple of
    8, then every tensor's bytes back to back in the header's order: huggingface/safetensors
    docs, "Format"), one tensor in memory at a time.  Returns the file's size in bytes."""
    import json
    import struct

    shapes = sorted(hf_expected_shapes(config).items())
    itemsize = torch.empty((), dtype=config.torch_dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        nbytes = itemsize
        for n in shape:
            nbytes *= n
        header[name] = {"dtype": _ST_DTYPE[config.torch_dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, tensor in iter_synthetic(config, seed, device):
            f.write(tensor.contiguous().view(torch.uint8).cpu().numpy().data)
        size = f.tell()
    return size


def make_synthetic(out_dir: Path | str, preset: str = "tiny", *, seed: int = 0, scale: int = 1,
                   dtype: str | None = None, device: str | None = None) -> Path:
    """Write config.json and model.safetensors for ``preset`` into ``out_dir`` (atomically).
    ``device``: generate there and stream the file (:func:`write_safetensors`; for shapes
    too large to hold twice in host memory), else ``safetensors.torch.save_file``."""
    config = preset_config(preset, scale, dtype)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    config.write(tmp)
    if device is not None:
        write_safetensors(tmp / "model.safetensors", config, seed, device=device)
    else:
        # One metadata key only: safetensors writes the metadata map in hash order, so several
        # keys would make the bytes (and the source digest) differ run to run.
        save_file(synthetic_tensors(config, seed), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
    (tmp / "SOURCE").write_text(f"synthetic preset={preset} seed={seed} scale={scale}\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
