"""Fixtures for the snapshot tests: small tensors and a writer with a small chunk size."""

from __future__ import annotations

import pytest
import torch

from agent.snapshot.format import ModelIdentity
from agent.snapshot.writer import write_snapshot

CHUNK = 8192   # small chunks so that a few KiB of tensors span several of them


@pytest.fixture
def model_id() -> ModelIdentity:
    return ModelIdentity("tiny", "1", "sha256:" + "0" * 64)


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "embed": torch.randn(40, 64, generator=g).to(torch.bfloat16),     # 5120 B
        "norm": torch.randn(64, generator=g),                              # 256 B
        "proj": torch.randn(33, 70, generator=g).to(torch.float16),       # 4620 B
        "ids": torch.randint(-100, 100, (1500,), generator=g, dtype=torch.int64),  # 12000 B
        "scale": torch.tensor(0.5),
    }


@pytest.fixture
def make_snapshot(tmp_path, model_id, tensors):
    def make(name: str = "snap", data=None, **kw):
        kw.setdefault("chunk_bytes", CHUNK)
        dest = tmp_path / name
        manifest = write_snapshot(dest, data if data is not None else tensors, model=model_id, **kw)
        return dest, manifest
    return make
