"""Synthetic presets: deterministic bytes, the 13b shape, and the CLI."""

import hashlib

import pytest
import torch

from agent.cli import main
from agent.errors import ConfigError
from agent.replica.config import LlamaConfig
from agent.replica.synthetic import make_synthetic, preset_config


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = make_synthetic(tmp_path / "a", "tiny", seed=3)
    b = make_synthetic(tmp_path / "b", "tiny", seed=3)
    c = make_synthetic(tmp_path / "c", "tiny", seed=4)
    assert digest(a) == digest(b) != digest(c)
    assert not (tmp_path / "a.partial").exists()


def test_13b_shape_and_its_scaled_sweep():
    full = preset_config("13b-shaped")
    assert (full.num_hidden_layers, full.num_key_value_heads, full.head_dim) == (40, 8, 128)
    assert full.param_count() == 11_338_142_720 and full.dtype == "bfloat16"
    small = preset_config("13b-shaped", scale=5)
    assert (small.num_hidden_layers, small.num_key_value_heads, small.head_dim) == (40, 8, 128)
    assert small.hidden_size == 1024 and small.kv_bytes_per_token == full.kv_bytes_per_token
    with pytest.raises(ConfigError, match="scale"):
        preset_config("13b-shaped", scale=2)
    with pytest.raises(ConfigError, match="scale"):
        preset_config("tiny", scale=5)
    with pytest.raises(ConfigError, match="unknown preset"):
        preset_config("70b")


def test_cli_make_synthetic(tmp_path, capsys):
    assert main(["model", "make-synthetic", "--preset", "small", "--seed", "1", str(tmp_path / "s")]) == 0
    config = LlamaConfig.from_dir(tmp_path / "s")
    assert config == preset_config("small") and not config.tie_word_embeddings
    assert str(tmp_path / "s") in capsys.readouterr().out


def test_the_llama3_8b_shape_is_its_parameter_count():
    config = preset_config("llama3-8b-shaped")
    assert config.param_count() == 8_030_261_248
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (32, 8, 128)
    assert config.dtype == "bfloat16" and not config.tie_word_embeddings


def test_a_streamed_file_holds_the_same_tensors_and_reads_as_a_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from agent.replica.synthetic import synthetic_tensors, write_safetensors
    from agent.replica.weights import load_hf_weights, read_header

    config = preset_config("small", dtype="bfloat16")
    size = write_safetensors(tmp_path / "model.safetensors", config, seed=5)
    assert size == (tmp_path / "model.safetensors").stat().st_size
    start, header = read_header(tmp_path / "model.safetensors")
    assert start % 8 == 0 and size == start + sum(
        e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
    got, want = load_file(str(tmp_path / "model.safetensors")), synthetic_tensors(config, seed=5)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    made = make_synthetic(tmp_path / "m", "small", seed=5, dtype="bfloat16", device="cpu")
    assert digest(made) == hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    assert set(load_hf_weights(made)) >= {"tok_embeddings.weight", "layers.0.attention.wqkv.weight"}
