"""Every torch call of a replica process runs on its one engine thread: the load (boot,
restore, a zygote's warm-up) too, so the process holds one OpenMP team (worker.make_engine_thread)."""

import logging
import threading

import pytest

from agent.replica import worker as worker_mod
from agent.replica import zygote
from agent.replica.synthetic import make_synthetic


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    root = tmp_path_factory.mktemp("thread")
    booted = zygote.boot(make_synthetic(root / "m", "tiny", seed=4), max_seqs=2, max_seq_len=32)
    zygote.capture(booted, root / "snap")
    return root / "snap"


@pytest.fixture(scope="module")
def model_dir(snapshot):
    return snapshot.parent / "m"


def _run(monkeypatch, **mode) -> dict:
    """run_replica with its server replaced by a probe: which thread loaded, which serves."""
    seen: dict = {}
    load_fns = {"prepare_zygote": zygote.prepare_zygote, "restore": zygote.restore,
                "boot": zygote.boot}

    def recording(name):
        def fn(*args, **kwargs):
            seen[name] = threading.get_ident()
            return load_fns[name](*args, **kwargs)
        return fn

    for name in load_fns:
        monkeypatch.setattr(zygote, name, recording(name))

    async def probe(self, listen, ready=None, data_listen=None):
        import asyncio

        seen["engine"] = await asyncio.get_running_loop().run_in_executor(
            self._pool, threading.get_ident)
        seen["worker"] = self
        self._pool.shutdown(wait=True)

    monkeypatch.setattr(worker_mod.Worker, "serve", probe)
    monkeypatch.setattr(worker_mod, "die_with_parent", lambda: False)
    assert worker_mod.run_replica("127.0.0.1:0", threads=1, **mode) == 0
    return seen


def test_a_zygote_warms_on_the_engine_thread_that_restores_and_serves(monkeypatch, snapshot):
    seen = _run(monkeypatch, zygote_mode=True, buffer_bytes=1 << 20, warm=str(snapshot))
    assert seen["prepare_zygote"] == seen["engine"] != threading.get_ident()
    warmed = zygote._WARMED[seen["worker"].buffer]
    assert warmed.thread_id == seen["engine"]        # warm_zygote ran there, inside prepare_zygote


def test_a_snapshot_restore_loads_on_the_engine_thread(monkeypatch, snapshot):
    seen = _run(monkeypatch, snapshot=str(snapshot))
    assert seen["restore"] == seen["engine"] != threading.get_ident()
    assert seen["worker"].loaded.path == "restore"


def test_a_boot_loads_on_the_engine_thread(monkeypatch, model_dir):
    seen = _run(monkeypatch, model_dir=str(model_dir))
    assert seen["boot"] == seen["engine"] != threading.get_ident()
    assert seen["worker"].loaded.path == "eager"


def test_a_failed_load_raises_its_own_error(monkeypatch, tmp_path):
    from agent.errors import SnapshotNotFound

    with pytest.raises(SnapshotNotFound):
        _run(monkeypatch, snapshot=str(tmp_path / "missing"))


def test_a_restore_on_another_thread_than_the_warm_up_says_so(snapshot, caplog):
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False, warm=snapshot)
    result: dict = {}
    other = threading.Thread(target=lambda: result.update(
        loaded=zygote.restore(snapshot, buffer=buffer, path="zygote_restore")))
    with caplog.at_level(logging.WARNING, logger="agent.replica.zygote"):
        other.start()
        other.join()
    assert result["loaded"].path == "zygote_restore"          # still restored and checked
    assert any("another thread than the zygote's warm-up" in r.getMessage() for r in caplog.records)


def test_a_restore_on_the_warm_up_thread_says_nothing(snapshot, caplog):
    buffer = zygote.prepare_zygote(1, 1 << 20, prefault=False, warm=snapshot)
    with caplog.at_level(logging.WARNING, logger="agent.replica.zygote"):
        zygote.restore(snapshot, buffer=buffer, path="zygote_restore")
    assert not [r for r in caplog.records if "another thread" in r.getMessage()]
