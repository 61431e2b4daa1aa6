"""Write → restore round trips: every dtype, shape edges, layouts, buffers, signatures."""

from __future__ import annotations

import os

import pytest
import torch

from agent.errors import ConfigError, SnapshotError
from agent.snapshot.format import ALIGN, DTYPES, TENSOR_ALIGN, GoldenCheck
from agent.snapshot.reader import DIRECT_IO_DEPTH, HostBuffer, page_cache_share, restore_snapshot
from agent.snapshot.writer import DATA_NAME

SHAPES = [(), (0,), (3, 0, 2), (1,), (5, 7), (2, 3, 4, 5)]


def _random(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (NaNs included: comparisons are bitwise)."""
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).view(shape) if shape else raw.view(dtype).view(())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_every_dtype_and_shape_round_trips_bit_exactly(make_snapshot, dtype_name):
    dtype = DTYPES[dtype_name]
    data = {f"t{i}": _random(dtype, s, i) for i, s in enumerate(SHAPES)}
    path, manifest = make_snapshot(data=data)
    restored = restore_snapshot(path)
    assert list(restored.tensors) == list(data)
    for name, t in data.items():
        assert _same_bits(t, restored.tensors[name]), name
    assert [e.dtype for e in manifest.tensors] == [dtype_name] * len(SHAPES)
    assert manifest.tensors[4].strides == (7, 1) and manifest.tensors[0].shape == ()


def test_non_contiguous_inputs_are_written_contiguous(make_snapshot):
    base = torch.arange(600, dtype=torch.float32).view(20, 30)
    data = {"t": base.t(), "step": base[::3, 1::2], "expand": torch.ones(3, 1).expand(3, 5)}
    path, manifest = make_snapshot(data=data)
    out = restore_snapshot(path).tensors
    for name, t in data.items():
        assert torch.equal(out[name], t) and out[name].is_contiguous(), name
    assert manifest.tensors[0].strides == (20, 1)


def test_tensors_are_views_into_one_caller_buffer(make_snapshot, tensors):
    path, manifest = make_snapshot()
    buf = HostBuffer.allocate(manifest.total_bytes, prefault=True)
    restored = restore_snapshot(path, buffer=buf)
    lo = buf.as_tensor(manifest.total_bytes).data_ptr()
    for entry in manifest.tensors:
        t = restored.tensors[entry.name]
        assert t.data_ptr() == lo + entry.offset and entry.offset % TENSOR_ALIGN == 0
        assert torch.equal(t, tensors[entry.name])
    assert lo % ALIGN == 0
    # a view, not a copy: writing through the buffer changes the tensor
    buf.as_tensor(manifest.total_bytes)[manifest.tensors[1].offset:manifest.tensors[1].offset + 4].zero_()
    assert restored.tensors["norm"][0].item() == 0.0


def test_stats_and_layout(make_snapshot):
    path, manifest = make_snapshot()
    r = restore_snapshot(path, threads=3, direct=True)
    assert r.stats.bytes == manifest.total_bytes == sum(c.length for c in manifest.chunks)
    assert manifest.total_bytes % ALIGN == 0 and all(c.length % ALIGN == 0 for c in manifest.chunks)
    assert r.stats.chunks == len(manifest.chunks) == -(-manifest.total_bytes // 8192)
    assert 0 <= r.stats.direct_chunks <= r.stats.chunks
    assert r.stats.odirect == (r.stats.direct_chunks == r.stats.chunks) and r.stats.verified
    assert r.manifest.model.name == "tiny"


def test_buffer_too_small_is_refused(make_snapshot):
    path, manifest = make_snapshot()
    with pytest.raises(ConfigError) as err:
        restore_snapshot(path, buffer=HostBuffer.allocate(manifest.total_bytes - ALIGN))
    assert err.value.limit == manifest.total_bytes and err.value.value == manifest.total_bytes - ALIGN


def test_unverified_restore_and_empty_snapshot(make_snapshot, tensors):
    path, _ = make_snapshot()
    out = restore_snapshot(path, verify=False)
    assert torch.equal(out.tensors["ids"], tensors["ids"]) and not out.stats.verified
    empty, manifest = make_snapshot("empty", data={})
    assert manifest.total_bytes == 0 and manifest.chunks == []
    assert restore_snapshot(empty).tensors == {}


def test_golden_extra_and_signature_round_trip(make_snapshot):
    golden = GoldenCheck(prompts=[[1, 2, 3], [4]], seed=42, max_tokens=2, expected=[[5, 6], [7, 8]])
    path, manifest = make_snapshot(golden=golden, extra={"config": {"hidden": 64, "name": "x"}}, key=b"k" * 32)
    r = restore_snapshot(path, key=b"k" * 32)
    assert r.manifest.golden == golden and r.manifest.extra == {"config": {"hidden": 64, "name": "x"}}
    assert r.manifest == manifest


def test_existing_destination_and_bad_chunk_size(make_snapshot, tmp_path):
    make_snapshot()
    with pytest.raises(SnapshotError, match="already exists"):
        make_snapshot()
    with pytest.raises(ConfigError) as err:
        make_snapshot("other", chunk_bytes=ALIGN + 1)
    assert err.value.value == ALIGN + 1
    assert not (tmp_path / "other").exists() and not (tmp_path / "other.partial").exists()


def test_large_tensor_spans_many_chunks(make_snapshot):
    big = torch.arange(50_000, dtype=torch.int32)
    path, manifest = make_snapshot(data={"big": big, "tail": torch.ones(3, dtype=torch.int8)})
    assert len(manifest.chunks) == 25 and manifest.chunk_tensors(0) == ["big"]
    assert manifest.chunk_tensors(24) == ["big", "tail"]
    assert torch.equal(restore_snapshot(path, threads=4).tensors["big"], big)


def _odirect_allowed(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def test_direct_modes_and_page_cache_choice(make_snapshot, tensors):
    path, manifest = make_snapshot()
    data = path / DATA_NAME
    buffered = restore_snapshot(path, direct=False, threads=1)
    assert buffered.stats.direct_chunks == 0 and not buffered.stats.odirect and buffered.stats.threads == 1
    data.read_bytes()                                       # now in the page cache
    assert page_cache_share(path, manifest) == 1.0
    auto = restore_snapshot(path, copy=True)                # cached: a copy from memory
    assert auto.stats.direct_chunks == 0 and torch.equal(auto.tensors["embed"], tensors["embed"])
    fd = os.open(data, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    cold = restore_snapshot(path, copy=True)
    assert cold.stats.threads == DIRECT_IO_DEPTH and cold.stats.mode == "copy"
    assert cold.stats.odirect == _odirect_allowed(data)    # O_DIRECT wherever the filesystem allows
    assert cold.stats.direct_chunks == (len(manifest.chunks) if cold.stats.odirect else 0)
