"""The AOT path end to end: boot with a package, capture, restore binding the package by digest."""

import json
import shutil

import pytest

from agent.replica import aot, zygote
from agent.replica.synthetic import make_synthetic
from agent.snapshot.reader import read_manifest


@pytest.mark.slow
def test_aot_boot_capture_and_restore_bind_the_package_and_match_eager(tmp_path, monkeypatch):
    # Booted and restored with AOTInductor's own input checks on: the engine's B=1 prefills
    # and S=1 decodes are inside the compiled ranges (the generated code reads the variable at
    # each loaded package's first call).
    monkeypatch.setenv("AOTI_RUNTIME_CHECK_INPUTS", "1")
    model_dir = make_synthetic(tmp_path / "tiny", "tiny", seed=5)
    release = tmp_path / "release"
    package_dir = aot.build(model_dir, release, max_seqs=4, max_seq_len=64)
    eager = zygote.boot(model_dir, max_seqs=4, max_seq_len=64)
    booted = zygote.boot(model_dir, release=release)
    assert booted.path == "aot" and booted.package_digest == aot.file_digest(package_dir / aot.PACKAGE_NAME)
    assert booted.golden == eager.golden  # compiled code gives the eager tokens
    snap = tmp_path / "snap"
    zygote.capture(booted, snap)
    ref = read_manifest(snap).extra["aot_package"]
    assert ref["digest"] == booted.package_digest
    assert ref["ranges"] == {"batch": [1, 4], "seq": [1, 64], "cache_batch": [1, 4]}
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False)
    restored = zygote.restore(snap, buffer=buffer, path="zygote_restore")
    assert restored.path == "zygote_restore" and restored.package_digest == booted.package_digest
    assert restored.engine.model is None  # the package, not the eager module, runs
    prompt = [7, 7, 1, 2, 3]
    assert restored.engine.generate([prompt], 10) == eager.engine.generate([prompt], 10)
    # The serving path too: prompts prefilled alone (B=1), decoded together.
    prompts = [prompt, [9], [1, 2, 3, 4, 5, 6, 7, 8]]
    assert restored.engine.generate(prompts, 6, seed=3) == eager.engine.generate(prompts, 6, seed=3)

    # A package for another target is not used: the restore serves eager, still golden-checked.
    manifest = json.loads((package_dir / aot.MANIFEST_NAME).read_text())
    manifest["target"] = "riscv64-default"
    moved = tmp_path / "other" / "riscv64-default"
    shutil.copytree(package_dir, moved)
    (moved / aot.MANIFEST_NAME).write_text(json.dumps(manifest))
    fallback = zygote.restore(snap, release=moved.parent)
    assert fallback.package_digest is None and fallback.engine.model is not None
    assert fallback.engine.generate([prompt], 10) == eager.engine.generate([prompt], 10)


@pytest.mark.slow
def test_snapshot_engine_outside_the_package_ranges_serves_eager(tmp_path):
    """A snapshot whose engine the package was not compiled for (more slots, other T) is
    restored eager, still golden-checked, never run through the package."""
    from agent.replica.zygote import check_package_fits
    from agent.errors import TargetMismatch

    model_dir = make_synthetic(tmp_path / "tiny", "tiny", seed=5)
    release = tmp_path / "release"
    aot.build(model_dir, release, max_seqs=2, max_seq_len=16)
    booted = zygote.boot(model_dir, release=release)
    forward = booted.engine.forward
    check_package_fits(forward, {"max_seqs": 2, "max_seq_len": 16}, booted.package_ranges, "s")
    for engine in ({"max_seqs": 3, "max_seq_len": 16}, {"max_seqs": 2, "max_seq_len": 32}):
        with pytest.raises(TargetMismatch):
            check_package_fits(forward, engine, None, "s")
    with pytest.raises(TargetMismatch):
        check_package_fits(forward, {"max_seqs": 2, "max_seq_len": 16},
                           {**booted.package_ranges, "seq": [1, 99]}, "s")
    snap = tmp_path / "snap"
    booted.engine.kv = type(booted.engine.kv)(3, 16)   # a snapshot claiming 3 slots
    zygote.capture(booted, snap)
    restored = zygote.restore(snap)
    assert restored.package_digest is None and restored.engine.model is not None
