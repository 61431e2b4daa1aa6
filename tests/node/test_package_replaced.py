"""A snapshot captured with an AOT package that a rebuild has since replaced is stale: the
ladder cold-boots and captures a new one, instead of cold-booting at every scale-up while the
old snapshot stays "ready" (met with `rewarm up` after an upgrade rebuilt the package)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from agent.errors import SnapshotIncompatible
from agent.node import ladder
from agent.replica.aot import PACKAGE_FORMAT


def package(tmp_path, digest: str):
    d = tmp_path / "pkg"
    d.mkdir(exist_ok=True)
    (d / "package.json").write_text(json.dumps({
        "format": PACKAGE_FORMAT, "target": "x", "digest": digest, "constants": {},
        "max_seqs": 2, "max_seq_len": 32, "config": {}, "kv": {},
        "ranges": {"batch": [1, 2], "cache_batch": [1, 2], "seq": [1, 32]}}))
    return d


def manifest(pkg, digest):
    return SimpleNamespace(extra={"aot_package": {"dir": str(pkg), "digest": digest}})


def test_a_package_rebuilt_in_place_makes_the_snapshot_stale(tmp_path):
    pkg = package(tmp_path, "sha256:new")
    with pytest.raises(SnapshotIncompatible) as err:
        ladder.check_package_current(manifest(pkg, "sha256:old"), tmp_path / "snap")
    assert err.value.mismatches == {"aot_package": ("sha256:old", "sha256:new")}
    ladder.check_package_current(manifest(pkg, "sha256:new"), tmp_path / "snap")   # current
    ladder.check_package_current(manifest(tmp_path / "gone", "sha256:old"), tmp_path)  # left to the restore
    ladder.check_package_current(SimpleNamespace(extra={}), tmp_path)                  # eager snapshot


def test_the_ladder_replaces_a_stale_snapshot_with_a_new_capture(make_agent, monkeypatch):
    agent = make_agent()
    agent.restore("tiny")
    key = agent.models["tiny"].key
    agent.captures[key].result(timeout=120)
    old = agent.state.catalog.newest_ready("tiny", agent.models["tiny"].version)
    for rec in list(agent.live_replicas("tiny")):
        agent.drain(rec.lifecycle.replica_id, force=True)

    def replaced(manifest, snap):
        if old.snapshot_id in str(snap):
            raise SnapshotIncompatible(f"{snap}: rebuilt", path=snap,
                                       mismatches={"aot_package": ("a", "b")})
    monkeypatch.setattr(ladder, "check_package_current", replaced)
    info = agent.restore("tiny")
    assert info["path"] == "cold_boot"
    assert agent.state.catalog.snapshot(old.snapshot_id).status == "stale"
    agent.captures[key].result(timeout=120)
    new = agent.state.catalog.newest_ready("tiny", agent.models["tiny"].version)
    assert new is not None and new.snapshot_id != old.snapshot_id
    for rec in list(agent.live_replicas("tiny")):
        agent.drain(rec.lifecycle.replica_id, force=True)
    assert agent.restore("tiny")["path"] == "restore"       # the new one restores


def test_a_package_manifest_that_is_not_a_regular_file_is_left_to_the_restore(tmp_path):
    import os

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    os.mkfifo(pkg / "package.json")        # reading it would block forever
    ladder.check_package_current(manifest(pkg, "sha256:old"), tmp_path / "snap")
    from agent.errors import InvalidCheckpoint
    from agent.replica.aot import read_package_manifest

    with pytest.raises(InvalidCheckpoint, match="not a regular file"):
        read_package_manifest(pkg)
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / "package.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidCheckpoint, match="not valid JSON"):
        read_package_manifest(tmp_path / "deep")
