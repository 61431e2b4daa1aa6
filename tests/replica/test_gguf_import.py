"""GGUF import on a small file written here the way llama.cpp's converter writes one:
Hugging Face tensors -> Q/K permuted for RoPE -> GGUF; the import must give them back exactly."""

import json

import gguf
import numpy as np
import pytest
import torch

from agent.errors import InvalidCheckpoint
from agent.replica.config import LlamaConfig
from agent.replica.gguf_import import import_gguf
from agent.replica.synthetic import preset_config, synthetic_tensors
from agent.replica.tokenizer import load_tokenizer
from agent.replica.weights import load_hf_weights

GGUF_NAMES = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight"}
# a byte-level vocabulary: 3 control tokens, the 256 byte symbols, and merges building "ab", "abc"
BYTE_SYMBOLS = [chr(c) for c in range(ord("!"), ord("~") + 1)] + \
    [chr(c) for c in range(ord("¡"), ord("¬") + 1)] + [chr(c) for c in range(ord("®"), ord("ÿ") + 1)]


def byte_vocab():
    extra = [chr(256 + n) for n in range(256 - len(BYTE_SYMBOLS))]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + BYTE_SYMBOLS + extra + ["ab", "abc"]
    return tokens, ["a b", "ab c"], [3, 3, 3] + [1] * (len(tokens) - 3)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path, config: LlamaConfig, hf: dict, arch: str = "llama", vocab_size: int | None = None):
    tokens, merges, types = byte_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_vocab_size(len(tokens) if vocab_size is None else vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in hf.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{GGUF_NAMES[rest]}"
            if rest.startswith("self_attn.q"):
                a = permute(a, config.num_attention_heads)
            elif rest.startswith("self_attn.k"):
                a = permute(a, config.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def small():
    tokens = byte_vocab()[0]
    base = preset_config("tiny")
    config = LlamaConfig(**{**base.__dict__, "vocab_size": len(tokens), "tie_word_embeddings": False,
                            "rope_theta": 50000.0, "bos_token_id": 1, "eos_token_id": 2})
    return config, synthetic_tensors(config, seed=9)


def test_round_trip_undoes_the_rope_permutation_exactly(tmp_path, small):
    config, hf = small
    out = import_gguf(write_gguf(tmp_path / "m.gguf", config, hf), tmp_path / "hf")
    got = LlamaConfig.from_dir(out)
    assert got == config
    weights = load_hf_weights(out)
    from agent.replica.model import hf_to_runtime
    want = hf_to_runtime(hf)
    assert set(weights) == set(want)
    for k in want:
        assert torch.equal(weights[k], want[k]), k
    assert not (tmp_path / "hf.partial").exists()


def test_tokenizer_from_gguf_vocab_and_merges(tmp_path, small):
    config, hf = small
    out = import_gguf(write_gguf(tmp_path / "m.gguf", config, hf), tmp_path / "hf")
    tok = load_tokenizer(out)
    tokens = byte_vocab()[0]
    ids = tok.encode("abc<|im_end|>").ids
    assert [tokens[i] for i in ids] == ["abc", "<|im_end|>"]
    assert tok.decode(tok.encode("a b!").ids) == "a b!"
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_other_architecture_is_refused(tmp_path, small):
    config, hf = small
    path = write_gguf(tmp_path / "m.gguf", config, hf, arch="gpt2")
    with pytest.raises(InvalidCheckpoint, match="'gpt2' is not 'llama'"):
        import_gguf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_tensor_shape_disagreeing_with_metadata_is_named(tmp_path, small):
    config, hf = small
    bad = dict(hf)
    bad["model.layers.1.mlp.down_proj.weight"] = torch.zeros(config.hidden_size, config.intermediate_size - 2)
    with pytest.raises(InvalidCheckpoint, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*\(64, 126\).*\(64, 128\)"):
        import_gguf(write_gguf(tmp_path / "m.gguf", config, bad), tmp_path / "hf")


def test_tokenizer_errors_are_typed():
    from agent.replica.tokenizer import build_from_gguf

    with pytest.raises(InvalidCheckpoint, match="duplicates"):
        build_from_gguf(["a", "b", "a"], [])
    with pytest.raises(InvalidCheckpoint, match="not two symbols"):
        build_from_gguf(["a", "b", "ab"], ["a b c"])
    with pytest.raises(InvalidCheckpoint, match="out of vocabulary") as e:
        build_from_gguf(["a", "b", "ab"], ["a z"])
    assert e.value.field == "tokenizer.ggml.merges"


def test_cli_import_gguf(tmp_path, small, capsys):
    from agent.cli import main

    config, hf = small
    path = write_gguf(tmp_path / "m.gguf", config, hf)
    assert main(["model", "import-gguf", str(path), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out")
    assert LlamaConfig.from_dir(tmp_path / "out").dtype == "bfloat16"
    assert {t.dtype for t in load_hf_weights(tmp_path / "out").values()} == {torch.bfloat16}


def test_token_count_must_match_vocab_size(tmp_path, small):
    config, hf = small
    path = write_gguf(tmp_path / "m.gguf", config, hf, vocab_size=config.vocab_size + 1)
    with pytest.raises(InvalidCheckpoint, match="llama.vocab_size") as e:
        import_gguf(path, tmp_path / "hf")
    assert (e.value.value, e.value.limit) == (config.vocab_size, config.vocab_size + 1)
