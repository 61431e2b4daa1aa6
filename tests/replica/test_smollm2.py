"""The real model: SmolLM2-135M-Instruct imported from its Q4_1 GGUF (slow: ~10 s import once)."""

import json

import numpy as np
import pytest

from agent.cli import main
from agent.replica.config import LlamaConfig
from agent.replica.firstboot import streamed_first_boot
from agent.replica.gguf_import import unpermute_rope
from agent.replica.tokenizer import chat_prompt, load_tokenizer

pytestmark = pytest.mark.slow


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The forward permutation as llama.cpp's convert_hf_to_gguf.py defines it (re-derived)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(9 * 64 * 3, dtype=np.float32).reshape(9 * 64, 3)
    assert np.array_equal(unpermute_rope(llama_cpp_permute(w, 9), 9), w)
    assert not np.array_equal(llama_cpp_permute(w, 9), w)
    # row 1 of head 0 in GGUF order is row d/2 = 32 of head 0 in Hugging Face order
    assert np.array_equal(llama_cpp_permute(w, 9)[1], w[32])


def test_imported_layout(smollm2_dir):
    config = LlamaConfig.from_dir(smollm2_dir)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.eos_token_id == 2 and config.bos_token_id == 1
    tok_cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_cfg["chat_template"]


def test_paris(smollm2_dir, smollm2_engine):
    tok = load_tokenizer(smollm2_dir)
    ids = tok.encode("The capital of France is").ids
    out = smollm2_engine.generate([ids], 4)[0]
    assert tok.decode(out).startswith(" Paris")
    assert tok.decode([out[0]]) == " Paris"


def test_tokenizer_round_trip_and_special_tokens(smollm2_dir):
    tok = load_tokenizer(smollm2_dir)
    text = "Hello, world! 1234 naïve café\n  indented"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert tok.encode("123").ids == [tok.token_to_id(d) for d in "123"]  # digits split singly
    chat = tok.encode(chat_prompt("Hi")).ids
    assert chat[0] == 1 and chat.count(2) == 2  # <|im_start|>, two <|im_end|>
    assert tok.encode(" Paris").ids == [7042]


def test_chat_answer_stops_at_im_end(smollm2_dir, smollm2_engine):
    tok = load_tokenizer(smollm2_dir)
    ids = tok.encode(chat_prompt("What is the capital of France? Answer in one word.")).ids
    out = smollm2_engine.generate([ids], 20, stop={2})[0]
    assert "Paris" in tok.decode(out) and 2 not in out


def test_streamed_first_boot_matches_a_normal_boot(smollm2_dir, smollm2_engine):
    tok = load_tokenizer(smollm2_dir)
    ids = tok.encode("The capital of France is").ids
    boot = streamed_first_boot(smollm2_dir, ids, 6, max_seqs=2, max_seq_len=64)
    out = [boot.first_token]
    while boot.engine.busy:
        out += [e.token for e in boot.engine.step() if e.token >= 0]
    assert out == smollm2_engine.generate([ids], 6)[0]
    assert boot.first_token == 7042 and boot.load_done_s <= boot.first_token_s


def test_cli_generate_and_import_reused(smollm2_dir, capsys):
    from agent.replica.smollm2 import ensure_smollm2, gguf_path

    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_smollm2(smollm2_dir) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
    assert main(["model", "generate", str(smollm2_dir), "The capital of France is",
                 "--max-tokens", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["text"].startswith(" Paris")
    assert gguf_path().suffix == ".gguf"


def test_streamed_text_joins_the_pieces_of_one_character(smollm2_dir):
    from agent.replica.batching import Request as _Request, next_text

    tok = load_tokenizer(smollm2_dir)
    text = " Café 日本語 🙂 Paris."
    ids = tok.encode(text).ids
    assert any("\ufffd" in tok.decode([i]) for i in ids)   # some pieces are partial characters
    request = _Request("r", None, 0.0, True)
    sent = []
    for i in ids:
        request.tokens.append(i)
        sent.append(next_text(tok, request))
    assert "".join(sent) == tok.decode(ids) == text
    assert not any("\ufffd" in piece for piece in sent)
