"""A zygote warmed for a snapshot: first-call costs paid ahead of need, nothing trusted from it."""

import pytest

from agent.errors import GoldenMismatch
from agent.replica import zygote


@pytest.fixture(scope="module")
def snapshots(two_snapshots):
    return two_snapshots


def test_a_warmed_zygote_restores_into_the_engine_it_made_and_still_checks(snapshots):
    snap, booted = snapshots[1]
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False, warm=snap)
    warmed = zygote._WARMED[buffer]
    # Warmed on the zeroed buffer: the engine's weights are views of it, not the model's yet.
    assert float(warmed.engine.model.norm.weight.abs().sum()) == 0.0
    restored = zygote.restore(snap, buffer=buffer, path="zygote_restore")
    assert restored.engine is warmed.engine            # no second engine, no second warm-up
    assert buffer not in zygote._WARMED                 # used once
    assert restored.golden == booted.golden             # replayed on the restored weights
    prompt = [3, 1, 4, 1, 5]
    assert restored.engine.generate([prompt], 6, seed=9) == booted.engine.generate([prompt], 6, seed=9)


def test_warmed_for_another_snapshot_layout_is_not_reused(snapshots):
    (snap1, _), (snap2, booted2) = snapshots[1], snapshots[2]
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False, warm=snap1)
    warmed = zygote._WARMED[buffer]
    restored = zygote.restore(snap2, buffer=buffer)
    assert restored.engine is not warmed.engine and restored.golden == booted2.golden


def test_a_snapshot_that_cannot_be_warmed_leaves_a_plain_zygote(snapshots, tmp_path):
    snap, booted = snapshots[1]
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False, warm=tmp_path / "missing")
    assert buffer not in zygote._WARMED
    small = zygote.prepare_zygote(1, 4096, prefault=False, warm=snap)   # does not fit
    assert small not in zygote._WARMED
    assert zygote.restore(snap, buffer=buffer).golden == booted.golden


def test_the_golden_check_still_guards_a_warmed_restore(snapshots, tmp_path):
    import shutil

    snap, _ = snapshots[1]
    bad = tmp_path / "bad"
    shutil.copytree(snap, bad)
    import dataclasses

    from agent.snapshot.format import MANIFEST_NAME
    from agent.snapshot.manifest import encode_manifest, read_manifest

    manifest = read_manifest(bad)   # unsigned: a recomputed digest is accepted, the tokens are not
    expected = [list(e) for e in manifest.golden.expected]
    expected[0][0] = (expected[0][0] + 1) % 256
    golden = dataclasses.replace(manifest.golden, expected=expected)
    (bad / MANIFEST_NAME).write_bytes(encode_manifest(dataclasses.replace(manifest, golden=golden)))
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False, warm=bad)
    assert buffer in zygote._WARMED
    with pytest.raises(GoldenMismatch):
        zygote.restore(bad, buffer=buffer)


def test_a_warmed_restore_says_so_and_where_the_checks_time_went(snapshots):
    import threading

    snap, _ = snapshots[1]
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False, warm=snap)
    restored = zygote.restore(snap, buffer=buffer, path="zygote_restore")
    warm = restored.warm
    me = threading.current_thread().name
    assert warm["engine"] == "reused" and "why" not in warm
    assert warm["thread"] == warm["warm_thread"] == warm["golden_thread"] == me
    assert warm["warm_s"] > 0
    parts = [restored.phases_s[f"golden_{p}"] for p in ("prefill_s", "decode_s", "sample_s")]
    assert all(p > 0 for p in parts)
    assert sum(parts) <= restored.phases_s["golden_s"]


def test_a_zygote_without_a_snapshot_warms_its_device_and_the_restore_says_why_it_built(
        snapshots):
    from agent.replica import warmup

    snap, booted = snapshots[1]
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False)         # nothing to warm for
    record = warmup.warm_device("cpu")          # done once per thread: the zygote's record
    assert record["calls"] >= 4 and "error" not in record
    assert warmup.warm_device("cpu") is record
    restored = zygote.restore(snap, buffer=buffer, path="zygote_restore")
    assert restored.warm["engine"] == "built"
    assert restored.warm["why"] == "the zygote was not told a snapshot to warm for"
    assert restored.warm["device"]["calls"] == record["calls"]
    assert restored.golden == booted.golden


@pytest.mark.parametrize("why", ["failed", "another"])
def test_a_restore_built_anew_names_the_reason(snapshots, tmp_path, why):
    snap1, snap2 = snapshots[1][0], snapshots[2][0]
    warm = tmp_path / "missing" if why == "failed" else snap1
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False, warm=warm)
    restored = zygote.restore(snap2, buffer=buffer)
    assert restored.warm["engine"] == "built"
    expected = (f"warm-up for {warm} failed: SnapshotNotFound" if why == "failed"
                else f"warmed for {snap1}, whose layout differs")
    assert restored.warm["why"].startswith(expected)


def test_warming_runs_the_serving_shapes_outside_the_speed_meter(snapshots):
    snap, _ = snapshots[1]
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False, warm=snap)
    engine = zygote._WARMED[buffer].engine
    assert engine._next_id > 3               # the golden prompts and the serving prompts ran
    assert engine.meter.prefill_samples == engine.meter.decode_samples == 0
    assert not engine.busy and engine.kv.active == 0


def test_a_device_warm_up_that_fails_is_recorded_not_raised(monkeypatch):
    import threading

    from agent.replica import warmup

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: out of memory")
    monkeypatch.setattr(warmup, "Engine", broken)
    out = {}
    t = threading.Thread(target=lambda: out.update(warmup.warm_device("cpu")), name="fresh")
    t.start()
    t.join()
    assert out["error"] == "RuntimeError: CUDA error: out of memory"
    assert out["thread"] == "fresh" and out["calls"] == 0


def test_a_failing_serving_warm_up_keeps_the_golden_warm_up(snapshots, monkeypatch, caplog):
    from agent.replica import speedmeter

    def broken(engine, **kwargs):
        raise TypeError("generate() got an unexpected keyword argument")
    monkeypatch.setattr(speedmeter, "boot_profile", broken)
    snap, booted = snapshots[1]
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False, warm=snap)
    assert buffer in zygote._WARMED and "serving shapes' warm-up failed (TypeError" in caplog.text
    restored = zygote.restore(snap, buffer=buffer)
    assert restored.warm["engine"] == "reused" and restored.golden == booted.golden
