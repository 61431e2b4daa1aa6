"""One load in a process of its own: rewarm's two restore paths and the loaders users pick instead.

    python bench/restore_peers.py LOADER DIR cold|warm      # prints one JSON line
    python bench/restore_peers.py first_touch NBYTES
    python bench/restore_peers.py odirect_raw DIR BLOCK_BYTES QUEUE_DEPTH

Run by bench/restore_throughput.py, one subprocess per load, so that each loader pays its own
fresh-process costs (memory never touched before, imports already done) and its RSS is its
own.  DIR holds the same tensors in every format (bench/restore_throughput.py writes them):
``snapshot/`` (rewarm), ``model.safetensors``, ``model.tensors`` (tensorizer, with hashes),
``model.pt``.  What is timed, the same for every loader: the load, then one full touch pass
(every byte read: the max of each tensor's bytes), so a
loader that maps lazily pays its page faults inside the clock.  Before the clock, after the
imports: the page cache is dropped (fsync + POSIX_FADV_DONTNEED, checked with mincore) for
"cold", or the file is read once for "warm"; VmHWM is reset (/proc/self/clear_refs) and VmRSS
taken as the baseline.  Output: ``{"load_s", "touch_s", "seconds", "bytes", "verified",
"resident_before", "rss_baseline_bytes", "rss_peak_bytes", "mode"}``.

sllm-store (ServerlessLLM) is not among the peers: its wheel builds only against CUDA or ROCm,
and the development machines have neither.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from agent import _restore  # noqa: E402

SNAPSHOT, SAFETENSORS, TENSORIZER, TORCH_SAVE = "snapshot", "model.safetensors", "model.tensors", "model.pt"
DATA_FILE = "data-00000.bin"   # agent.snapshot.writer.DATA_NAME (not imported: the peers' processes stay lean)


def _rewarm_fresh(d: Path, copy, verify: bool = True, huge: bool = False):
    from agent.snapshot.reader import restore_snapshot
    r = restore_snapshot(d / SNAPSHOT, copy=copy, verify=verify, huge=huge)
    return r.tensors, r, r.stats.mode + (" huge" if huge else "")


def _rewarm_zygote_setup(d: Path):
    from agent.snapshot.reader import HostBuffer, read_manifest
    return HostBuffer.allocate(read_manifest(d / SNAPSHOT).total_bytes, prefault=True)


def _rewarm_zygote(d: Path, buf):
    from agent.snapshot.reader import restore_snapshot
    r = restore_snapshot(d / SNAPSHOT, buffer=buf)
    return r.tensors, r, r.stats.mode


def _runai(d: Path, _):
    from runai_model_streamer import SafetensorsStreamer
    with SafetensorsStreamer() as s:
        s.stream_file(str(d / SAFETENSORS))         # owned=True: tensors stay valid after the loop
        return dict(s.get_tensors()), s, ""


def _fastsafetensors(d: Path, _):
    from fastsafetensors import fastsafe_open
    with fastsafe_open(str(d / SAFETENSORS), "pt", device="cpu", nogds=True) as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f, "nogds"


def _tensorizer(verify: bool):
    def load(d: Path, _):
        from tensorizer import TensorDeserializer
        des = TensorDeserializer(str(d / TENSORIZER), device="cpu", verify_hash=verify)
        return dict(des), des, "verify_hash" if verify else ""
    return load


def _st_file(backend: str):
    def load(d: Path, _):
        from safetensors.torch import load_file
        return load_file(d / SAFETENSORS, backend=backend), None, backend
    return load


def _st_bytes(d: Path, _):
    from safetensors.torch import load
    return load((d / SAFETENSORS).read_bytes()), None, "bytes"


def _torch_load(d: Path, _):
    return torch.load(d / TORCH_SAVE, mmap=True, weights_only=True), None, "mmap"


# name: (file the loader reads, setup before the clock or None, load, verifies every byte?)
LOADERS = {
    "rewarm_fresh": (f"{SNAPSHOT}/{DATA_FILE}", None, lambda d, _: _rewarm_fresh(d, "auto"), "XXH3-64"),
    "rewarm_fresh_copy": (f"{SNAPSHOT}/{DATA_FILE}", None, lambda d, _: _rewarm_fresh(d, True), "XXH3-64"),
    "rewarm_fresh_copy_huge": (f"{SNAPSHOT}/{DATA_FILE}", None, lambda d, _: _rewarm_fresh(d, True, huge=True), "XXH3-64"),
    "rewarm_fresh_noverify": (f"{SNAPSHOT}/{DATA_FILE}", None, lambda d, _: _rewarm_fresh(d, "auto", False), ""),
    "rewarm_zygote": (f"{SNAPSHOT}/{DATA_FILE}", _rewarm_zygote_setup, _rewarm_zygote, "XXH3-64"),
    "runai_model_streamer": (SAFETENSORS, None, _runai, ""),
    "fastsafetensors": (SAFETENSORS, None, _fastsafetensors, ""),
    "tensorizer": (TENSORIZER, None, _tensorizer(False), ""),
    "tensorizer_verify_hash": (TENSORIZER, None, _tensorizer(True), "CRC32+SHA-256"),
    "safetensors_load_file": (SAFETENSORS, None, _st_file("pread"), ""),
    "safetensors_load_bytes": (SAFETENSORS, None, _st_bytes, ""),
    "safetensors_mmap": (SAFETENSORS, None, _st_file("mmap"), ""),
    "torch_load_mmap": (TORCH_SAVE, None, _torch_load, ""),
}
PEERS = [k for k in LOADERS if not k.startswith("rewarm_")]
IMPORT_FIRST = {"runai_model_streamer": "runai_model_streamer", "fastsafetensors": "fastsafetensors",
                "tensorizer": "tensorizer", "tensorizer_verify_hash": "tensorizer",
                "safetensors_load_file": "safetensors.torch", "safetensors_load_bytes": "safetensors.torch",
                "safetensors_mmap": "safetensors.torch"}


def first_touch(nbytes: int) -> dict:
    """Seconds to fault in ``nbytes`` of fresh anonymous memory, 4 KiB pages, one thread
    (MADV_POPULATE_WRITE): what any load into fresh memory pays at least once per page."""
    import mmap
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    t = time.perf_counter()
    _restore.populate(m)
    return {"seconds": time.perf_counter() - t, "bytes": nbytes}


def odirect_raw(d: Path, block: int, qd: int) -> dict:
    """One cold O_DIRECT read of the snapshot's data file into a prefaulted buffer, no hashing:
    the disk's limit for this process.  ``block``-byte preads from ``qd`` threads."""
    import mmap
    data = d / SNAPSHOT / DATA_FILE
    nbytes = os.stat(data).st_size
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _restore.populate(m)
    fd_d, fd_b = os.open(data, os.O_RDONLY | os.O_DIRECT), os.open(data, os.O_RDONLY)
    try:
        jobs = [(fd_d, fd_b, off, min(block, nbytes - off), off, 0) for off in range(0, nbytes, block)]
        share = drop_cache(data)
        t = time.perf_counter()
        res = _restore.read_chunks(m, jobs, qd, False, block)
        s = time.perf_counter() - t
    finally:
        os.close(fd_d)
        os.close(fd_b)
    if not all(r[0] == 0 and r[2] for r in res):
        raise OSError("O_DIRECT read failed")
    return {"seconds": s, "bytes": nbytes, "resident_before": share}


def drop_cache(path: Path) -> float:
    """fsync + POSIX_FADV_DONTNEED; the resident share afterwards (mincore), 0.0 when it took."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return _restore.resident_fraction(str(path))


def warm_cache(path: Path) -> float:
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return _restore.resident_fraction(str(path))


def touch(tensors: dict) -> int:
    """Read every byte once: the max of each tensor's bytes (uint8 view; a reduction that
    allocates nothing, where sum(dtype=int64) would copy the tensor as int64). Returns bytes."""
    n = 0
    for v in tensors.values():
        flat = v.reshape(-1).view(torch.uint8)
        if flat.numel():
            flat.max()
        n += flat.numel()
    return n


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def run(name: str, d: Path, cold: bool) -> dict:
    src, setup, load, verified = LOADERS[name]
    __import__(IMPORT_FIRST.get(name, "agent.snapshot.reader"))   # imports are not load time
    touch({"warm-up": torch.ones(1 << 16, dtype=torch.bfloat16)})   # start torch's threads first
    state = setup(d) if setup else None
    share = drop_cache(d / src) if cold else warm_cache(d / src)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                    # VmHWM := VmRSS
    base = _status("VmRSS:")
    t0 = time.perf_counter()
    tensors, keep, mode = load(d, state)
    t1 = time.perf_counter()
    nbytes = touch(tensors)
    t2 = time.perf_counter()
    out = {"load_s": t1 - t0, "touch_s": t2 - t1, "seconds": t2 - t0, "bytes": nbytes,
           "verified": verified, "resident_before": share, "rss_baseline_bytes": base,
           "rss_peak_bytes": _status("VmHWM:"), "mode": mode}
    del tensors, keep
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["first_touch"] and len(argv) == 2:
        print(json.dumps(first_touch(int(argv[1]))))
        return 0
    if argv[:1] == ["odirect_raw"] and len(argv) == 4:
        print(json.dumps(odirect_raw(Path(argv[1]), int(argv[2]), int(argv[3]))))
        return 0
    if len(argv) != 3 or argv[0] not in LOADERS or argv[2] not in ("cold", "warm"):
        print(f"usage: restore_peers.py {{{','.join(LOADERS)}}} DIR cold|warm", file=sys.stderr)
        return 2
    print(json.dumps(run(argv[0], Path(argv[1]), argv[2] == "cold")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
