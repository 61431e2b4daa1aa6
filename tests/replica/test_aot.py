"""AOT packages: built once for a tiny model, bound to outside weights, refused on other targets."""

import json
import shutil

import pytest
import torch

from agent.errors import ConfigError, InvalidCheckpoint, TargetMismatch
from agent.replica import aot
from agent.replica.config import LlamaConfig
from agent.replica.model import Transformer, new_kv_caches
from agent.replica.targets import current_target

MAX_SEQS, MAX_SEQ_LEN = 4, 32


def tiny_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                       max_position_embeddings=64, tie_word_embeddings=True)


def tiny_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = Transformer(tiny_config())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    out = tmp_path_factory.mktemp("release")
    aot.build_from_weights(tiny_config(), tiny_weights(), out, max_seqs=MAX_SEQS,
                           max_seq_len=MAX_SEQ_LEN)
    return out


def run(forward, weights_seed_or_none, B, S, C, weights=None):
    cfg = tiny_config()
    gen = torch.Generator().manual_seed(B * 100 + S * 10 + C)
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    input_pos = torch.arange(S).repeat(B, 1)
    idx = torch.randperm(C, generator=gen)[:B]
    k, v = new_kv_caches(cfg, C, MAX_SEQ_LEN)
    return forward(tokens, input_pos, idx, k, v), k, v


@pytest.mark.slow
@pytest.mark.parametrize("B,S,C", [(1, 1, 1), (3, 5, 4), (4, 1, 4), (2, 32, 3)])
def test_package_matches_eager_for_every_dynamic_size(release, B, S, C):
    weights = tiny_weights()
    packaged = aot.load_package(release, weights)
    eager = Transformer.from_weights(tiny_config(), tiny_weights())
    got, gk, gv = run(packaged, None, B, S, C)
    want, wk, wv = run(eager, None, B, S, C)
    assert got.shape == (B, S, tiny_config().vocab_size)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(gk[1], wk[1], atol=1e-6) and gk[1].abs().sum() > 0  # cache written in place


@pytest.mark.slow
def test_weights_are_bound_without_copy_and_package_holds_none(release):
    package_dir = aot.find_package(release)
    manifest = aot.read_package_manifest(package_dir)
    assert manifest["target"] == current_target()
    assert manifest["digest"] == aot.file_digest(package_dir / aot.PACKAGE_NAME)
    assert set(manifest["constants"]) == set(tiny_weights())
    weights = tiny_weights()
    packaged = aot.load_package(release, weights)
    before, _, _ = run(packaged, None, 2, 3, 2)
    weights["norm.weight"].mul_(2.0)  # the compiled code reads this very tensor
    after, _, _ = run(packaged, None, 2, 3, 2)
    assert not torch.allclose(before, after)
    other = aot.load_package(release, tiny_weights(seed=1))  # same shape, other checkpoint
    eager = Transformer.from_weights(tiny_config(), tiny_weights(seed=1))
    assert torch.allclose(run(other, None, 2, 3, 2)[0], run(eager, None, 2, 3, 2)[0], atol=1e-5)


@pytest.mark.slow
def test_package_for_another_target_is_refused_naming_both(release, tmp_path):
    fake = tmp_path / "pkg"
    shutil.copytree(aot.find_package(release), fake)
    manifest = json.loads((fake / aot.MANIFEST_NAME).read_text())
    manifest["target"] = "x86_64-avx512+amx_tile"
    (fake / aot.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(TargetMismatch) as err:
        aot.load_package(fake, tiny_weights())
    assert err.value.built == "x86_64-avx512+amx_tile" and err.value.here == current_target()
    assert "x86_64-avx512+amx_tile" in str(err.value) and current_target() in str(err.value)
    # A release holding only that package is refused the same way.
    rel = tmp_path / "release"
    shutil.copytree(fake, rel / "x86_64-avx512_amx_tile")
    with pytest.raises(TargetMismatch) as err:
        aot.find_package(rel)
    assert err.value.built == ["x86_64-avx512+amx_tile"]


@pytest.mark.slow
def test_digest_and_weight_mismatches_are_typed_errors(release):
    with pytest.raises(InvalidCheckpoint) as err:
        aot.load_package(release, tiny_weights(), expect_digest="sha256:" + "0" * 64)
    assert err.value.field == "digest"
    weights = tiny_weights()
    weights["layers.1.attention.wo.weight"] = torch.zeros(32, 31)
    with pytest.raises(InvalidCheckpoint, match=r"layers\.1\.attention\.wo\.weight.*\(32, 31\).*\(32, 32\)"):
        aot.load_package(release, weights)
    weights = tiny_weights()
    weights["norm.weight"] = weights["norm.weight"].to(torch.float64)
    with pytest.raises(InvalidCheckpoint, match="float64"):
        aot.load_package(release, weights)
    weights = tiny_weights()
    del weights["layers.0.ffn_norm.weight"]
    with pytest.raises(InvalidCheckpoint, match="missing") as err:
        aot.load_package(release, weights)
    assert err.value.field == "layers.0.ffn_norm.weight"


def test_empty_release_and_bad_manifests(tmp_path):
    with pytest.raises(FileNotFoundError):
        aot.find_package(tmp_path)
    (tmp_path / aot.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(InvalidCheckpoint, match="JSON"):
        aot.read_package_manifest(tmp_path)
    (tmp_path / aot.MANIFEST_NAME).write_text(json.dumps({"format": 1}))
    with pytest.raises(InvalidCheckpoint, match="target"):
        aot.read_package_manifest(tmp_path)
    (tmp_path / aot.MANIFEST_NAME).write_bytes(b" " * (aot.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(InvalidCheckpoint) as err:
        aot.read_package_manifest(tmp_path)
    assert err.value.limit == aot.MAX_MANIFEST_BYTES


def test_sizes_out_of_range_are_refused_before_compiling(tmp_path):
    with pytest.raises(ConfigError) as err:
        aot.build_from_weights(tiny_config(), tiny_weights(), tmp_path, max_seq_len=65)
    assert err.value.limit == 64
    with pytest.raises(ConfigError):
        aot.build_from_weights(tiny_config(), tiny_weights(), tmp_path, max_seqs=0)
