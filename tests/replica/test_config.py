"""LlamaConfig: reading config.json, range checks at and just over each limit."""

import json

import pytest

from agent.errors import InvalidCheckpoint
from agent.replica import config as cfgmod
from agent.replica.config import LlamaConfig

SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def write(tmp_path, data):
    (tmp_path / "config.json").write_text(json.dumps(data))
    return tmp_path


def test_from_dir_reads_hf_fields_and_derives_sizes(tmp_path):
    c = LlamaConfig.from_dir(write(tmp_path, {**SMOL, "torch_dtype": "bfloat16", "eos_token_id": [2, 5]}))
    assert (c.head_dim, c.n_q, c.n_kv) == (64, 576, 192)
    assert c.dtype == "bfloat16" and c.eos_token_id == 2 and c.rope_theta == 100000.0
    # 2 * 30 layers * 3 KV heads * 64 * 2 bytes
    assert c.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert c.param_count() == 134_515_008  # SmolLM2-135M, embeddings tied


def test_round_trip_through_to_dict(tmp_path):
    c = LlamaConfig(**SMOL)
    c.write(tmp_path)
    assert LlamaConfig.from_dir(tmp_path) == c


def test_missing_field_is_named(tmp_path):
    data = dict(SMOL)
    del data["vocab_size"]
    with pytest.raises(InvalidCheckpoint, match="vocab_size") as e:
        LlamaConfig.from_dir(write(tmp_path, data))
    assert e.value.field == "vocab_size"


@pytest.mark.parametrize("field", sorted(cfgmod._LIMITS))
def test_each_limit_at_and_just_over(tmp_path, field):
    limit = cfgmod._LIMITS[field]
    data = {**SMOL, field: limit}
    if field == "num_attention_heads":
        data.update(num_key_value_heads=limit, hidden_size=limit * 2)
    if field == "num_key_value_heads":
        data.update(num_attention_heads=limit, hidden_size=limit * 2)
    if field == "hidden_size":
        data.update(num_attention_heads=8, num_key_value_heads=8)
    LlamaConfig.from_dict(data)  # at the limit: accepted
    data[field] = limit + 1
    with pytest.raises(InvalidCheckpoint) as e:
        LlamaConfig.from_dict(data, "cfg")
    assert e.value.field == field and e.value.value == limit + 1 and e.value.limit == limit


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "30"])
def test_non_positive_or_non_integer_layers(bad):
    with pytest.raises(InvalidCheckpoint, match="num_hidden_layers"):
        LlamaConfig.from_dict({**SMOL, "num_hidden_layers": bad})


def test_heads_must_group(tmp_path):
    with pytest.raises(InvalidCheckpoint, match="multiple of num_key_value_heads"):
        LlamaConfig.from_dict({**SMOL, "num_key_value_heads": 4})


def test_file_size_limit_at_and_over(tmp_path, monkeypatch):
    text = json.dumps(SMOL)
    monkeypatch.setattr(cfgmod, "MAX_CONFIG_BYTES", len(text))
    (tmp_path / "config.json").write_text(text)
    LlamaConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(text + " ")
    with pytest.raises(InvalidCheckpoint, match="exceeds") as e:
        LlamaConfig.from_dir(tmp_path)
    assert e.value.value == len(text) + 1 and e.value.limit == len(text)


def test_bad_json_and_absent_file(tmp_path):
    with pytest.raises(InvalidCheckpoint, match="no config.json"):
        LlamaConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InvalidCheckpoint, match="not valid JSON"):
        LlamaConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(InvalidCheckpoint, match="object"):
        LlamaConfig.from_dir(tmp_path)
