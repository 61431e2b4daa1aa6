"""Restore throughput into device memory (bench/device_check.py's ``throughput_*`` steps).

One snapshot and one .safetensors file of the same bf16 tensors (bench/restore_throughput.py
``layer_mix``: embedding, Llama layers of hidden 2048 / intermediate 8192 / KV 512, final norm,
lm_head, the last tensor cut to size), then, every figure on the same bytes:

- limits: ``raw_read_cold`` (O_DIRECT sequential reads, 16 MiB x 8 threads, page cache dropped;
  bench/restore_throughput.py ``raw_odirect``) and ``h2d_pinned`` (one pinned host-to-device
  copy of min(size, 2 GiB), best of 3);
- ``kvikio_{cold,warm}_{verified,unverified}``: agent/snapshot/gpu.py ``restore_to_device`` into a
  DeviceBuffer allocated before the clock (a zygote's), path gds or compat;
- ``host_cold_verified``: the host path a failed device read falls back to (ext/ reader into a
  host buffer, then a copy to the device), path host;
- ``safetensors_{cold,warm}``: ``safetensors.torch.load_file(path, device="cuda")``.

Cold = fsync + POSIX_FADV_DONTNEED on the data files, checked with mincore (the resident share
is noted); warm = the files read once before.  Targets: cold kvikio >= 0.7 x min(raw_read_cold,
h2d_pinned); warm kvikio >= 0.7 x h2d_pinned; kvikio verified >= 1.5 x safetensors (cold and
warm).  GB/s = 10^9 bytes per second.  The figures are best of one run each (the check's time is
bounded); the steps that compare are run back to back.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

COLD_FACTOR, WARM_FACTOR, PEER_FACTOR = 0.7, 0.7, 1.5


def _write(root: Path, size_bytes: int) -> tuple[Path, Path, int]:
    import torch
    from safetensors.torch import save_file
    from restore_throughput import layer_mix

    from agent.snapshot.format import ModelIdentity
    from agent.snapshot.pins import machine_pins
    from agent.snapshot.writer import write_snapshot

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {n: torch.randn(s, generator=g, device="cuda").to(torch.bfloat16).cpu()
               for n, s in layer_mix(size_bytes)}
    total = sum(t.numel() * 2 for t in tensors.values())
    write_snapshot(root / "snap", tensors, model=ModelIdentity("device-check", "1", "none"),
                   pins=machine_pins("cuda"), extra={"mix": "llama-layers"})
    save_file(tensors, str(root / "model.safetensors"))
    return root / "snap", root / "model.safetensors", total


def _h2d_pinned(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def run_throughput(figs, size_bytes: int, root: Path) -> None:
    import torch
    from restore_peers import drop_cache, warm_cache
    from restore_throughput import raw_odirect
    from safetensors.torch import load_file

    from agent.snapshot import gpu
    from agent.snapshot.reader import HostBuffer, restore_snapshot

    for old in root.parent.glob("tp-*"):     # an earlier size's files, if its step was cut off
        shutil.rmtree(old, ignore_errors=True)
    t = time.perf_counter()
    snap, st_path, total = _write(root, size_bytes)
    figs.fig("bytes", total, "B")
    figs.fig("write_s", round(time.perf_counter() - t, 1), "s")
    data = sorted(snap.glob("data-*.bin"))
    files = data + [st_path]

    def cold() -> float:
        return max(drop_cache(f) for f in files)

    def warm() -> float:
        return min(warm_cache(f) for f in files)

    host = HostBuffer.allocate(max([total] + [f.stat().st_size for f in data]), prefault=True)
    raw_s = sum(raw_odirect(f, f.stat().st_size, host, 16 << 20, 8) for f in data)
    raw = total / raw_s / 1e9
    figs.fig("raw_read_cold", round(raw, 3), "GB/s", path="host")
    h2d = _h2d_pinned(min(total, 2 << 30))
    figs.fig("h2d_pinned", round(h2d, 3), "GB/s", path="host")
    cold_limit = min(raw, h2d)
    try:
        kvikio = gpu.load_kvikio()
    except gpu.DriverUnavailable as exc:
        kvikio = None
        figs.note(f"kvikio figures skipped: {exc}")
    if kvikio is not None:
        buf = gpu.DeviceBuffer.allocate(total, "cuda", kvikio=kvikio)
        for temp in ("cold", "warm"):
            for verify in (True, False):
                resident = cold() if temp == "cold" else warm()
                r = gpu.restore_to_device(snap, device="cuda", buffer=buf, verify=verify)
                name = f"kvikio_{temp}_{'verified' if verify else 'unverified'}"
                rate = round(r.stats.bytes / r.stats.seconds / 1e9, 3)
                limit = ({"min(raw_read_cold, h2d_pinned)": round(cold_limit, 3)} if temp == "cold"
                         else {"h2d_pinned": round(h2d, 3)})
                factor = COLD_FACTOR if temp == "cold" else WARM_FACTOR
                figs.fig(name, rate, "GB/s", path=r.stats.mode, limit=limit,
                         target=f">= {factor} x limit", met=rate >= factor * next(iter(limit.values())))
                figs.note(f"{name}: page-cache share of the files before it {resident:.2f}")
                del r
        del buf
        torch.cuda.empty_cache()
    cold()
    t = time.perf_counter()
    r = restore_snapshot(snap, buffer=host, verify=True)
    on_device = {k: v.to("cuda", non_blocking=True) for k, v in r.tensors.items()}
    torch.cuda.synchronize()
    figs.fig("host_cold_verified", round(total / (time.perf_counter() - t) / 1e9, 3), "GB/s",
             path="host", limit={"min(raw_read_cold, h2d_pinned)": round(cold_limit, 3)})
    del on_device, r
    torch.cuda.empty_cache()
    for temp in ("cold", "warm"):
        cold() if temp == "cold" else warm()
        torch.cuda.synchronize()
        t = time.perf_counter()
        st = load_file(str(st_path), device="cuda")
        torch.cuda.synchronize()
        rate = round(total / (time.perf_counter() - t) / 1e9, 3)
        del st
        torch.cuda.empty_cache()
        mine = figs.data["figures"].get(f"kvikio_{temp}_verified", {}).get("value")
        figs.fig(f"safetensors_{temp}", rate, "GB/s", path="host")
        if mine is not None:
            figs.fig(f"kvikio_{temp}_verified_vs_safetensors", round(mine / rate, 2), "x",
                     limit={f"safetensors_{temp}": rate}, target=f">= {PEER_FACTOR} x",
                     met=mine >= PEER_FACTOR * rate)
    del host
    shutil.rmtree(root, ignore_errors=True)
    os.sync()
