"""`rewarm up`'s release reuse (agent/up.py prepare_release): a package is reused only when
this code built it for the model's weight scheme; anything else is rebuilt, not served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent import up
from agent.replica import aot


class FakeBuild:
    """Stands in for the ``rewarm build`` child: records its argv, exits 0."""

    calls: list[list[str]] = []

    def __init__(self, argv, **_kw) -> None:
        FakeBuild.calls.append(list(argv))
        self.returncode = 0

    def communicate(self):
        return "", None

    def poll(self):
        return self.returncode


@pytest.fixture
def model_dir(tmp_path) -> Path:
    from agent.replica.synthetic import make_synthetic

    return make_synthetic(tmp_path / "tiny", "tiny")


def write_package(release: Path, **overrides) -> None:
    manifest = {"format": aot.PACKAGE_FORMAT, "target": aot.current_target("cpu"),
                "digest": "0" * 64, "constants": {}, "max_seqs": 1, "max_seq_len": 16,
                "config": {}, "ranges": {k: list(v) for k, v in aot.size_ranges(1, 16).items()},
                "kv": {}, "weight_scheme": "dense",
                "source": aot.forward_source_digest(), **overrides}
    manifest = {k: v for k, v in manifest.items() if v is not None}
    release.mkdir(parents=True, exist_ok=True)
    (release / aot.MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.fixture(autouse=True)
def fake_build(monkeypatch):
    FakeBuild.calls = []
    monkeypatch.setattr(up.subprocess, "Popen", FakeBuild)


def test_a_package_this_code_built_for_the_scheme_is_reused(tmp_path, model_dir):
    release = tmp_path / "release"
    write_package(release)
    got, note = up.prepare_release(model_dir, release, cache_dir=tmp_path / "cache")
    assert (got, note) == (release, "aot (package reused)")
    assert FakeBuild.calls == []


@pytest.mark.parametrize("overrides", [
    {"source": "f" * 64},        # compiled from other forward code (an older rewarm)
    {"source": None},            # a package from before the source was recorded
    {"weight_scheme": "int4"},   # built for other weights than the model's
])
def test_a_stale_package_is_rebuilt(tmp_path, model_dir, overrides):
    release = tmp_path / "release"
    write_package(release, **overrides)
    got, note = up.prepare_release(model_dir, release, cache_dir=tmp_path / "cache")
    assert (got, note) == (release, "aot (package built)")
    assert len(FakeBuild.calls) == 1 and FakeBuild.calls[0][-2:] == ["--out", str(release)]


def test_the_source_digest_covers_each_forward_module(monkeypatch):
    """Leaving any one module out, or reading another file in its place, changes the digest:
    each is part of what a package is told apart by."""
    digest = aot.forward_source_digest()
    assert len(digest) == 64 and digest == aot.forward_source_digest()
    for name in aot.FORWARD_SOURCES:
        monkeypatch.setattr(aot, "FORWARD_SOURCES",
                            tuple(n for n in aot.FORWARD_SOURCES if n != name))
        assert aot.forward_source_digest() != digest, name
        monkeypatch.undo()
    monkeypatch.setattr(aot, "FORWARD_SOURCES", (*aot.FORWARD_SOURCES[:-1], "aot.py"))
    assert aot.forward_source_digest() != digest
