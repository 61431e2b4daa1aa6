"""The AOT path end to end: boot with a package, capture, restore binding the package by digest."""

import json
import shutil

import pytest

from agent.replica import aot, zygote
from agent.replica.synthetic import make_synthetic
from agent.snapshot.reader import read_manifest


@pytest.mark.slow
def test_aot_boot_capture_and_restore_bind_the_package_and_match_eager(tmp_path):
    model_dir = make_synthetic(tmp_path / "tiny", "tiny", seed=5)
    release = tmp_path / "release"
    package_dir = aot.build(model_dir, release, max_seqs=4, max_seq_len=64)
    eager = zygote.boot(model_dir, max_seqs=4, max_seq_len=64)
    booted = zygote.boot(model_dir, release=release)
    assert booted.path == "aot" and booted.package_digest == aot.file_digest(package_dir / aot.PACKAGE_NAME)
    assert booted.golden == eager.golden  # compiled code gives the eager tokens
    snap = tmp_path / "snap"
    zygote.capture(booted, snap)
    assert read_manifest(snap).extra["aot_package"]["digest"] == booted.package_digest
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False)
    restored = zygote.restore(snap, buffer=buffer, path="zygote_restore")
    assert restored.path == "zygote_restore" and restored.package_digest == booted.package_digest
    assert restored.engine.model is None  # the package, not the eager module, runs
    prompt = [7, 7, 1, 2, 3]
    assert restored.engine.generate([prompt], 10) == eager.engine.generate([prompt], 10)

    # A package for another target is not used: the restore serves eager, still golden-checked.
    manifest = json.loads((package_dir / aot.MANIFEST_NAME).read_text())
    manifest["target"] = "riscv64-default"
    moved = tmp_path / "other" / "riscv64-default"
    shutil.copytree(package_dir, moved)
    (moved / aot.MANIFEST_NAME).write_text(json.dumps(manifest))
    fallback = zygote.restore(snap, release=moved.parent)
    assert fallback.package_digest is None and fallback.engine.model is not None
    assert fallback.engine.generate([prompt], 10) == eager.engine.generate([prompt], 10)
