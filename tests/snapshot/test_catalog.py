import sqlite3

import pytest

from agent.clock import ManualClock
from agent.errors import SnapshotNotFound
from agent.snapshot.catalog import Catalog, StatusRegression


@pytest.fixture
def cat():
    return Catalog(":memory:", clock=ManualClock(100.0))


def add(cat, sid, version="1", status="pending", model="m"):
    return cat.add_snapshot(sid, model_name=model, model_version=version, path=f"/s/{sid}",
                            pins={"cuda_driver": "570.1", "torch": "2.13"}, size_bytes=4096,
                            digest="ab" * 16, status=status)


def test_snapshot_roundtrip_and_pins(cat):
    row = add(cat, "a")
    assert (row.status, row.driver_version, row.size_bytes) == ("pending", "570.1", 4096)
    assert row.pins == {"cuda_driver": "570.1", "torch": "2.13"}
    assert row.created_s == 100.0


def test_newest_ready_picks_latest_ready_of_that_version(cat):
    clock = cat.clock
    add(cat, "old", status="ready")
    clock.advance(1)
    add(cat, "new", status="ready")
    clock.advance(1)
    add(cat, "pending")
    add(cat, "other-version", version="2", status="ready")
    assert cat.newest_ready("m", "1").snapshot_id == "new"
    cat.set_status("new", "corrupt", "chunk 3 checksum")
    assert cat.newest_ready("m", "1").snapshot_id == "old"
    assert cat.snapshot("new").reason == "chunk 3 checksum"
    assert cat.newest_ready("m", "9") is None


@pytest.mark.parametrize("start,to,ok", [
    ("pending", "ready", True), ("pending", "corrupt", True), ("ready", "stale", True),
    ("ready", "pending", False), ("corrupt", "ready", False), ("stale", "ready", False),
    ("corrupt", "stale", False)])
def test_status_moves_forward_only(cat, start, to, ok):
    add(cat, "s", status=start)
    if ok:
        assert cat.set_status("s", to).status == to
    else:
        with pytest.raises(StatusRegression) as info:
            cat.set_status("s", to)
        assert info.value.value == (start, to)
        assert cat.snapshot("s").status == start


def test_unknown_and_bad_inputs(cat):
    with pytest.raises(SnapshotNotFound):
        cat.snapshot("nope")
    with pytest.raises(SnapshotNotFound):
        cat.set_status("nope", "ready")
    with pytest.raises(ValueError):
        add(cat, "x", status="warm")
    add(cat, "dup")
    with pytest.raises(sqlite3.IntegrityError):
        add(cat, "dup")


def test_durable_ready_needs_remote_copy(cat):
    add(cat, "a", status="ready")
    assert not cat.durable_ready("m")
    cat.set_remote("a", "remote/m/a")
    assert cat.durable_ready("m")
    cat.set_status("a", "stale")
    assert not cat.durable_ready("m")


def test_replicas_and_events(cat):
    add(cat, "a", status="ready")
    cat.upsert_replica("r1", model_name="m", model_version="1", node_id="n", device="cpu",
                       state="restoring", snapshot_id="a")
    cat.upsert_replica("r1", model_name="m", model_version="1", node_id="n", device="cpu",
                       state="warm")
    assert cat.replica("r1")["state"] == "warm"
    assert cat.replica("r1")["snapshot_id"] == "a"
    assert [r["replica_id"] for r in cat.replicas("m", ["warm"])] == ["r1"]
    assert cat.replicas("m", ["dead"]) == []
    cat.remove_snapshot("a")
    assert cat.replica("r1")["snapshot_id"] is None
    cat.record_cold_start("m", "restore", "ok", 0.25, "r1")
    ev = cat.cold_starts("m")
    assert (ev[0]["path"], ev[0]["duration_s"], ev[0]["at_s"]) == ("restore", 0.25, 100.0)


def test_forecast_rows_replace_per_window(cat):
    cat.record_forecast("m", 60.0, 2.5, None, 1)
    cat.record_forecast("m", 60.0, 3.0, 2.0, 2)
    cat.record_forecast("m", 120.0, 1.0, None, 1)
    rows = cat.forecasts("m")
    assert [(r["window_start_s"], r["forecast_rps"], r["actual_rps"], r["target_replicas"])
            for r in rows] == [(60.0, 3.0, 2.0, 2), (120.0, 1.0, None, 1)]


def test_file_catalog_persists(tmp_path):
    c = Catalog(tmp_path / "cat.db", clock=ManualClock())
    add(c, "a", status="ready")
    c.close()
    assert Catalog(tmp_path / "cat.db").newest_ready("m", "1").snapshot_id == "a"


def test_a_catalog_that_cannot_be_opened_is_a_config_error_naming_it(tmp_path):
    from agent.errors import ConfigError

    not_a_db = tmp_path / "c.db"
    not_a_db.write_bytes(b"this is not an SQLite file" * 100)
    for path in (tmp_path / "missing-dir" / "c.db", not_a_db):
        with pytest.raises(ConfigError) as err:
            Catalog(path)
        assert err.value.value == str(path) and str(path) in str(err.value)
