"""The shape of a Llama-family model, read from a Hugging Face ``config.json``.

Only the fields the runtime needs are kept; every one is range-checked so that a bad file is an
:class:`~agent.errors.InvalidCheckpoint` naming the field, the value and the limit, never an
allocation of absurd size later.  Field names are Hugging Face's (``transformers.LlamaConfig``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from agent.errors import InvalidCheckpoint

CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 1 << 20
"""A config.json larger than this is refused before it is read (real ones are ~1 KiB)."""

# Upper bounds accepted from a file.  Generous (Llama-3-405B is 126 layers, hidden 16384,
# vocab 128256, context 131072) but finite, so a corrupt value cannot ask for petabytes.
_LIMITS = {
    "hidden_size": 65536,
    "intermediate_size": 262144,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "vocab_size": 1 << 20,
    "max_position_embeddings": 1 << 22,
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


WEIGHT_SCHEMES = ("dense", "int4")
"""How a checkpoint's matrices are stored (agent/replica/quant.py)."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU).

    ``head_dim`` defaults to ``hidden_size // num_attention_heads``.  ``dtype`` is the runtime
    dtype of activations, KV cache and dense weights (``float32`` on CPU; ``bfloat16`` for a
    quantized checkpoint and for large synthetic shapes).  ``weight_scheme`` is how the
    matrices are stored (one of ``WEIGHT_SCHEMES``, see agent/replica/quant.py): ``dense``, or
    ``int4`` (weight-only int4/int8 codes as the checkpoint ships them).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    head_dim: int = 0
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    weight_scheme: str = "dense"

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self.validate()

    # --- derived sizes ---------------------------------------------------------------
    @property
    def n_q(self) -> int:
        """Rows of the Q projection: ``num_attention_heads * head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def n_kv(self) -> int:
        """Rows of each of the K and V projections: ``num_key_value_heads * head_dim``."""
        return self.num_key_value_heads * self.head_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token: ``2 * layers * kv_heads * head_dim * dtype_bytes``.

        The formula is docs/architecture.md's ("Sizing":
        2 * 40 * 8 * 128 * 2 = 163,840 bytes for a 13B model in FP16).
        """
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize

    def param_count(self) -> int:
        """Number of parameters (embedding counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * (self.n_q + 2 * self.n_kv) + self.n_q * h + 3 * h * i + 2 * h
        out = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * per_layer + h + out

    # --- validation and (de)serialisation ----------------------------------------------
    def validate(self, path: Path | str | None = None) -> None:
        """Raise :class:`InvalidCheckpoint` naming the first field out of range."""
        for name, limit in _LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise InvalidCheckpoint(
                    f"{path or 'config'}: {name}={value!r} must be an integer in [1, {limit}]",
                    path=path, field=name, value=value, limit=limit)
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidCheckpoint(
                f"{path or 'config'}: num_attention_heads={self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads={self.num_key_value_heads}",
                path=path, field="num_key_value_heads", value=self.num_key_value_heads,
                limit=self.num_attention_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise InvalidCheckpoint(
                f"{path or 'config'}: head_dim={self.head_dim} must be even and >= 2 (RoPE rotates pairs)",
                path=path, field="head_dim", value=self.head_dim, limit=2)
        if self.dtype not in DTYPES:
            raise InvalidCheckpoint(f"{path or 'config'}: dtype={self.dtype!r} not one of {sorted(DTYPES)}",
                                    path=path, field="dtype", value=self.dtype, limit=sorted(DTYPES))
        if self.weight_scheme not in WEIGHT_SCHEMES:
            raise InvalidCheckpoint(f"{path or 'config'}: weight_scheme={self.weight_scheme!r} not one "
                                    f"of {list(WEIGHT_SCHEMES)}", path=path, field="weight_scheme",
                                    value=self.weight_scheme, limit=list(WEIGHT_SCHEMES))
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise InvalidCheckpoint(f"{path or 'config'}: {name}={value!r} must be > 0",
                                        path=path, field=name, value=value, limit=0)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: Path | str | None = None) -> LlamaConfig:
        """Build from a config.json mapping; unknown keys are ignored, missing ones are errors."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        if "dtype" not in data and data.get("torch_dtype") in DTYPES:
            kwargs["dtype"] = data["torch_dtype"]
        if kwargs.get("head_dim") is None:
            kwargs.pop("head_dim", None)
        if "num_key_value_heads" not in kwargs and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        for name in ("bos_token_id", "eos_token_id"):  # HF allows a list of eos ids
            if isinstance(kwargs.get(name), list):
                kwargs[name] = kwargs[name][0] if kwargs[name] else None
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.name not in kwargs]
        if required:
            raise InvalidCheckpoint(f"{path or 'config'}: missing {required[0]!r}",
                                    path=path, field=required[0], value=None, limit=None)
        try:
            config = cls(**kwargs)
        except InvalidCheckpoint as exc:
            exc.path = path
            raise
        return config

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> LlamaConfig:
        """Read ``model_dir/config.json``.  Raises InvalidCheckpoint (missing, too big, bad JSON)."""
        path = Path(model_dir) / CONFIG_NAME
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise InvalidCheckpoint(f"{path}: no config.json", path=path, field=CONFIG_NAME,
                                    value=None, limit=None) from None
        if size > MAX_CONFIG_BYTES:
            raise InvalidCheckpoint(f"{path}: {size} bytes exceeds the {MAX_CONFIG_BYTES}-byte limit",
                                    path=path, field=CONFIG_NAME, value=size, limit=MAX_CONFIG_BYTES)
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidCheckpoint(f"{path}: not valid JSON ({exc})", path=path,
                                    field=CONFIG_NAME, value=None, limit=None) from None
        if not isinstance(data, dict):
            raise InvalidCheckpoint(f"{path}: top level must be an object", path=path,
                                    field=CONFIG_NAME, value=type(data).__name__, limit="object")
        return cls.from_dict(data, path)

    def to_dict(self) -> dict[str, Any]:
        """The config.json form (Hugging Face keys plus ``architectures`` and ``torch_dtype``)."""
        data = dataclasses.asdict(self)
        data["torch_dtype"] = data.pop("dtype")
        data["architectures"] = ["LlamaForCausalLM"]
        data["model_type"] = "llama"
        data["hidden_act"] = "silu"
        return data

    def write(self, model_dir: Path | str) -> Path:
        path = Path(model_dir) / CONFIG_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path
