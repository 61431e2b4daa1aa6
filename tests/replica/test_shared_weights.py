"""Weights once per node: a zygote's buffer is the snapshot's page-cache pages, shared by every
replica restored from it, and an idle KV cache holds no memory (the engine issue, item 3)."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from agent.errors import SnapshotCorrupt
from agent.replica import zygote
from agent.replica.config import LlamaConfig
from agent.replica.model import new_kv_caches
from agent.snapshot.manifest import read_manifest
from agent.replica.synthetic import make_synthetic
from agent.snapshot.reader import HostBuffer, verify_chunks


@pytest.fixture(scope="module")
def snapshots(two_snapshots):
    return two_snapshots


def data_file(snap):
    (name,) = {c.file for c in read_manifest(snap).chunks}
    return snap / name


def inside(tensor, buffer) -> bool:
    base = buffer.as_tensor(buffer.capacity_bytes).data_ptr()
    return base <= tensor.data_ptr() < base + buffer.capacity_bytes


def test_a_shared_zygote_serves_from_the_snapshot_pages_it_warmed_on(snapshots):
    snap, booted = snapshots[1]
    buffer = zygote.prepare_zygote(1, 1 << 20, warm=snap, shared=True)
    assert buffer.file_key is not None and buffer.capacity_bytes == read_manifest(snap).total_bytes
    warmed = zygote._WARMED[buffer]
    restored = zygote.restore(snap, buffer=buffer, path="zygote_restore")
    assert restored.engine is warmed.engine and restored.keepalive is buffer
    assert all(inside(t, buffer) for t in restored.weights.values())
    prompt = [3, 1, 4, 1, 5]
    assert restored.engine.generate([prompt], 6, seed=9) == booted.engine.generate([prompt], 6, seed=9)


def test_a_shared_zygote_without_a_model_holds_no_buffer_and_still_restores(snapshots):
    snap, booted = snapshots[1]
    assert zygote.prepare_zygote(1, 1 << 20, shared=True) is None
    restored = zygote.restore(snap, buffer=None, path="zygote_restore")
    assert restored.golden == booted.golden and restored.keepalive.file_key is None


def test_the_map_of_another_snapshot_is_never_written(snapshots, monkeypatch):
    from agent import _restore

    (snap1, _), (snap2, booted2) = snapshots[1], snapshots[2]
    buffer = zygote.prepare_zygote(1, 1 << 20, warm=snap1, shared=True)
    written = []
    real = _restore.read_chunks
    monkeypatch.setattr(_restore, "read_chunks",
                        lambda memory, *a, **k: (written.append(memory), real(memory, *a, **k))[1])
    restored = zygote.restore(snap2, buffer=buffer)
    assert restored.golden == booted2.golden and restored.keepalive is not buffer
    assert all(m is not buffer.memory for m in written)   # snap2 went to its own map
    assert buffer.memory.closed                           # and snap1's map was given back
    verify_chunks(snap1, read_manifest(snap1))            # its file untouched


def test_a_zygote_warmed_for_a_small_snapshot_restores_a_larger_one(snapshots, tmp_path):
    snap, _ = snapshots[1]
    model_dir = make_synthetic(tmp_path / "big", "small", seed=3)
    booted = zygote.boot(model_dir, max_seqs=2, max_seq_len=32)
    zygote.capture(booted, tmp_path / "bigsnap")
    buffer = zygote.prepare_zygote(1, 1 << 20, warm=snap, shared=True)
    assert buffer.capacity_bytes < read_manifest(tmp_path / "bigsnap").total_bytes
    restored = zygote.restore(tmp_path / "bigsnap", buffer=buffer)
    assert restored.golden == booted.golden


def test_the_map_it_was_warmed_for_is_released_when_another_snapshot_restores(snapshots):
    (snap1, _), (snap2, _) = snapshots[1], snapshots[2]
    buffer = zygote.prepare_zygote(1, 1 << 20, warm=snap1, shared=True)
    zygote.restore(snap2, buffer=buffer)
    name = str(data_file(snap1))
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    locked = 0
    current = False
    for line in lines:
        words = line.split()
        if words and "-" in words[0] and len(words) >= 5:
            current = line.endswith(name)
        elif current and line.startswith("Locked:"):
            locked += int(words[1])
    assert locked == 0      # no page of the snapshot it no longer serves stays pinned


def test_a_byte_changed_under_the_shared_map_fails_closed(snapshots, tmp_path):
    snap, _ = snapshots[1]
    copy = tmp_path / "snap"
    shutil.copytree(snap, copy)
    buffer = zygote.prepare_zygote(1, 1 << 20, warm=copy, shared=True)
    path = data_file(copy)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:        # in place: the private map's unwritten pages see it
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    with pytest.raises(SnapshotCorrupt):
        zygote.restore(copy, buffer=buffer)


def test_two_processes_mapping_one_snapshot_share_its_pages(snapshots):
    snap, _ = snapshots[1]
    buffer = HostBuffer.map_snapshot(snap)
    assert buffer is not None
    name = str(data_file(snap))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from agent.snapshot.reader import HostBuffer
        b = HostBuffer.map_snapshot({str(snap)!r})
        print(b is not None, flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "True"
        rss = pss = 0
        current = False
        with open("/proc/self/smaps") as f:
            for line in f:
                if "-" in line.split()[0] and len(line.split()) >= 5:
                    current = line.rstrip().endswith(name)
                elif current and line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif current and line.startswith("Pss:"):
                    pss += int(line.split()[1])
        assert rss > 0 and pss <= 0.6 * rss, (rss, pss)   # each page counted once per node
    finally:
        child.communicate("")


def test_an_idle_kv_cache_holds_no_memory_until_written():
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)

    def rss_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

    before = rss_kib()
    k, v = new_kv_caches(config, 16, 4096)     # 8 x 16 x 4096 x 64 x 4 bytes = 128 MiB
    assert sum(t.numel() * t.element_size() for t in (*k, *v)) == 128 << 20
    assert rss_kib() - before < 16 << 10
    k[0][3, 7] = 1.0
    assert float(k[0].sum()) == 64.0 and float(v[3].abs().sum()) == 0.0
    assert rss_kib() - before < 16 << 10
