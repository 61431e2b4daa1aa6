"""agent/snapshot/gpu.py: the kvikio strategy and its settings, the choice of strategy, the
machine's pins and DeviceBuffer; with the fake kvikio here (host tensors stand in for device
memory), with the real one where a GPU and its driver are present (``pytest -m gpu``).  The
staged strategy's own tests are in test_staged.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agent.errors import ConfigError, DriverUnavailable, SnapshotCorrupt, SnapshotIncompatible
from agent.snapshot import gpu
from agent.snapshot.pins import machine_pins
from tests.fake_kvikio import Defaults, FakeKvikio

HAVE_GPU = gpu.cuda_driver_present() and torch.cuda.is_available()


@pytest.mark.skipif(gpu.cuda_driver_present(), reason="the driver is present here")
def test_without_driver_the_device_path_says_so(make_snapshot):
    path, _ = make_snapshot()
    with pytest.raises(DriverUnavailable) as err:
        gpu.restore_to_device(path)
    assert err.value.missing == ["libcuda.so.1"]


@pytest.mark.skipif(gpu.cuda_driver_present(), reason="the driver is present here")
def test_a_buffer_without_the_driver_keeps_why():
    buf = gpu.DeviceBuffer.allocate(4096, "cpu")
    assert buf.kvikio is None and "libcuda.so.1" in buf.unavailable
    assert buf.capacity_bytes == 4096 and buf.as_tensor(100).numel() == 100


def test_fake_restore_fills_the_buffer_and_verifies(make_snapshot, tensors):
    path, manifest = make_snapshot()
    fake = FakeKvikio()
    buf = gpu.DeviceBuffer.allocate(manifest.total_bytes + 4096, "cpu", bounce_bytes=1024,
                                    kvikio=fake)
    r = gpu.restore_to_device(path, device="cpu", buffer=buf)
    for name, t in tensors.items():
        assert torch.equal(r.tensors[name], t), name
        assert r.tensors[name].untyped_storage().data_ptr() == buf.tensor.untyped_storage().data_ptr()
    assert r.buffer is buf and r.stats.mode == "compat" and r.stats.verified
    assert len(fake.reads) == len(manifest.chunks) and all(h.closed for h in fake.opened)
    # bounce buffers smaller than a chunk are replaced for the verification, not overrun
    assert buf.bounce[0].numel() == 1024


def test_a_flipped_byte_is_found_and_named(make_snapshot):
    path, manifest = make_snapshot()
    c = manifest.chunks[2]
    fake = FakeKvikio(flip_at=c.offset + 17)
    with pytest.raises(SnapshotCorrupt) as err:
        gpu.restore_to_device(path, device="cpu", kvikio=fake)
    assert err.value.chunk == 2 and err.value.expected == c.checksum
    assert err.value.tensors == manifest.chunk_tensors(2)
    assert all(h.closed for h in fake.opened)
    # unverified, the same bytes are accepted: verification is what catches them
    r = gpu.restore_to_device(path, device="cpu", kvikio=FakeKvikio(flip_at=c.offset + 17),
                              verify=False)
    assert not r.stats.verified


def test_an_io_error_propagates_and_every_file_is_closed(make_snapshot):
    path, manifest = make_snapshot()
    fake = FakeKvikio(fail_at=manifest.chunks[1].offset)
    with pytest.raises(RuntimeError, match="Input/output error"):
        gpu.restore_to_device(path, device="cpu", kvikio=fake)
    assert fake.opened and all(h.closed for h in fake.opened)


def test_pins_and_accept_refuse_before_a_byte_is_read(make_snapshot):
    other = dataclasses.replace(machine_pins("cpu"), gpu_name="NVIDIA H200", gpu_cc="9.0",
                                cuda_driver="580.65")
    path, _ = make_snapshot(pins=other)
    fake = FakeKvikio()
    with pytest.raises(SnapshotIncompatible) as err:
        gpu.restore_to_device(path, device="cpu", kvikio=fake)
    assert "gpu_name" in err.value.mismatches and fake.reads == [] and fake.opened == []
    path2, _ = make_snapshot("snap2")

    def refuse(manifest):
        raise SnapshotIncompatible("not a replica", path=path2, mismatches={})
    with pytest.raises(SnapshotIncompatible):
        gpu.restore_to_device(path2, device="cpu", kvikio=fake, accept=refuse)
    assert fake.reads == []


def test_a_buffer_too_small_or_elsewhere_is_refused(make_snapshot):
    path, manifest = make_snapshot()
    fake = FakeKvikio()
    small = gpu.DeviceBuffer.allocate(manifest.total_bytes - 1, "cpu", kvikio=fake)
    with pytest.raises(ConfigError) as err:
        gpu.restore_to_device(path, device="cpu", buffer=small)
    assert err.value.limit == manifest.total_bytes and fake.reads == []
    with pytest.raises(ConfigError) as err:
        gpu.restore_to_device(path, device="meta",
                              buffer=gpu.DeviceBuffer.allocate(manifest.total_bytes, "cpu", kvikio=fake),
                              machine=machine_pins("cpu"))
    assert err.value.name == "device"


def test_io_path_says_gds_only_with_cufile_and_nvidia_fs(tmp_path):
    present = tmp_path / "nvidia-fs"
    present.mkdir()
    absent = tmp_path / "none"
    assert gpu.io_path(FakeKvikio(Defaults(compat=False)), present) == "gds"
    assert gpu.io_path(FakeKvikio(Defaults(compat=False)), absent) == "compat"
    assert gpu.io_path(FakeKvikio(Defaults(compat=True)), present) == "compat"


def test_fake_is_no_kinder_than_kvikio(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 100)
    h = FakeKvikio().CuFile(f, "r")
    with pytest.raises(ValueError):
        h.pread(torch.empty(10, dtype=torch.uint8), 11, 0)
    fut = h.pread(torch.empty(20, dtype=torch.uint8), 20, 90)
    with pytest.raises(RuntimeError, match="EOF"):
        fut.get()
    ok = h.pread(torch.empty(10, dtype=torch.uint8), 10, 0)
    assert ok.get() == 10
    with pytest.raises(RuntimeError):
        ok.get()
    h.close()
    with pytest.raises(RuntimeError):
        h.pread(torch.empty(10, dtype=torch.uint8), 10, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU and its driver")
@pytest.mark.parametrize("strategy", ["staged", "kvikio"])
def test_restore_into_device_memory(make_snapshot, tensors, strategy):
    if strategy == "kvikio":
        pytest.importorskip("kvikio")
    path, manifest = make_snapshot(pins=machine_pins("cuda"))
    # 4 KiB slots: every 8 KiB chunk takes two fills, the snapshot outgrows the slots
    buf = gpu.DeviceBuffer.allocate(manifest.total_bytes, "cuda", strategy=strategy, slot_bytes=4096)
    # queued work that reads the buffer must finish before the restore overwrites it
    busy = buf.tensor.float().sum()
    r = gpu.restore_to_device(path, device="cuda", buffer=buf)
    assert r.stats.strategy == strategy and busy.item() == 0.0
    assert r.stats.mode == "staged" if strategy == "staged" else r.stats.mode in ("gds", "compat")
    for name, t in tensors.items():
        assert r.tensors[name].is_cuda and torch.equal(r.tensors[name].cpu(), t), name
    with open(path / "data-00000.bin", "r+b") as f:
        f.seek(10)
        f.write(b"\x99")
    with pytest.raises(SnapshotCorrupt) as err:
        gpu.restore_to_device(path, device="cuda", buffer=buf)
    assert err.value.chunk == 0
    with open(path / "data-00000.bin", "r+b") as f:
        f.seek(10)
        f.write(tensors["embed"].view(torch.uint8).reshape(-1)[10:11].numpy().tobytes())
    r = gpu.restore_to_device(path, device="cuda", buffer=buf)    # the slots are reusable
    assert all(torch.equal(r.tensors[n].cpu(), t) for n, t in tensors.items())


# --- choosing the strategy ---------------------------------------------------------------------

def test_auto_chooses_kvikio_only_for_gds_on_a_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv(gpu.STRATEGY_ENV, raising=False)
    nvfs = tmp_path / "nvidia-fs"
    nvfs.mkdir()
    gds, compat = FakeKvikio(Defaults(compat=False)), FakeKvikio(Defaults(compat=True))
    assert gpu.choose_strategy(None, "cuda:1", gds, nvidia_fs=nvfs) == "kvikio"
    assert gpu.choose_strategy(None, "cuda", compat, nvidia_fs=nvfs) == "staged"
    assert gpu.choose_strategy(None, "cuda", gds, nvidia_fs=tmp_path / "absent") == "staged"
    assert gpu.choose_strategy("auto", "cpu", None) == "kvikio"     # the tests' stand-in
    assert gpu.choose_strategy("staged", "cpu", gds, nvidia_fs=nvfs) == "staged"


def test_the_operators_variable_chooses_and_a_bad_name_says_where_it_came_from(monkeypatch):
    monkeypatch.setenv(gpu.STRATEGY_ENV, "staged")
    assert gpu.choose_strategy(None, "cpu") == "staged"
    assert gpu.choose_strategy("kvikio", "cpu") == "kvikio"           # the argument wins
    buf = gpu.DeviceBuffer.allocate(4096, "cpu", kvikio=FakeKvikio(), slot_bytes=4096)
    assert buf.strategy == "staged" and buf.staging is not None and buf.bounce == []
    monkeypatch.setenv(gpu.STRATEGY_ENV, "fast")
    with pytest.raises(ConfigError, match="REWARM_RESTORE_STRATEGY") as err:
        gpu.choose_strategy(None, "cuda")
    assert err.value.value == "fast" and err.value.limit == list(gpu.STRATEGIES)
    with pytest.raises(ConfigError, match="from the argument"):
        gpu.choose_strategy("gds", "cuda")


def test_a_buffer_prepares_another_strategy_on_demand(make_snapshot, tensors, monkeypatch):
    monkeypatch.delenv(gpu.STRATEGY_ENV, raising=False)
    path, manifest = make_snapshot()
    fake = FakeKvikio()
    buf = gpu.DeviceBuffer.allocate(manifest.total_bytes, "cpu", kvikio=fake, slot_bytes=4096)
    assert buf.strategy == "kvikio" and buf.staging is None and len(buf.bounce) == gpu.hash_threads() + 1
    r = gpu.restore_to_device(path, device="cpu", buffer=buf, strategy="staged")
    assert r.stats.mode == "staged" and buf.staging is not None and fake.reads == []
    assert all(torch.equal(r.tensors[n], t) for n, t in tensors.items())
    r = gpu.restore_to_device(path, device="cpu", buffer=buf)
    assert r.stats.mode == "compat" and fake.reads


# --- kvikio's settings ------------------------------------------------------------------------------

def test_kvikio_reads_with_its_pool_sized_for_the_node_and_puts_the_old_settings_back(make_snapshot, monkeypatch):
    from agent.snapshot import kvikio_read
    from agent.snapshot.staging import staged_threads

    path, manifest = make_snapshot()
    fake = FakeKvikio()
    seen = []
    real_pread = fake.CuFile.pread

    def pread(self, *args, **kw):
        seen.append((fake.defaults.get("num_threads"), fake.defaults.get("task_size")))
        return real_pread(self, *args, **kw)
    monkeypatch.setattr(fake.CuFile, "pread", pread)
    monkeypatch.setattr(kvikio_read, "cached_share", lambda *a, **k: 0.0)   # cold
    r = gpu.restore_to_device(path, device="cpu", kvikio=fake)
    want = {"num_threads": staged_threads(), "task_size": kvikio_read.KVIKIO_TASK_BYTES,
            "bounce_buffer_size": 16 << 20, "auto_direct_io_read": True}
    assert set(seen) == {(want["num_threads"], want["task_size"])} and len(seen) == len(manifest.chunks)
    assert {k: r.stats.figures[k] for k in want} == want and r.stats.threads == want["num_threads"]
    assert r.stats.strategy == "kvikio" and r.stats.mode == "compat"
    assert [fake.defaults.get(k) for k in want] == [1, 4 << 20, 16 << 20, False]
    # a failed restore puts them back too
    failing = FakeKvikio(fail_at=manifest.chunks[1].offset)
    with pytest.raises(RuntimeError, match="Input/output error"):
        gpu.restore_to_device(path, device="cpu", kvikio=failing)
    assert [failing.defaults.get(k) for k in want] == [1, 4 << 20, 16 << 20, False]


def test_kvikio_settings_never_shrink_the_bounce_pool(monkeypatch):
    from agent.snapshot.kvikio_read import KVIKIO_TASK_BYTES, kvikio_settings

    fake = FakeKvikio()
    with fake.defaults.set("bounce_buffer_size", 64 << 20):
        got = kvikio_settings(fake, cold=False, threads=3)
    assert got == {"num_threads": 3, "task_size": KVIKIO_TASK_BYTES,
                   "bounce_buffer_size": 64 << 20, "auto_direct_io_read": False}
    with fake.defaults.set("bounce_buffer_size", 1 << 20):
        assert kvikio_settings(fake, cold=True)["bounce_buffer_size"] == KVIKIO_TASK_BYTES


def test_the_real_kvikio_accepts_the_settings():
    pytest.importorskip("kvikio")
    import kvikio.defaults

    from agent.snapshot.kvikio_read import kvikio_settings

    settings = kvikio_settings(kvikio, cold=True, threads=3)
    before = {k: kvikio.defaults.get(k) for k in settings}
    with kvikio.defaults.set(settings):
        assert {k: kvikio.defaults.get(k) for k in settings} == settings
    assert {k: kvikio.defaults.get(k) for k in settings} == before


def test_the_machines_pins_are_read_once_per_device(make_snapshot, monkeypatch):
    calls = []

    def pins(device):
        calls.append(device)
        return machine_pins("cpu")
    monkeypatch.setattr(gpu, "_PINS", {})
    monkeypatch.setattr(gpu, "machine_pins", pins)
    path, _ = make_snapshot()
    for _ in range(2):
        gpu.restore_to_device(path, device="cpu", kvikio=FakeKvikio())
    assert calls == ["cpu"] and gpu.device_pins("cpu") is gpu.device_pins("cpu")
