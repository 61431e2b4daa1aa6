"""Safetensors header validation and HF-layout import."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from agent.errors import InvalidCheckpoint
from agent.snapshot import safetensors_import as st
from agent.snapshot.reader import restore_snapshot


def _raw(path, header: dict | str, data: bytes = b"") -> None:
    text = header if isinstance(header, str) else json.dumps(header)
    blob = text.encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _err(path) -> InvalidCheckpoint:
    with pytest.raises(InvalidCheckpoint) as err:
        st.read_safetensors_header(path)
    assert err.value.path == path and str(path) in str(err.value)
    return err.value


def test_f32_declared_1000x1000_covering_4_bytes(tmp_path):
    p = tmp_path / "a.safetensors"
    _raw(p, {"w": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 4]}}, b"\0" * 4)
    e = _err(p)
    assert e.field == "w" and e.value == 4 and e.limit == 4_000_000


def test_eight_bytes_of_ff(tmp_path):
    p = tmp_path / "b.safetensors"
    p.write_bytes(b"\xff" * 8)
    e = _err(p)
    assert e.value == 2**64 - 1 and e.limit == st.MAX_HEADER_BYTES and "cap" in str(e)


def test_f16_shape_3_spanning_5_bytes(tmp_path):
    p = tmp_path / "c.safetensors"
    _raw(p, {"h": {"dtype": "F16", "shape": [3], "data_offsets": [0, 5]}}, b"\0" * 5)
    e = _err(p)
    assert e.field == "h" and e.value == 5 and e.limit == 6


def test_header_length_cap_at_and_over(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "MAX_HEADER_BYTES", 64)
    p = tmp_path / "d.safetensors"
    _raw(p, '{"__metadata__": {"a": "b"}}'.ljust(64))                   # exactly at the cap: valid
    assert st.read_safetensors_header(p)["header_bytes"] == 64
    _raw(p, '{"__metadata__": {"a": "b"}}'.ljust(65))
    e = _err(p)
    assert e.value == 65 and e.limit == 64


@pytest.mark.parametrize("header,data,field,why", [
    ({"w": {"dtype": "F31", "shape": [1], "data_offsets": [0, 4]}}, 4, "w", "unknown dtype"),
    ('{"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
     '"w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}', 2, "w", "duplicate"),
    ({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
      "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, 6, "b", "overlaps"),
    ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
      "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]}}, 6, "b", "hole"),
    ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, 5, "data section", "after the last"),
    ({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, 4, "a", "past the data section"),
    ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}, 0, "a", "bad shape"),
    ({"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, 1, "a", "bad shape"),
    ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 0]}}, 1, "a", "bad data_offsets"),
    ({"a": {"dtype": "U8", "shape": [1]}}, 1, "a", "malformed"),
    ({"__metadata__": {"k": 1}}, 0, "__metadata__", "strings"),
    ("[1, 2]", 0, "header", "not a JSON object"),
    ("{not json", 0, "header", "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, 0, "header", "not valid JSON"),
])
def test_invalid_headers(tmp_path, header, data, field, why):
    p = tmp_path / "x.safetensors"
    _raw(p, header, b"\0" * data)
    e = _err(p)
    assert e.field == field and why in str(e)


def test_header_past_end_and_short_file(tmp_path):
    p = tmp_path / "e.safetensors"
    p.write_bytes(struct.pack("<Q", 100) + b"{}")
    assert _err(p).limit == 2
    p.write_bytes(b"\1\0")
    assert _err(p).value == 2


def test_load_matches_safetensors_library(tmp_path):
    data = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int16),
            "c": torch.tensor([True, False]), "d": torch.zeros(0, 4), "e": torch.tensor(2.5, dtype=torch.float64)}
    p = tmp_path / "m.safetensors"
    save_file(data, p, metadata={"format": "pt"})
    ours, ref = st.load_safetensors(p), load_file(p)
    assert sorted(ours) == sorted(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]), k
    assert st.read_safetensors_header(p)["metadata"] == {"format": "pt"}
    # views of one map of the file, not copies
    assert ours["a"].untyped_storage().data_ptr() == ours["b"].untyped_storage().data_ptr()
    with open(p, "ab") as f:
        f.write(b"x")
    with pytest.raises(InvalidCheckpoint):     # bytes after the last tensor: a hole
        st.load_safetensors(p)


def test_import_hf_dir(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"_name_or_path": "tiny-llama", "hidden_size": 8}))
    part1 = {"embed": torch.randn(4, 8), "norm": torch.ones(8, dtype=torch.bfloat16)}
    part2 = {"lm_head": torch.randn(4, 8).to(torch.float16)}
    save_file(part1, hf / "model-00001-of-00002.safetensors")
    save_file(part2, hf / "model-00002-of-00002.safetensors")
    m = st.import_hf(hf, tmp_path / "snap")
    assert m.model.name == "tiny-llama" and m.model.source_digest.startswith("sha256:")
    assert m.model.version == m.model.source_digest[7:19] and m.extra["config"]["hidden_size"] == 8
    r = restore_snapshot(tmp_path / "snap")
    for k, v in {**part1, **part2}.items():
        assert torch.equal(r.tensors[k], v) and r.tensors[k].dtype == v.dtype
    # the digest is a function of the source bytes
    save_file(part2 | {"x": torch.ones(1)}, hf / "model-00002-of-00002.safetensors")
    assert st.import_hf(hf, tmp_path / "snap2").model.source_digest != m.model.source_digest


def test_import_rejects_duplicates_across_files_and_missing_config(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    with pytest.raises(InvalidCheckpoint, match="config.json"):
        st.import_hf(hf, tmp_path / "s")
    (hf / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, hf / "a.safetensors")
    save_file({"w": torch.ones(2)}, hf / "b.safetensors")
    with pytest.raises(InvalidCheckpoint) as err:
        st.import_hf(hf, tmp_path / "s")
    assert err.value.field == "w" and "duplicate" in str(err.value)
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.partial").exists()


def test_ndim_limit_at_and_over(tmp_path):
    p = tmp_path / "n.safetensors"
    _raw(p, {"a": {"dtype": "U8", "shape": [1] * st.MAX_NDIM, "data_offsets": [0, 1]}}, b"\0")
    assert st.read_safetensors_header(p)["tensors"]["a"]["shape"] == [1] * st.MAX_NDIM
    _raw(p, {"a": {"dtype": "U8", "shape": [1] * (st.MAX_NDIM + 1), "data_offsets": [0, 1]}}, b"\0")
    assert _err(p).field == "a"


def _hf_with(tmp_path, shape: list[int]):
    """An HF dir whose one safetensors file holds an empty BF16 tensor "z" of ``shape`` (no bytes)
    beside a real one, so the import goes all the way to the snapshot."""
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text("{}")
    _raw(hf / "model.safetensors", {"z": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]},
                                    "w": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"\1\2")
    return hf


def test_empty_tensor_with_a_2_70_dimension_refused_naming_it(tmp_path):
    hf = _hf_with(tmp_path, [0, 2**70])
    with pytest.raises(InvalidCheckpoint) as err:
        st.import_hf(hf, tmp_path / "s")
    assert err.value.field == "z" and err.value.value == 2**70 and err.value.limit == st.MAX_DIM
    assert "'z'" in str(err.value) or "z:" in str(err.value)
    assert not (tmp_path / "s").exists()


def test_dimension_cap_at_and_over(tmp_path):
    assert st.MAX_DIM == 1 << 62
    m = st.import_hf(_hf_with(tmp_path, [0, st.MAX_DIM]), tmp_path / "at")   # at the cap: imports
    r = restore_snapshot(tmp_path / "at")
    assert r.tensors["z"].shape == (0, st.MAX_DIM) and r.tensors["z"].dtype == torch.bfloat16
    assert torch.equal(r.tensors["w"], torch.tensor([1, 2], dtype=torch.uint8)) and m.total_bytes >= 2
    p = tmp_path / "hf" / "model.safetensors"
    for shape in ([0, st.MAX_DIM + 1], [st.MAX_DIM + 1, 0], [0, 2**63], [0, 2**63 - 1]):
        _raw(p, {"z": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}})
        e = _err(p)
        assert e.field == "z" and e.value == max(shape) and e.limit == st.MAX_DIM and "dimension" in str(e)


def test_element_cap_at_and_over(tmp_path):
    # each dimension well under MAX_DIM; the product (zeros counted as 1) is what is capped
    assert st.MAX_ELEMENTS == 1 << 62
    m = st.import_hf(_hf_with(tmp_path, [0, 1 << 31, 1 << 31]), tmp_path / "at")
    assert restore_snapshot(tmp_path / "at").tensors["z"].shape == (0, 1 << 31, 1 << 31) and m.tensors
    p = tmp_path / "hf" / "model.safetensors"
    for shape, product in (([0, 1 << 40, 0, 1 << 40], 1 << 80), ([0, 1 << 31, (1 << 31) + 1], (1 << 62) + (1 << 31))):
        _raw(p, {"z": {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}})
        e = _err(p)
        assert e.field == "z" and e.value == product and e.limit == st.MAX_ELEMENTS and "product" in str(e)
    with pytest.raises(InvalidCheckpoint) as err:
        st.import_hf(tmp_path / "hf", tmp_path / "over")
    assert err.value.field == "z" and not (tmp_path / "over").exists()
