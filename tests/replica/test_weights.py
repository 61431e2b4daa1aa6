"""Streaming safetensors loader: same tensors as a plain load, layer order, shape mismatches
and header limits at and just over their values."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from agent.errors import InvalidCheckpoint
from agent.replica import weights as wmod
from agent.replica.config import LlamaConfig
from agent.replica.model import hf_to_runtime
from agent.replica.synthetic import preset_config, synthetic_tensors
from agent.replica.weights import load_hf_weights, read_header, stream_hf_weights


def test_streamed_load_equals_direct_conversion(tiny_dir):
    config = LlamaConfig.from_dir(tiny_dir)
    got = load_hf_weights(tiny_dir)
    want = hf_to_runtime(synthetic_tensors(config, seed=0))
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]) and got[k]._base is None, k


def test_groups_arrive_embedding_layers_in_numeric_order_then_final(tmp_path):
    config = LlamaConfig(**{**preset_config("tiny").__dict__, "num_hidden_layers": 11})
    config.write(tmp_path)
    save_file(synthetic_tensors(config), str(tmp_path / "model.safetensors"))
    groups = [g for g, _ in stream_hf_weights(tmp_path)]
    assert groups == ["embed"] + [f"layer.{i}" for i in range(11)] + ["final"]


def test_bfloat16_runtime_dtype_converts_as_it_lands(tiny_dir, tmp_path):
    config = LlamaConfig(**{**LlamaConfig.from_dir(tiny_dir).__dict__, "dtype": "bfloat16"})
    got = load_hf_weights(tiny_dir, config)
    assert {t.dtype for t in got.values()} == {torch.bfloat16}


def test_split_across_two_files(tmp_path):
    config = preset_config("tiny")
    config.write(tmp_path)
    hf = synthetic_tensors(config)
    names = sorted(hf)
    save_file({k: hf[k] for k in names[::2]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: hf[k] for k in names[1::2]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    got = load_hf_weights(tmp_path)
    assert torch.equal(got["layers.1.attention.wqkv.weight"],
                       hf_to_runtime(hf)["layers.1.attention.wqkv.weight"])


def _model_with(tmp_path, mutate):
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = preset_config("tiny")
    config.write(tmp_path)
    hf = synthetic_tensors(config)
    mutate(hf)
    save_file(hf, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    d = _model_with(tmp_path, lambda hf: hf.__setitem__(
        "model.layers.1.mlp.up_proj.weight", torch.zeros(127, 64)))
    with pytest.raises(InvalidCheckpoint) as e:
        load_hf_weights(d)
    assert e.value.field == "model.layers.1.mlp.up_proj.weight"
    assert e.value.value == (127, 64) and e.value.limit == (128, 64)
    assert "(127, 64)" in str(e.value) and "(128, 64)" in str(e.value)


def test_missing_and_unexpected_tensors(tmp_path):
    d = _model_with(tmp_path / "a", lambda hf: hf.pop("model.norm.weight"))
    with pytest.raises(InvalidCheckpoint, match="missing tensor 'model.norm.weight'"):
        load_hf_weights(d)
    d = _model_with(tmp_path / "b", lambda hf: hf.__setitem__("lm_head.weight", torch.zeros(256, 64)))
    with pytest.raises(InvalidCheckpoint, match="unexpected tensor 'lm_head.weight'"):
        load_hf_weights(d)


def test_no_safetensors(tmp_path):
    preset_config("tiny").write(tmp_path)
    with pytest.raises(InvalidCheckpoint, match="no \\*.safetensors"):
        load_hf_weights(tmp_path)


def _raw(tmp_path, header: dict, data: bytes, length: int | None = None):
    body = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def test_header_length_at_and_over_the_file(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    body = json.dumps(header).encode()
    path = _raw(tmp_path, header, b"\0" * 8)
    assert read_header(path)[0] == 8 + len(body)
    # a length running past the end of the file is refused before anything is read
    size = path.stat().st_size
    path = _raw(tmp_path, header, b"\0" * 8, length=size - 8 + 1)
    with pytest.raises(InvalidCheckpoint, match="header length") as e:
        read_header(path)
    assert e.value.limit == size - 8


def test_header_length_limit_at_and_over(tmp_path, monkeypatch):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    n = len(json.dumps(header).encode())
    path = _raw(tmp_path, header, b"\0" * 8)
    monkeypatch.setattr(wmod, "MAX_HEADER_BYTES", n)
    read_header(path)
    monkeypatch.setattr(wmod, "MAX_HEADER_BYTES", n - 1)
    with pytest.raises(InvalidCheckpoint, match="exceeds limit"):
        read_header(path)


@pytest.mark.parametrize("entry, message", [
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}, "do not fit"),      # length != shape
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}, "do not fit"),      # past data end
    ({"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}, "unsupported dtype"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "non-negative integers"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0]}, "two data_offsets"),
    ({"dtype": "F32", "data_offsets": [0, 8]}, "needs a shape"),
])
def test_bad_entries(tmp_path, entry, message):
    with pytest.raises(InvalidCheckpoint, match=message):
        read_header(_raw(tmp_path, {"a": entry}, b"\0" * 8))


def test_truncated_file_and_bad_json(tmp_path):
    (tmp_path / "t.safetensors").write_bytes(b"\1\0")
    with pytest.raises(InvalidCheckpoint, match="too short"):
        read_header(tmp_path / "t.safetensors")
    (tmp_path / "j.safetensors").write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(InvalidCheckpoint, match="not JSON"):
        read_header(tmp_path / "j.safetensors")
    (tmp_path / "l.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(InvalidCheckpoint, match="not a JSON object"):
        read_header(tmp_path / "l.safetensors")
