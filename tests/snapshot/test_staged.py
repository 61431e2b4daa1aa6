"""The staged device restore (agent/snapshot/staged.py, staging.py and ext/ read_into) with a
CPU tensor standing in for device memory: every path but the DMA runs here."""

from __future__ import annotations

import errno
import gc
import os
import threading

import pytest
import torch

from agent import _restore
from agent.errors import ConfigError, SnapshotCorrupt
from agent.snapshot import gpu, staged
from agent.snapshot.format import ALIGN
from agent.snapshot.reader import RESIDENT_FOR_BUFFERED
from agent.snapshot.staging import COLD_READS, Slot, Staging, aligned_host

SLOT = 4096     # tiny slots: an 8 KiB chunk takes two fills, a snapshot outgrows the slots


def _fds() -> set[str]:
    """This process's open descriptors, less the one the listing itself opens (it takes the
    lowest free number, so an unrelated descriptor closed meanwhile moved it, and a set
    compared before and after a restore differed with nothing leaked), after a collection
    (a file object an earlier test dropped is closed now, not mid-restore)."""
    gc.collect()
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:          # the listing's own descriptor, closed once listed
            continue
        if not target.endswith(f"/{os.getpid()}/fd") and target != "/proc/self/fd":
            out.add(name)
    return out


def _staged_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("staged-")]


def _buffer(nbytes: int, **kw) -> gpu.DeviceBuffer:
    kw.setdefault("slot_bytes", SLOT)
    return gpu.DeviceBuffer.allocate(nbytes, "cpu", strategy="staged", threads=2, **kw)


@pytest.fixture
def big(make_snapshot):
    """A snapshot of 40 chunks (320 KiB), more than the 16 x 2 slots of 4 KiB hold."""
    g = torch.Generator().manual_seed(3)
    data = {f"w{i}": torch.randn(64, 160, generator=g).to(torch.bfloat16) for i in range(16)}
    path, manifest = make_snapshot("big", data)
    return path, manifest, data


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


# --- ext/restore.pyx read_into and Xxh3 ------------------------------------------------------

def test_read_into_hashes_across_calls_as_one_stream(tmp_path):
    data = os.urandom(5 * ALIGN + 123)
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    fd = os.open(f, os.O_RDONLY)
    try:
        dest = bytearray(len(data))
        h = _restore.Xxh3()
        first = _restore.read_into(dest, 0, 3 * ALIGN, -1, fd, 0, ALIGN, ALIGN, h)
        second = _restore.read_into(dest, 3 * ALIGN, len(data) - 3 * ALIGN, -1, fd, 3 * ALIGN,
                                    ALIGN, ALIGN, h)
        assert first[:3] == (0, 0, 0) and second[:3] == (0, 0, 0)
        assert bytes(dest) == data and h.digest() == _restore.xxh3_64(data)
        h.reset()
        h.update(data[:100])
        h.update(data[100:])
        assert h.digest() == _restore.xxh3_64(data)
        # past the end: the short read is reported, not raised
        assert _restore.read_into(dest, 0, 2 * ALIGN, -1, fd, len(data) - ALIGN)[:2] == (0, 1)
    finally:
        os.close(fd)


def test_read_into_refuses_a_range_outside_the_buffer_or_a_bad_piece(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * ALIGN)
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="outside buffer of 4096 bytes"):
            _restore.read_into(bytearray(ALIGN), 1, ALIGN, -1, fd, 0)
        with pytest.raises(ValueError, match="piece_bytes=1000"):
            _restore.read_into(bytearray(ALIGN), 0, ALIGN, -1, fd, 0, 1000)
        with pytest.raises(ValueError, match="direct_piece_bytes=0"):
            _restore.read_into(bytearray(ALIGN), 0, ALIGN, -1, fd, 0, ALIGN, 0)
    finally:
        os.close(fd)


def test_read_into_reports_an_eio_with_its_errno():
    fd = os.open("/proc/self/mem", os.O_RDONLY)   # address 0 is never mapped: EIO
    try:
        err, short, direct, _r, _h = _restore.read_into(bytearray(ALIGN), 0, ALIGN, -1, fd, 0)
        assert (err, short, direct) == (errno.EIO, 0, 0)
    finally:
        os.close(fd)


def test_o_direct_refused_for_a_range_is_read_buffered_and_hashed_once(tmp_path):
    data = os.urandom(4 * ALIGN)
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    fd_b = os.open(f, os.O_RDONLY)
    try:
        fd_d = os.open(f, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        os.close(fd_b)
        pytest.skip("this filesystem refuses O_DIRECT at open")
    try:
        memory = aligned_host(6 * ALIGN, pin=False)
        h = _restore.Xxh3()
        # one byte past a block boundary: the kernel refuses the O_DIRECT read (EINVAL)
        err, short, direct, _r, _h = _restore.read_into(memory.numpy(), 1, len(data), fd_d, fd_b, 0,
                                                        ALIGN, ALIGN, h)
        assert (err, short, direct) == (0, 0, 0)
        assert bytes(memory[1:1 + len(data)].numpy()) == data and h.digest() == _restore.xxh3_64(data)
        h.reset()
        assert _restore.read_into(memory.numpy(), 0, len(data), fd_d, fd_b, 0, ALIGN, ALIGN, h)[:3] == (0, 0, 1)
        assert h.digest() == _restore.xxh3_64(data)
    finally:
        os.close(fd_d)
        os.close(fd_b)


# --- Staging -----------------------------------------------------------------------------------

def test_staging_slots_are_aligned_disjoint_and_enough_for_a_cold_read():
    s = Staging.allocate("cpu", threads=2, slot_bytes=2 * ALIGN)
    assert s.threads == COLD_READS and s.streams == [] and s.nbytes == COLD_READS * 2 * 2 * ALIGN
    ptrs = sorted(slot.tensor.data_ptr() for slots in s.sets for slot in slots)
    assert all(p % ALIGN == 0 for p in ptrs)
    assert all(b - a == 2 * ALIGN for a, b in zip(ptrs, ptrs[1:], strict=False))
    for bad in (0, ALIGN + 1):
        with pytest.raises(ConfigError) as err:
            Staging.allocate("cpu", slot_bytes=bad)
        assert err.value.value == bad and err.value.limit == ALIGN


def test_cached_share_probes_the_page_cache_without_reading_the_disk(big, monkeypatch):
    from agent.snapshot import staging
    from agent.snapshot.reader import _close, _open_files

    path, manifest, _ = big
    data = path / "data-00000.bin"
    fds = _open_files(path, manifest, direct=False)
    try:
        data.read_bytes()                                   # in the page cache
        assert staging.cached_share(path, manifest, fds) == 1.0
        fd = os.open(data, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        if _restore.resident_fraction(str(data)) == 0.0:    # the drop took (it may not, in a container)
            # judged cold (a missed probe starts read-ahead, which a later probe may find done)
            assert staging.cached_share(path, manifest, fds) < RESIDENT_FOR_BUFFERED
        probes = []

        def unsupported(fd, buffers, offset, flags):
            probes.append(offset)
            raise OSError(errno.EOPNOTSUPP, "RWF_NOWAIT")
        monkeypatch.setattr(staging.os, "preadv", unsupported)
        monkeypatch.setattr(staging, "page_cache_share", lambda p, m, f: 0.25 if f is fds else -1)
        assert staging.cached_share(path, manifest, fds) == 0.25 and len(probes) == 1
    finally:
        _close(fds)
    empty = type(manifest)(**{**manifest.__dict__, "chunks": []})
    assert staging.cached_share(path, empty, {}) == 0.0


# --- restore_to_device(strategy="staged") -------------------------------------------------------

def test_a_snapshot_larger_than_the_slots_lands_in_place(big, monkeypatch):
    path, manifest, data = big
    monkeypatch.setattr(staged, "cached_share", lambda *a, **k: 1.0)   # warm
    buf = _buffer(manifest.total_bytes + ALIGN)
    assert buf.staging.nbytes < manifest.total_bytes
    before, fds = _staged_threads(), _fds()
    r = gpu.restore_to_device(path, device="cpu", buffer=buf)
    for name, t in data.items():
        assert torch.equal(r.tensors[name], t), name
        assert r.tensors[name].untyped_storage().data_ptr() == buf.tensor.untyped_storage().data_ptr()
    assert (r.stats.mode, r.stats.strategy, r.stats.verified) == ("staged", "staged", True)
    assert r.stats.chunks == len(manifest.chunks) == 40
    assert r.stats.figures["fills"] == sum(-(-c.length // SLOT) for c in manifest.chunks)
    assert r.stats.figures["slot_bytes"] == SLOT and r.stats.figures["cold"] is False
    assert r.stats.threads == 2 and r.stats.direct_chunks == 0     # the buffer's 2 workers
    assert _staged_threads() == before and _fds() == fds


def test_a_cold_file_is_read_with_o_direct(big, monkeypatch):
    path, manifest, data = big
    monkeypatch.setattr(staged, "cached_share", lambda *a, **k: 0.0)
    r = gpu.restore_to_device(path, device="cpu", buffer=_buffer(manifest.total_bytes))
    assert r.stats.figures["cold"] is True and r.stats.threads == COLD_READS
    try:
        os.close(os.open(path / "data-00000.bin", os.O_RDONLY | os.O_DIRECT))
        direct = len(manifest.chunks)
    except OSError:     # the filesystem refuses O_DIRECT: every chunk read buffered
        direct = 0
    assert r.stats.direct_chunks == direct
    assert all(torch.equal(r.tensors[n], t) for n, t in data.items())


def test_a_cold_file_whose_o_direct_open_is_refused_is_read_buffered(big, monkeypatch):
    from agent.snapshot import reader

    path, manifest, data = big
    monkeypatch.setattr(staged, "cached_share", lambda *a, **k: 0.0)
    monkeypatch.setattr(reader, "_open_direct", lambda fpath, fd_b: -1)   # as on a tmpfs
    fds = _fds()
    r = gpu.restore_to_device(path, device="cpu", buffer=_buffer(manifest.total_bytes))
    assert r.stats.figures["cold"] is True and (r.stats.direct_chunks, r.stats.odirect) == (0, False)
    assert all(torch.equal(r.tensors[n], t) for n, t in data.items()) and _fds() == fds


def test_a_flipped_byte_is_named_and_the_slots_stay_usable(big):
    path, manifest, data = big
    buf = _buffer(manifest.total_bytes)
    c = manifest.chunks[13]
    _flip(path / c.file, c.offset + 4100)       # in the chunk's second fill
    with open(path / c.file, "rb") as f:
        f.seek(c.offset)
        actual = _restore.xxh3_64(f.read(c.length))
    before, fds = _staged_threads(), _fds()
    with pytest.raises(SnapshotCorrupt) as err:
        gpu.restore_to_device(path, device="cpu", buffer=buf)
    e = err.value
    assert (e.chunk, e.path, e.tensors) == (13, path / c.file, manifest.chunk_tensors(13))
    assert (e.expected, e.actual) == (f"{c.checksum:016x}", f"{actual:016x}")
    assert _staged_threads() == before and _fds() == fds
    _flip(path / c.file, c.offset + 4100)       # put it back: the same buffer restores it
    r = gpu.restore_to_device(path, device="cpu", buffer=buf)
    assert all(torch.equal(r.tensors[n], t) for n, t in data.items())
    # unverified, a flipped byte is accepted: verification is what catches it
    _flip(path / c.file, c.offset + 4100)
    r = gpu.restore_to_device(path, device="cpu", buffer=buf, verify=False)
    assert not r.stats.verified and r.stats.chunks == 40


def test_an_eio_is_named_with_its_errno_and_nothing_is_left_open(big, monkeypatch):
    path, manifest, _ = big
    real = staged._open_files

    def failing_device(p, m, direct=True):     # the data file's reads fail as a dying disk's
        fds = real(p, m, direct)
        (name, (fd_d, fd_b)), = fds.items()
        os.close(fd_b)
        fds[name] = (fd_d, os.open("/proc/self/mem", os.O_RDONLY))
        return fds
    monkeypatch.setattr(staged, "_open_files", failing_device)
    before, fds = _staged_threads(), _fds()
    with pytest.raises(SnapshotCorrupt, match=r"read error Input/output error \(errno 5\)") as err:
        gpu.restore_to_device(path, device="cpu", buffer=_buffer(manifest.total_bytes))
    assert err.value.actual == errno.EIO and err.value.tensors == manifest.chunk_tensors(err.value.chunk)
    assert _staged_threads() == before and _fds() == fds


def test_a_worker_error_is_raised_after_every_thread_is_joined(big, monkeypatch):
    path, manifest, _ = big
    calls = []
    real = _restore.read_into

    def flaky(*args):
        calls.append(1)
        if len(calls) == 5:
            raise MemoryError("slot")
        return real(*args)
    monkeypatch.setattr(staged._restore, "read_into", flaky)
    before, fds = _staged_threads(), _fds()
    with pytest.raises(MemoryError, match="slot"):
        gpu.restore_to_device(path, device="cpu", buffer=_buffer(manifest.total_bytes))
    assert _staged_threads() == before and _fds() == fds
    assert len(calls) < sum(-(-c.length // SLOT) for c in manifest.chunks)   # the others stopped


def test_zero_chunks_start_no_thread(make_snapshot):
    path, manifest = make_snapshot("empty", {})
    assert manifest.chunks == []
    r = gpu.restore_to_device(path, device="cpu", buffer=_buffer(ALIGN))
    assert r.tensors == {} and (r.stats.chunks, r.stats.threads, r.stats.bytes) == (0, 0, 0)


def test_without_a_buffer_staging_is_made_for_the_restore(make_snapshot, tensors):
    path, _ = make_snapshot()
    r = gpu.restore_to_device(path, device="cpu", strategy="staged")
    assert r.buffer is None and r.stats.mode == "staged"
    assert all(torch.equal(r.tensors[n], t) for n, t in tensors.items())


# --- run_staged, the pipeline itself --------------------------------------------------------------

def test_a_short_read_stops_the_run_and_is_reported_for_its_chunk(tmp_path):
    f = tmp_path / "f.bin"
    f.write_bytes(os.urandom(6 * ALIGN))
    fd = os.open(f, os.O_RDONLY)
    try:
        jobs = [(-1, fd, k * ALIGN, ALIGN, k * ALIGN, 0) for k in range(6)]
        jobs.append((-1, fd, 6 * ALIGN, ALIGN, 6 * ALIGN, 0))   # past the end of the file
        dest = torch.zeros(7 * ALIGN, dtype=torch.uint8)
        run = staged.run_staged(jobs, dest, Staging.allocate("cpu", slot_bytes=ALIGN), threads=1,
                                verify=False)
        assert run.results[6] == (0, 1, 0, 0) and run.error is None and run.threads == 1
        assert bytes(dest[:6 * ALIGN].numpy()) == f.read_bytes()
    finally:
        os.close(fd)


def test_slots_the_kernel_refuses_for_o_direct_still_restore(tmp_path):
    data = os.urandom(4 * ALIGN)
    f = tmp_path / "f.bin"
    f.write_bytes(data)
    fd_b = os.open(f, os.O_RDONLY)
    try:
        fd_d = os.open(f, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd_d = -1
    try:
        raw = torch.zeros(3 * ALIGN + 1, dtype=torch.uint8)
        skip = (-raw.data_ptr() % ALIGN) + 1            # one byte past a 4 KiB boundary
        slots = [Slot(t, t.numpy()) for t in (raw[skip:skip + ALIGN], raw[skip:skip + ALIGN])]
        staging = Staging(torch.device("cpu"), ALIGN, [slots])
        jobs = [(fd_d, fd_b, 0, 2 * ALIGN, 0, _restore.xxh3_64(data[:2 * ALIGN])),
                (fd_d, fd_b, 2 * ALIGN, 2 * ALIGN, 2 * ALIGN, _restore.xxh3_64(data[2 * ALIGN:]))]
        dest = torch.zeros(4 * ALIGN, dtype=torch.uint8)
        run = staged.run_staged(jobs, dest, staging, threads=4)
        assert [r[:3] for r in run.results] == [(0, 0, 0), (0, 0, 0)]
        assert [r[3] for r in run.results] == [j[5] for j in jobs]
        assert bytes(dest.numpy()) == data
    finally:
        for fd in (fd_d, fd_b):
            if fd >= 0:
                os.close(fd)


def test_a_job_outside_the_destination_is_refused_before_any_thread():
    with pytest.raises(ValueError, match="outside the device buffer of 4096 bytes"):
        staged.run_staged([(-1, 0, 0, ALIGN, ALIGN, 0)], torch.zeros(ALIGN, dtype=torch.uint8),
                          Staging.allocate("cpu", slot_bytes=ALIGN), threads=2)
    assert _staged_threads() == []


# --- the fallback contract through restore_for_device -----------------------------------------------

def test_a_staged_read_that_fails_takes_the_host_path(big, monkeypatch, caplog):
    path, manifest, data = big
    real = staged._open_files

    def failing_device(p, m, direct=True):
        fds = real(p, m, direct)
        (name, (fd_d, fd_b)), = fds.items()
        os.close(fd_b)
        fds[name] = (fd_d, os.open("/proc/self/mem", os.O_RDONLY))
        return fds
    monkeypatch.setattr(staged, "_open_files", failing_device)
    buf = _buffer(manifest.total_bytes)
    restored, io, fallback = gpu.restore_for_device(path, buf, "cpu")
    assert io == "host" and fallback.startswith("SnapshotCorrupt") and "errno 5" in fallback
    assert "device restore onto cpu failed" in caplog.text
    assert all(torch.equal(restored.tensors[n], t) for n, t in data.items())
    monkeypatch.undo()
    restored, io, fallback = gpu.restore_for_device(path, buf, "cpu")
    assert (io, fallback) == ("staged", None)


# --- on a real GPU (pytest -m gpu) ----------------------------------------------------------------

HAVE_GPU = gpu.cuda_driver_present() and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_GPU, reason="needs an NVIDIA GPU and its driver")
def test_on_a_gpu_slots_are_pinned_and_a_failed_run_leaves_them_reusable(big, monkeypatch):
    from agent.snapshot.pins import machine_pins

    path, manifest, data = big
    machine = machine_pins("cpu")       # the pins ``big`` was written with
    buf = gpu.DeviceBuffer.allocate(manifest.total_bytes, "cuda", strategy="staged", slot_bytes=SLOT)
    assert buf.staging.memory.is_pinned() and len(buf.staging.streams) == buf.staging.threads
    calls = []
    real = _restore.read_into

    def flaky(*args):
        calls.append(1)
        if len(calls) == 9:
            raise MemoryError("slot")
        return real(*args)
    monkeypatch.setattr(staged._restore, "read_into", flaky)
    with pytest.raises(MemoryError):
        gpu.restore_to_device(path, device="cuda", buffer=buf, machine=machine)
    assert _staged_threads() == []
    monkeypatch.undo()
    r = gpu.restore_to_device(path, device="cuda", buffer=buf, machine=machine)
    assert r.stats.mode == "staged"
    assert all(torch.equal(r.tensors[n].cpu(), t) for n, t in data.items())
