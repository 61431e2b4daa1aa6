"""AOT packages: built once for a tiny model, bound to outside weights, refused on other targets."""

import json
import shutil

import pytest
import torch

from agent.errors import ConfigError, InvalidCheckpoint, PackageCheckFailed, PackageInputError, TargetMismatch
from agent.replica import aot, aot_check
from agent.replica.config import LlamaConfig
from agent.replica.model import Transformer, every_position, last_positions, new_kv_caches
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


def run(forward, weights_seed_or_none, B, S, C, weights=None, K=None):
    """One call at (B, S, C): logits of every position (``K`` None), of each row's last
    (``K`` 1), or of ``K`` positions drawn from [0, S)."""
    cfg = tiny_config()
    gen = torch.Generator().manual_seed(B * 100 + S * 10 + C)
    tokens = torch.randint(0, cfg.vocab_size, (B, S), generator=gen)
    input_pos = torch.arange(S).repeat(B, 1)
    idx = torch.randperm(C, generator=gen)[:B]
    k, v = new_kv_caches(cfg, C, MAX_SEQ_LEN)
    logit_pos = (every_position(B, S) if K is None else last_positions([S] * B) if K == 1
                 else torch.randint(0, S, (B, K), generator=gen))
    return forward(tokens, input_pos, idx, k, v, logit_pos), k, v


@pytest.mark.slow
@pytest.mark.parametrize("B,S,C,K", [(1, 1, 1, None), (3, 5, 4, None), (3, 5, 4, 1), (4, 1, 4, 1),
                                     (2, 32, 3, None), (2, 32, 3, 1), (2, 7, 3, 32)])
def test_package_matches_eager_for_every_dynamic_size(release, B, S, C, K):
    weights = tiny_weights()
    packaged = aot.load_package(release, weights)
    eager = Transformer.from_weights(tiny_config(), tiny_weights())
    got, gk, gv = run(packaged, None, B, S, C, K=K)
    want, wk, wv = run(eager, None, B, S, C, K=K)
    assert got.shape == (B, S if K is None else K, tiny_config().vocab_size)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(gk[1], wk[1], atol=1e-6) and gk[1].abs().sum() > 0  # cache written in place


@pytest.mark.slow
def test_weights_are_bound_without_copy_and_package_holds_none(release):
    package_dir = aot.find_package(release)
    manifest = aot.read_package_manifest(package_dir)
    assert manifest["target"] == current_target()
    assert manifest["digest"] == aot.file_digest(package_dir / aot.PACKAGE_NAME)
    assert set(manifest["constants"]) == set(tiny_weights())
    assert manifest["weight_scheme"] == "dense"       # the scheme of the weights it binds
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
    for old in (1, 2):   # without ranges; a forward without logit_pos: rebuilt, never used
        (tmp_path / aot.MANIFEST_NAME).write_text(json.dumps({"format": old}))
        with pytest.raises(InvalidCheckpoint, match=f"format {old} is not 3.*rewarm build") as err:
            aot.read_package_manifest(tmp_path)
        assert err.value.value == old and err.value.limit == aot.PACKAGE_FORMAT
    (tmp_path / aot.MANIFEST_NAME).write_text(json.dumps({"format": aot.PACKAGE_FORMAT}))
    with pytest.raises(InvalidCheckpoint, match="target"):
        aot.read_package_manifest(tmp_path)
    good = {"format": aot.PACKAGE_FORMAT, "target": "t", "digest": "d", "constants": {}, "max_seqs": 4,
            "max_seq_len": 32, "config": {}, "kv": {}}
    for ranges in ({"batch": [1, 4], "seq": [1, 32]}, {"batch": [0, 4], "seq": [1, 32], "cache_batch": [1, 4]},
                   {"batch": [1, 4], "seq": [5, 2], "cache_batch": [1, 4]},
                   {"batch": [1, 4], "seq": [1, True], "cache_batch": [1, 4]}):
        (tmp_path / aot.MANIFEST_NAME).write_text(json.dumps({**good, "ranges": ranges}))
        with pytest.raises(InvalidCheckpoint, match="range"):
            aot.read_package_manifest(tmp_path)
    (tmp_path / aot.MANIFEST_NAME).write_bytes(b" " * (aot.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(InvalidCheckpoint) as err:
        aot.read_package_manifest(tmp_path)
    assert err.value.limit == aot.MAX_MANIFEST_BYTES


def test_sizes_out_of_range_are_refused_before_compiling(tmp_path):
    with pytest.raises(ConfigError) as err:
        aot.build_from_weights(tiny_config(), tiny_weights(), tmp_path, max_seq_len=65)
    assert err.value.limit == 64
    with pytest.raises(ConfigError):   # a seq range of [1, 1] would be exported as static
        aot.build_from_weights(tiny_config(), tiny_weights(), tmp_path, max_seq_len=1)
    with pytest.raises(ConfigError):
        aot.build_from_weights(tiny_config(), tiny_weights(), tmp_path, max_seqs=0)


# --- the compiled ranges: every shape the engine uses, checked at build and at every call ------

@pytest.mark.slow
def test_ranges_start_at_one_and_the_build_checked_their_edges(release):
    package_dir = aot.find_package(release)
    manifest = aot.read_package_manifest(package_dir)
    assert manifest["ranges"] == {"batch": [1, MAX_SEQS], "seq": [1, MAX_SEQ_LEN],
                                  "cache_batch": [1, MAX_SEQS]}
    cfg = tiny_config()
    assert manifest["kv"] == {"layers": 2, "max_seq_len": MAX_SEQ_LEN, "kv_heads": 2,
                              "head_dim": cfg.head_dim, "dtype": "float32"}
    runs = manifest["checked"]["runs"]
    assert manifest["checked"]["env"] == "AOTI_RUNTIME_CHECK_INPUTS=1"
    assert [(r["batch"], r["seq"], r["cache_batch"], r["logits"]) for r in runs] == [
        (1, 1, 1, 1), (1, MAX_SEQ_LEN, 1, 1), (1, MAX_SEQ_LEN, 1, MAX_SEQ_LEN),
        (MAX_SEQS, 1, MAX_SEQS, 1)]
    assert all(0 <= r["error"] <= r["limit"] and r["eager_error"] >= 0 for r in runs)
    # The same ranges are compiled into the package itself (covered by its digest).
    loader = torch._C._aoti.AOTIModelPackageLoader(str(package_dir / aot.PACKAGE_NAME), "model",
                                                   False, 1, -1)
    assert json.loads(loader.get_metadata()[aot.RANGES_METADATA]) == manifest["ranges"]


@pytest.mark.slow
@pytest.mark.parametrize("B,S,C,K", [(1, 1, 1, 1), (1, MAX_SEQ_LEN, 1, 1),
                                     (1, MAX_SEQ_LEN, 1, MAX_SEQ_LEN), (MAX_SEQS, 1, MAX_SEQS, 1)])
def test_every_edge_runs_with_aoti_input_checks_on(release, B, S, C, K):
    with aot_check.input_checks_on():   # read at a loaded package's first call: load inside
        packaged = aot.load_package(release, tiny_weights())
        got, _, _ = run(packaged, None, B, S, C, K=K)
    want, _, _ = run(Transformer.from_weights(tiny_config(), tiny_weights()), None, B, S, C, K=K)
    assert torch.allclose(got, want, atol=1e-5)


def _call_args(B=2, S=3, C=MAX_SEQS, dtype=torch.float32, K=1):
    cfg = tiny_config()
    tokens = torch.randint(0, cfg.vocab_size, (B, S))
    k, v = new_kv_caches(cfg, C, MAX_SEQ_LEN)
    k, v = [c.to(dtype) for c in k], [c.to(dtype) for c in v]
    return [tokens, torch.arange(S).repeat(B, 1), torch.arange(B), k, v,
            torch.full((B, K), S - 1, dtype=torch.int64)]


@pytest.mark.slow
def test_wrong_calls_are_refused_before_running_and_the_package_stays_usable(release):
    packaged = aot.load_package(release, tiny_weights())
    eager = Transformer.from_weights(tiny_config(), tiny_weights())

    def wrong(field, mutate, value, limit=None):
        args = _call_args()
        mutate(args)
        with pytest.raises(PackageInputError) as err:
            packaged(*args)
        assert err.value.field == field and err.value.value == value, str(err.value)
        if limit is not None:
            assert err.value.limit == limit
        assert str(value) in str(err.value)
        # Nothing ran: the next, correct call gives eager's logits.
        assert torch.allclose(run(packaged, None, 2, 3, 4)[0], run(eager, None, 2, 3, 4)[0], atol=1e-5)

    # The batch of 5 on a package built for 4, and one position too many.
    wrong("batch", lambda a: a.__setitem__(slice(0, 3), _call_args(B=5, C=5)[:3]), 5, [1, MAX_SEQS])
    wrong("seq", lambda a: a.__setitem__(slice(0, 3), _call_args(S=MAX_SEQ_LEN + 1)[:3]),
          MAX_SEQ_LEN + 1, [1, MAX_SEQ_LEN])
    wrong("cache_batch", lambda a: a.__setitem__(slice(3, 5), _call_args(C=MAX_SEQS + 1)[3:5]),
          MAX_SEQS + 1, [1, MAX_SEQS])
    # Rank, dtype (a float16 KV cache would be read and written as float32), device.
    wrong("rank", lambda a: a.__setitem__(0, a[0].flatten()), 1, 2)
    wrong("dtype", lambda a: a.__setitem__(slice(3, 5), _call_args(dtype=torch.float16)[3:5]),
          "torch.float16", "torch.float32")
    wrong("dtype", lambda a: a.__setitem__(1, a[1].to(torch.int32)), "torch.int32", "torch.int64")
    wrong("device", lambda a: a.__setitem__(0, a[0].to("meta")), "meta", "cpu")
    wrong("device", lambda a: a[4].__setitem__(1, a[4][1].to("meta")), "meta", "cpu")
    # Fixed sizes, layout, the number of layers, shapes that disagree.
    wrong("shape", lambda a: a[3].__setitem__(1, torch.zeros(MAX_SEQS, MAX_SEQ_LEN, 2, 4)),
          (MAX_SEQS, MAX_SEQ_LEN, 2, 4), (MAX_SEQS, MAX_SEQ_LEN, 2, tiny_config().head_dim))
    wrong("length", lambda a: a.__setitem__(3, a[3][:1]), 1, 2)
    wrong("shape", lambda a: a.__setitem__(1, a[1][:, :2].contiguous()), (2, 2), (2, 3))
    # Index values that would address memory outside the caches.
    wrong("value", lambda a: a.__setitem__(2, torch.tensor([0, MAX_SEQS])), MAX_SEQS, [0, MAX_SEQS - 1])
    wrong("value", lambda a: a.__setitem__(2, torch.tensor([-1, 0])), -1, [0, MAX_SEQS - 1])
    wrong("value", lambda a: a[1].__setitem__((1, 2), MAX_SEQ_LEN), MAX_SEQ_LEN, [0, MAX_SEQ_LEN - 1])
    # Logit positions: one row too few, more than the compiled K, outside the call's S = 3
    # (the compiled gather would read another row's or another call's memory).
    wrong("batch", lambda a: a.__setitem__(5, a[5][:1]), 1, 2)
    wrong("logits", lambda a: a.__setitem__(5, _call_args(K=MAX_SEQ_LEN + 1)[5]),
          MAX_SEQ_LEN + 1, [1, MAX_SEQ_LEN])
    wrong("value", lambda a: a[5].__setitem__((1, 0), 3), 3, [0, 2])
    wrong("value", lambda a: a[5].__setitem__((0, 0), -1), -1, [0, 2])
    wrong("dtype", lambda a: a.__setitem__(5, a[5].to(torch.int32)), "torch.int32", "torch.int64")
    wrong("rank", lambda a: a.__setitem__(5, a[5].flatten()), 1, 2)


@pytest.mark.slow
def test_non_contiguous_cache_is_refused(release):
    packaged = aot.load_package(release, tiny_weights())
    args = _call_args()
    args[3][0] = args[3][0].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(PackageInputError) as err:
        packaged(*args)
    assert err.value.field == "strides" and err.value.argument == "k_caches[0]"


@pytest.mark.slow
def test_manifest_ranges_wider_than_compiled_are_refused(release, tmp_path):
    fake = tmp_path / "pkg"
    shutil.copytree(aot.find_package(release), fake)
    manifest = json.loads((fake / aot.MANIFEST_NAME).read_text())
    manifest["ranges"]["batch"] = [1, 64]
    (fake / aot.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(InvalidCheckpoint) as err:
        aot.load_package(fake, tiny_weights())
    assert err.value.field == "ranges"


@pytest.mark.slow
def test_build_check_fails_when_the_package_disagrees_with_eager(release):
    package = aot.find_package(release) / aot.PACKAGE_NAME
    ranges = {"batch": (1, MAX_SEQS), "seq": (1, MAX_SEQ_LEN), "cache_batch": (1, MAX_SEQS)}
    other = Transformer.from_weights(tiny_config(), tiny_weights(seed=3))
    with pytest.raises(PackageCheckFailed) as err:   # the package bound to other weights than eager's
        aot_check.check_package(package, other, tiny_weights(), ranges, MAX_SEQ_LEN)
    assert err.value.field == "logits"
    assert err.value.sizes == {"batch": 1, "seq": 1, "cache_batch": 1, "logits": 1}
    assert err.value.value > err.value.limit
    wider = {**ranges, "seq": (1, MAX_SEQ_LEN + 8)}
    with pytest.raises(PackageCheckFailed) as err:    # a range the package was not compiled for
        aot_check.check_package(package, Transformer.from_weights(tiny_config(), tiny_weights()),
                                tiny_weights(), wider, MAX_SEQ_LEN + 8)
    assert err.value.field == "shape"


def test_corner_sizes_cover_each_range_edge():
    ranges = {"batch": (1, 8), "seq": (1, 512), "cache_batch": (1, 8)}
    corners = aot_check.corner_sizes(ranges)
    for name, (lo, hi) in {**ranges, "logits": ranges["seq"]}.items():
        assert {c[name] for c in corners} == {lo, hi}
    assert all(c["batch"] <= c["cache_batch"] for c in corners)
    # serving's prefill shape, the last position of a long call, is one of them
    assert {"batch": 1, "seq": 512, "cache_batch": 1, "logits": 1} in corners


def test_export_declares_k_its_own_size_over_the_seq_range():
    """``logit_pos`` [B, K] shares B with the other inputs and has its own K, asked over S's
    range; the examples are 2 each (a size of 1 would be specialised)."""
    from torch.export import Dim

    shapes = aot.dynamic_shapes(tiny_config(), MAX_SEQS, MAX_SEQ_LEN)
    assert len(shapes) == len(aot.FORWARD_INPUTS)
    batch, logits = shapes[-1][0], shapes[-1][1]
    assert batch is shapes[0][0] and logits is not shapes[0][1]
    assert isinstance(logits, Dim) and (logits.min, logits.max) == (1, MAX_SEQ_LEN)
    assert aot.exported_ask(aot.size_ranges(MAX_SEQS, MAX_SEQ_LEN))["logits"] == (1, MAX_SEQ_LEN)
    example = aot.example_inputs(tiny_config(), MAX_SEQS, MAX_SEQ_LEN)
    assert example[-1].tolist() == [[0, 1], [0, 1]]


class _Loader:
    """A package runner's call spec only (``AOTIModelPackageLoader.get_call_spec``)."""

    def __init__(self, args):
        from torch.utils import _pytree as pytree

        self.spec = [pytree.treespec_dumps(pytree.tree_flatten((args, {}))[1]), "out"]

    def get_call_spec(self):
        return self.spec


def test_a_package_compiled_for_other_inputs_is_refused_at_load(tmp_path):
    """The package's own input spec must be the forward's six inputs with the caches as two
    lists of ``layers``: a package of the forward without ``logit_pos`` (one input fewer),
    or of another depth, would be handed inputs it does not take."""
    layers = 2
    aot.check_call_spec(_Loader((0, 0, 0, [0] * layers, [0] * layers, 0)), layers, tmp_path)
    want = "tensor, tensor, tensor, list of 2 tensors, list of 2 tensors, tensor"
    for args, have in (((0, 0, 0, [0] * layers, [0] * layers),          # the forward before K
                        "tensor, tensor, tensor, list of 2 tensors, list of 2 tensors"),
                       ((0, 0, 0, [0] * 3, [0] * 3, 0),                  # another depth
                        "tensor, tensor, tensor, list of 3 tensors, list of 3 tensors, tensor"),
                       ((0, 0, 0, [0] * layers, [0] * layers, 0, 0), want + ", tensor")):
        with pytest.raises(InvalidCheckpoint, match="rewarm build") as err:
            aot.check_call_spec(_Loader(args), layers, tmp_path)
        assert err.value.field == "inputs"
        assert (err.value.value, err.value.limit) == (have, want)
        assert f"compiled for inputs ({have})" in str(err.value)
    broken = _Loader(())
    broken.spec = ["not a spec", "out"]
    with pytest.raises(InvalidCheckpoint, match="call spec") as err:
        aot.check_call_spec(broken, layers, tmp_path)
    assert err.value.field == "inputs"


@pytest.mark.parametrize("stage", ["export", "compile"])
def test_a_build_that_torch_cannot_finish_names_its_stage_and_error(tmp_path, monkeypatch, stage):
    from agent.errors import PackageBuildFailed

    def fail(*args, **kwargs):
        raise RuntimeError("Triton compilation failed: kernel triton_poi_0\nptxas fatal")
    if stage == "export":
        monkeypatch.setattr(torch.export, "export", fail)
    else:
        monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fail)
    with pytest.raises(PackageBuildFailed) as err:
        aot.build_from_weights(tiny_config(), tiny_weights(), tmp_path, max_seqs=2,
                               max_seq_len=8)
    exc = err.value
    assert exc.stage == stage and exc.target == current_target()
    assert exc.error == ("RuntimeError: Triton compilation failed: kernel triton_poi_0 | "
                         "ptxas fatal")
    assert f"failed at {stage}: RuntimeError" in str(exc)
    assert isinstance(exc.__cause__, RuntimeError)
    assert not list(tmp_path.rglob("*.pt2"))        # nothing left to be mistaken for a package


def test_a_gpu_runs_an_int4_checkpoint_dense_in_its_dtype(monkeypatch):
    import dataclasses

    from agent.replica import quant

    config = dataclasses.replace(tiny_config(), dtype="bfloat16")
    gen = torch.Generator().manual_seed(2)
    n, k = 64, 128
    parts = {".qweight": quant.pack_nibbles(torch.randint(0, 16, (n, k), generator=gen,
                                                          dtype=torch.int32)),
             ".scales_and_zeros": torch.stack([torch.rand(k // 32, n, generator=gen) * 0.1,
                                               torch.randn(k // 32, n, generator=gen) * 0.1], -1)}
    packed = {"layers.0.feed_forward.w2" + s: t
              for s, t in quant.to_runtime(parts, torch.bfloat16).items()}
    packed["norm.weight"] = torch.ones(32, dtype=torch.bfloat16)
    assert quant.scheme_of(packed) == "int4"
    assert aot.weights_for_device(packed, config, "cpu") == packed          # the CPU runs it
    moved, real_to = [], torch.Tensor.to

    def to(self, *args, **kwargs):      # no GPU here: note what would move, keep it on the host
        if args == ("cuda:1",):
            moved.append(self.dtype)
            return self
        return real_to(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "to", to)
    out = aot.weights_for_device(packed, config, "cuda:1")
    assert set(out) == {"layers.0.feed_forward.w2.weight", "norm.weight"}
    assert moved == [torch.bfloat16, torch.bfloat16]
    want = quant.dequantize_hf(parts)
    assert torch.allclose(out["layers.0.feed_forward.w2.weight"].float(), want, atol=2e-2)


def test_the_runner_is_opened_on_the_devices_own_index(monkeypatch):
    opened = []
    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader",
                        lambda *args: opened.append(args))
    for device in ("cpu", "cuda", "cuda:2"):
        aot_check.load_runner("p.pt2", device)
    assert [a[-1] for a in opened] == [-1, -1, 2]
    assert {a[:4] for a in opened} == {("p.pt2", "model", False, 1)}
