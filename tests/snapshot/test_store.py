import pytest

from agent.clock import ManualClock
from agent.errors import ConfigError, DiskFull, SnapshotNotFound
from agent.snapshot.store import LocalStore, dir_size_bytes


def put(store, sid, model, size):
    d = store.path(sid)
    d.mkdir()
    (d / "data-00000.bin").write_bytes(b"x" * size)
    return store.add(sid, model)


@pytest.fixture
def store(tmp_path):
    evicted = []
    s = LocalStore(tmp_path / "nvme", 1000, clock=ManualClock(), half_life_s=100.0,
                   on_evict=evicted.append)
    s.evicted = evicted
    return s


def test_add_measures_size(store):
    e = put(store, "a", "m@1", 300)
    assert e.size_bytes == 300 == dir_size_bytes(store.path("a"))
    assert store.used_bytes == 300
    with pytest.raises(SnapshotNotFound):
        store.add("missing", "m@1")
    with pytest.raises(ConfigError):
        store.path("../x")


def test_score_decays_with_half_life(store):
    assert store.record_restore("m@1") == 1.0
    store.clock.advance(100.0)
    assert store.score("m@1") == pytest.approx(0.5)
    assert store.record_restore("m@1") == pytest.approx(1.5)
    store.clock.advance(200.0)
    assert store.score("m@1") == pytest.approx(0.375)
    assert store.score("never") == 0.0


def test_exact_fit_evicts_nothing(store):
    put(store, "a", "m@1", 400)
    assert store.make_room(600) == []
    assert store.has("a")


def test_evicts_least_expected_reuse_first(store):
    put(store, "hot", "hot@1", 400)
    put(store, "cold", "cold@1", 400)
    for _ in range(3):
        store.record_restore("hot@1")
    store.record_restore("cold@1")
    assert store.make_room(201) == ["cold"]  # 200 free; one more byte needs an eviction
    assert store.evicted == ["cold"]
    assert not store.path("cold").exists()
    assert store.has("hot") and store.used_bytes == 400


def test_recent_beats_old_frequent(store):
    put(store, "old", "old@1", 500)
    put(store, "new", "new@1", 500)
    for _ in range(4):
        store.record_restore("old@1")
    store.clock.advance(500.0)          # 4 * 2^-5 = 0.125
    store.record_restore("new@1")       # 1.0
    assert [e.snapshot_id for e in store.evictable()] == ["old", "new"]


def test_pinned_and_read_snapshots_stay(store):
    put(store, "pinned", "p@1", 400)
    put(store, "busy", "b@1", 400)
    store.pin("p@1", until_s=50.0)
    with store.reading("busy"):
        with pytest.raises(DiskFull) as info:
            store.make_room(300)
        assert (info.value.needed_bytes, info.value.free_bytes) == (300, 200)
        assert store.has("pinned") and store.has("busy")
        assert store.remove("busy") is False
    assert store.make_room(300) == ["busy"]
    store.clock.advance(49.999)
    assert store.evictable() == []
    store.clock.advance(0.001)  # the pin ends at until_s
    assert [e.snapshot_id for e in store.evictable()] == ["pinned"]
    store.pin("p@1", until_s=100.0)
    assert store.evictable() == []
    store.unpin("p@1")
    assert [e.snapshot_id for e in store.evictable()] == ["pinned"]


def test_reading_unknown_raises(store):
    with pytest.raises(SnapshotNotFound):
        with store.reading("nope"):
            pass


def test_need_over_capacity_is_disk_full(store):
    with pytest.raises(DiskFull) as info:
        store.make_room(1001)
    assert info.value.needed_bytes == 1001


@pytest.mark.parametrize("kw", [{"capacity_bytes": 0}, {"capacity_bytes": 10, "half_life_s": 0}])
def test_config_validated(tmp_path, kw):
    with pytest.raises(ConfigError):
        LocalStore(tmp_path, **kw)
