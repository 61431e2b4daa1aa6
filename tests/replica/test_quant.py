"""Weight-only int4/int8: the kernels' convention, GGUF blocks kept as codes, and a Q4_1 GGUF
imported without dequantizing, whose forward matches the dequantized (float32) import."""

import dataclasses
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from agent.errors import InvalidCheckpoint, WeightSchemeMismatch
from agent.replica import quant
from agent.replica.config import LlamaConfig
from agent.replica.gguf_import import import_gguf
from agent.replica.model import Transformer, new_kv_caches
from agent.replica.weights import load_hf_weights
from tests.replica.test_gguf_import import small, write_gguf  # noqa: F401 (fixture)


def test_int4_kernel_computes_q_minus_8_times_scale_plus_zero():
    gen = torch.Generator().manual_seed(1)
    n, k = 64, 128
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    sz = torch.stack([torch.rand(k // 32, n, generator=gen) * 0.1,
                      torch.randn(k // 32, n, generator=gen) * 0.1], dim=-1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    x = torch.randn(3, k, generator=gen)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, quant.GROUP_SIZE, sz)
    w = quant.dequantize_hf({".qweight": quant.pack_nibbles(codes), ".scales_and_zeros": sz})
    assert torch.allclose(got, x @ w.t(), atol=1e-4)
    # the other plausible reading (q * scale + zero) is far off: the test can tell them apart
    assert not torch.allclose(got, x @ (w + 8 * sz[..., 0].t().repeat_interleave(32, 1)).t(), atol=1e-1)


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1])
def test_q4_blocks_decode_as_ggml_dequantizes(kind):
    a = np.random.default_rng(2).standard_normal((8, 96)).astype(np.float32)
    raw = gguf.quants.quantize(a, kind)
    codes, sz = quant.q4_blocks(raw, kind.name, 8, 96)
    assert codes.min() >= 0 and codes.max() <= 15
    w = quant.dequantize_hf({".qweight": quant.pack_nibbles(torch.from_numpy(codes)),
                             ".scales_and_zeros": torch.from_numpy(sz.transpose(1, 0, 2).copy())})
    np.testing.assert_allclose(w.numpy(), gguf.quants.dequantize(raw, kind), atol=1e-6)


def test_q4_blocks_refuse_a_wrong_size():
    raw = np.zeros((8, 40), dtype=np.uint8)
    with pytest.raises(InvalidCheckpoint, match=r"Q4_1 tensor bytes \(8, 40\) do not hold \[8, 96\]"):
        quant.q4_blocks(raw, "Q4_1", 8, 96)


def test_nibbles_round_trip():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.int32)
    packed = quant.pack_nibbles(codes)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(quant.unpack_nibbles(packed), codes)


def _quantized_gguf(path, config, hf):
    """write_gguf's file with every layer matrix Q4_1 and the embedding/head Q8_0."""
    out = write_gguf(path.with_suffix(".f32.gguf"), config, hf)
    reader = gguf.GGUFReader(str(out))
    w = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        a = np.asarray(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        kind = T.F32 if a.ndim == 1 else T.Q8_0 if t.name in ("token_embd.weight", "output.weight") else T.Q4_1
        w.add_tensor(t.name, gguf.quants.quantize(a, kind) if kind != T.F32 else a, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(model, config, tokens):
    k, v = new_kv_caches(config, 1, 32)
    with torch.inference_mode():
        return model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), torch.zeros(1, dtype=torch.int64), k, v,
                     torch.arange(tokens.shape[1]).unsqueeze(0))


def test_q4_1_gguf_is_imported_as_codes_and_runs_like_its_float32_import(tmp_path, small):  # noqa: F811
    config, hf = small
    path = _quantized_gguf(tmp_path / "q.gguf", config, hf)
    q_dir = import_gguf(path, tmp_path / "q")
    f_dir = import_gguf(path, tmp_path / "f", dtype="float32")
    q_cfg = LlamaConfig.from_dir(q_dir)
    assert (q_cfg.weight_scheme, q_cfg.dtype) == ("int4", "bfloat16")
    assert json.loads((q_dir / "config.json").read_text())["weight_scheme"] == "int4"
    q_w, f_w = load_hf_weights(q_dir), load_hf_weights(f_dir)
    assert quant.scheme_of(q_w) == "int4" and quant.scheme_of(f_w) == "dense"
    assert q_w["layers.0.attention.wqkv.weight_int4pack"].dtype == torch.uint8
    assert q_w["output.weight_int8"].dtype == torch.int8
    q_bytes, f_bytes = (sum(t.nbytes for t in w.values()) for w in (q_w, f_w))
    assert q_bytes < f_bytes / 4
    # int4 matrices hold the GGUF's codes; the values differ from the float32 import only by
    # the bfloat16 rounding of scale and zero (each <= 2^-8 relative) and of the read-back
    dense = quant.dense_runtime(q_w)
    for name in ("layers.1.attention.wqkv", "layers.0.feed_forward.w2"):
        sz = q_w[name + ".scales_and_zeros"].float().abs()
        bound = (8 * float(sz[..., 0].max()) + float(sz[..., 1].max())) * 2 ** -8
        err = (dense[name + ".weight"] - f_w[name + ".weight"]).abs()
        assert float((err - f_w[name + ".weight"].abs() * 2 ** -8).max()) <= bound, name
    tokens = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])
    got = _logits(Transformer.from_weights(q_cfg, q_w), q_cfg, tokens)
    want = _logits(Transformer.from_weights(LlamaConfig.from_dir(f_dir), f_w), LlamaConfig.from_dir(f_dir), tokens)
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) < 0.05 * float(want.abs().max())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def test_package_for_dense_weights_refuses_int4_weights(tmp_path, small):  # noqa: F811
    from agent.replica import aot
    from agent.replica.targets import current_target

    config, hf = small
    q_dir = import_gguf(_quantized_gguf(tmp_path / "q.gguf", config, hf), tmp_path / "q")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / aot.PACKAGE_NAME).write_bytes(b"not loaded: refused first")
    manifest = {"format": aot.PACKAGE_FORMAT, "target": current_target("cpu"),
                "digest": aot.file_digest(pkg / aot.PACKAGE_NAME), "constants": {},
                "max_seqs": 2, "max_seq_len": 32, "config": config.to_dict(),
                "ranges": {"batch": [1, 2], "seq": [1, 32], "cache_batch": [1, 2]},
                "kv": {"layers": config.num_hidden_layers, "max_seq_len": 32,
                       "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                       "dtype": "float32"}, "weight_scheme": "dense"}
    (pkg / aot.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(WeightSchemeMismatch, match="built for 'dense' weights; these weights are 'int4'") as e:
        aot.load_package(pkg, load_hf_weights(q_dir))
    assert (e.value.built, e.value.here) == ("dense", "int4")


def test_unknown_weight_scheme_is_refused(small):  # noqa: F811
    config, _ = small
    with pytest.raises(InvalidCheckpoint, match="weight_scheme='int3'"):
        dataclasses.replace(config, weight_scheme="int3")


def test_int8_mm_gives_the_same_rows_on_either_kernel():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(quant.INT8_DENSE_MIN_ROWS + 8, 64, generator=gen).bfloat16()
    w = torch.randint(-127, 128, (96, 64), generator=gen, dtype=torch.int8)
    scales = (torch.rand(96, generator=gen) * 0.01).bfloat16()
    want = x.float() @ (w.float() * scales.float()[:, None]).t()
    dense = quant.int8_mm(x, w, scales).float()                 # the widened GEMM
    rows = quant.int8_mm(x[:8], w, scales).float()              # _weight_int8pack_mm
    scale = float(want.abs().max())
    assert float((dense - want).abs().max()) <= scale * 2 ** -7
    assert float((rows - want[:8]).abs().max()) <= scale * 2 ** -7
    assert float((dense[:8] - rows).abs().max()) <= scale * 2 ** -7
