"""Restore throughput into device memory (bench/device_check.py's ``throughput_*`` steps).

    python bench/throughput_check.py --cpu-smoke [--size-mib 64] [--out FILE]

One snapshot and one .safetensors file of the same bf16 tensors (bench/restore_throughput.py
``layer_mix``: embedding, Llama layers of hidden 2048 / intermediate 8192 / KV 512, final norm,
lm_head, the last tensor cut to size), then, every figure on the same bytes (GB/s = 10^9 B/s):

- limits: ``h2d_pinned`` (one pinned host-to-device copy of min(size, 2 GiB), best of 3) and
  ``h2d_pinned_4streams`` (the same bytes in four parts on four streams at once: the link's
  own limit), ``raw_read_cold`` (O_DIRECT, 16 MiB x 8 threads, page cache dropped;
  bench/restore_throughput.py ``raw_odirect``);
- ``{staged,kvikio}_warm_{verified,unverified}``: agent/snapshot/gpu.py ``restore_to_device``
  with each strategy into a DeviceBuffer made before the clock (a zygote's), the files in the
  page cache; target >= 0.7 x h2d_pinned;
- ``default_cold_verified``: the strategy ``choose_strategy`` picks on this node, page cache
  dropped; target >= 0.9 x raw_read_cold;
- ``safetensors_{warm,cold}``: ``safetensors.torch.load_file(path, device="cuda")``; the
  default strategy's verified rate against them: targets >= 1.5 x warm, >= 1.2 x cold;
- ``default_warm_verified_s``: the default strategy's warm restore, wall seconds (manifest
  read and tensor views included); for the 8B shape, target < 1 s;
- ``host_cold_verified``: the host path a failed device read falls back to (ext/ reader into a
  host buffer, then a copy to the device), run last and only while the budget allows.

Restore rates are wall time around ``restore_to_device`` (manifest, checks, reads, verification,
copies, tensor views; the machine's pins were read when the buffer was allocated, as a
zygote's are).  Each restore's own per-stage times
(agent/snapshot/staging.py ``DeviceRestoreStats.figures``) are noted beside its figure.

Time (the 16 GB 8B shape on a node reading 2.1 GB/s cold, ~80 s in all): writing ~20 s (the
writer's fsync and read-back), then the order keeps reads from the disk to five of ~8 s:
safetensors warm while its file is still cached, drop both files, raw read, default strategy
cold, safetensors cold, read the snapshot back into the page cache (eight threads), the warm
runs, and host cold last if ``budget_s`` allows.

Cold = fsync + POSIX_FADV_DONTNEED on the data files, checked with mincore (the resident share
is noted); warm = the files' pages resident, checked the same way.  The figures are one run
each (the check's time is bounded); the steps that compare run back to back.

``--cpu-smoke``: the same steps with a CPU tensor as the device (the link is a memcpy between
two host buffers, no kvikio without the driver), plus the staged path into a meta tensor (the
host-side work alone: read and hash, no copy) and the host path warm: a run of the logic on
any machine, and the host-side figures of the pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(REPO), str(REPO / "bench")) if p not in sys.path]

WARM_FACTOR, COLD_FACTOR, PEER_WARM, PEER_COLD = 0.7, 0.9, 1.5, 1.2
WARM_SECONDS_8B = 1.0
SIZE_8B = 8_030_261_248 * 2       # Llama 3 8B in bf16 (bench/device_check.py SIZES)
STREAMS = 4
H2D_BYTES = 2 << 30


def _write(root: Path, size_bytes: int, device: str) -> tuple[Path, Path, int]:
    import torch
    from restore_throughput import layer_mix
    from safetensors.torch import save_file

    from agent.snapshot.format import ModelIdentity
    from agent.snapshot.pins import machine_pins
    from agent.snapshot.writer import write_snapshot

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    gen = "cuda" if device.startswith("cuda") else "cpu"
    g = torch.Generator(device=gen).manual_seed(0)
    tensors = {n: torch.randn(s, generator=g, device=gen).to(torch.bfloat16).cpu()
               for n, s in layer_mix(size_bytes)}
    total = sum(t.numel() * 2 for t in tensors.values())
    write_snapshot(root / "snap", tensors, model=ModelIdentity("device-check", "1", "none"),
                   pins=machine_pins(device), extra={"mix": "llama-layers"})
    save_file(tensors, str(root / "model.safetensors"))
    return root / "snap", root / "model.safetensors", total


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _link(nbytes: int, device: str, streams: int) -> float:
    """GB/s of a pinned host-to-device copy of ``nbytes`` in ``streams`` parts on as many
    streams at once, best of 3; off a GPU a copy between two host buffers stands in."""
    import torch
    cuda = device.startswith("cuda")
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    step = -(-nbytes // streams // 4096) * 4096
    parts = [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]
    ss = [torch.cuda.Stream() for _ in parts] if cuda else [None] * len(parts)
    best = float("inf")
    for _ in range(3):
        _sync(device)
        t = time.perf_counter()
        for s, (a, b) in zip(ss, parts, strict=True):
            if s is None:
                dst[a:b].copy_(src[a:b])
            else:
                with torch.cuda.stream(s):
                    dst[a:b].copy_(src[a:b], non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


class _Files:
    def __init__(self, snap: Path, st_path: Path) -> None:
        self.data = sorted(snap.glob("data-*.bin"))
        self.st = st_path

    def cold(self, *which: str) -> float:
        from restore_peers import drop_cache
        return max(drop_cache(f) for f in self._pick(which))

    def warm(self, *which: str) -> float:
        """Bring the files into the page cache: buffered preads of 16 MiB on eight threads
        (the disk kept busy) into a scratch buffer whose bytes are thrown away; the resident
        share afterwards.  (Faulting a map in with MADV_POPULATE_READ fills the cache faster,
        but the first pread of those pages then took four times as long on the development
        VM, which would be charged to the first warm restore.)"""
        from agent import _restore
        from agent.snapshot.reader import HostBuffer

        step, threads = 16 << 20, 8
        scratch = HostBuffer.allocate(step * threads, prefault=True)
        try:
            for f in self._pick(which):
                if _restore.resident_fraction(str(f)) > 0.999:
                    continue
                fd = os.open(f, os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    jobs = [(-1, fd, a, min(step, size - a), (k % threads) * step, 0)
                            for k, a in enumerate(range(0, size, step))]
                    _restore.read_chunks(scratch.memory, jobs, threads, False, 1 << 20)
                finally:
                    os.close(fd)
        finally:
            scratch.release()
        return min(_restore.resident_fraction(str(f)) for f in self._pick(which))

    def _pick(self, which: tuple[str, ...]) -> list[Path]:
        return (self.data if "snap" in which else []) + ([self.st] if "st" in which else [])


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else float("inf")


def run_throughput(figs: Any, size_bytes: int, root: Path, *, device: str = "cuda",
                   kvikio: Any = None, budget_s: float = 100.0) -> None:
    """Measure every figure of the module docstring into ``figs`` (``fig(name, value, unit,
    path, limit, target, met)``, ``note(text)``, ``data["figures"]``: bench/device_check.py
    ``Figures``).  ``device``: "cuda" on a GPU node, "cpu" for the smoke run; ``kvikio``: the
    module for the kvikio strategy (default: gpu.load_kvikio(), skipped with a note where it
    cannot load); ``budget_s``: the host-path cold run is skipped when it would end later."""
    import torch
    from restore_throughput import raw_odirect
    from safetensors.torch import load_file

    from agent.snapshot import gpu
    from agent.snapshot.reader import HostBuffer, restore_snapshot

    t0 = time.perf_counter()
    cuda = device.startswith("cuda")
    for old in root.parent.glob("tp-*"):     # an earlier size's files, if its step was cut off
        shutil.rmtree(old, ignore_errors=True)
    snap, st_path, total = _write(root, size_bytes, device)
    files = _Files(snap, st_path)
    figs.fig("bytes", total, "B")
    figs.fig("write_s", round(time.perf_counter() - t0, 1), "s")
    link_path = "host" if cuda else "cpu"

    h2d = round(_link(min(total, H2D_BYTES), device, 1), 3)
    figs.fig("h2d_pinned", h2d, "GB/s", path=link_path)
    figs.fig(f"h2d_pinned_{STREAMS}streams", round(_link(min(total, H2D_BYTES), device, STREAMS), 3),
             "GB/s", path=link_path)
    if not cuda:
        figs.note("no GPU: h2d_pinned is a copy between two host buffers (the link's stand-in)")
    if cuda:
        torch.cuda.empty_cache()

    if kvikio is None:
        try:
            kvikio = gpu.load_kvikio()
        except gpu.DriverUnavailable as exc:
            figs.note(f"kvikio strategy skipped: {exc}")
    default = gpu.choose_strategy(None, device, kvikio)
    figs.note(f"default strategy here: {default} ({gpu.STRATEGY_ENV}="
              f"{os.environ.get(gpu.STRATEGY_ENV, '')!r})")
    strategies = ["staged"] + (["kvikio"] if kvikio is not None else [])
    if default not in strategies:
        default = "staged"
    buffers = [gpu.DeviceBuffer.allocate(total, device, kvikio=kvikio, strategy=default)]
    for s in strategies:
        buffers[0].prepare(s)    # every strategy's staging made before any clock starts

    def restore(strategy: str, verify: bool, name: str, limit: dict | None, factor: float | None):
        t = time.perf_counter()
        r = gpu.restore_to_device(snap, device=device, buffer=buffers[0], verify=verify,
                                  kvikio=kvikio, strategy=strategy)
        _sync(device)
        wall = time.perf_counter() - t
        rate = _gbps(total, wall)
        target = met = None
        if limit and factor:
            target = f">= {factor} x limit"
            met = rate >= factor * next(iter(limit.values()))
        figs.fig(name, rate, "GB/s", path=r.stats.mode, limit=limit, target=target, met=met)
        figs.note(f"{name}: {r.stats.threads} threads, pipeline {r.stats.gbps:.2f} GB/s, {r.stats.figures}")
        return wall

    # safetensors warm while its file is still in the page cache from the write
    def st_load() -> float:
        _sync(device)
        t = time.perf_counter()
        loaded = load_file(str(st_path), device=device)
        _sync(device)
        s = time.perf_counter() - t
        del loaded
        return s

    resident = files.warm("st")
    st_warm = _gbps(total, st_load())
    figs.fig("safetensors_warm", st_warm, "GB/s", path="host")
    if not cuda:
        figs.note("no GPU: safetensors maps the file and reads no byte until a tensor is used, "
                  "so its figures and the comparisons with them are not loads here")
    figs.note(f"safetensors_warm: page-cache share before it {resident:.2f}")

    # cold: raw read, the default strategy, safetensors
    files.cold("snap", "st")
    host = HostBuffer.allocate(max([total] + [f.stat().st_size for f in files.data]), prefault=True)
    raw = _gbps(total, sum(raw_odirect(f, f.stat().st_size, host, 16 << 20, 8) for f in files.data))
    figs.fig("raw_read_cold", raw, "GB/s", path="host")
    resident = files.cold("snap")
    restore(default, True, "default_cold_verified", {"raw_read_cold": raw}, COLD_FACTOR)
    figs.note(f"default_cold_verified: page-cache share before it {resident:.2f}")
    mine_cold = figs.data["figures"]["default_cold_verified"]["value"]
    resident = files.cold("st")
    st_cold = _gbps(total, st_load())
    figs.fig("safetensors_cold", st_cold, "GB/s", path="host")
    figs.note(f"safetensors_cold: page-cache share before it {resident:.2f}")
    figs.fig("default_cold_verified_vs_safetensors", round(mine_cold / st_cold, 2), "x",
             limit={"safetensors_cold": st_cold}, target=f">= {PEER_COLD} x",
             met=mine_cold >= PEER_COLD * st_cold)

    # warm: every strategy, verified and not
    resident = files.warm("snap")
    figs.note(f"warm runs: page-cache share of the snapshot before them {resident:.2f}")
    walls = {}
    for s in strategies:
        for verify in (True, False):
            name = f"{s}_warm_{'verified' if verify else 'unverified'}"
            walls[name] = restore(s, verify, name, {"h2d_pinned": h2d}, WARM_FACTOR)
    mine_warm = figs.data["figures"][f"{default}_warm_verified"]["value"]
    figs.fig("default_warm_verified_vs_safetensors", round(mine_warm / st_warm, 2), "x",
             limit={"safetensors_warm": st_warm}, target=f">= {PEER_WARM} x",
             met=mine_warm >= PEER_WARM * st_warm)
    big = total >= SIZE_8B
    figs.fig("default_warm_verified_s", round(walls[f"{default}_warm_verified"], 3), "s",
             path=figs.data["figures"][f"{default}_warm_verified"]["path"],
             target=f"< {WARM_SECONDS_8B} s" if big else None,
             met=walls[f"{default}_warm_verified"] < WARM_SECONDS_8B if big else None)
    buffers.clear()
    if cuda:
        torch.cuda.empty_cache()

    if not cuda:     # the CPU's own figures: the host-side work alone, and the host path warm
        meta = gpu.DeviceBuffer.allocate(total, "meta", strategy="staged")
        t = time.perf_counter()
        r = gpu.restore_to_device(snap, device="meta", buffer=meta, machine=gpu.device_pins("cpu"))
        figs.fig("staged_host_side_warm_verified", _gbps(total, time.perf_counter() - t), "GB/s",
                 path="staged")
        figs.note(f"staged_host_side_warm_verified: read + hash into slots, no copy: {r.stats.figures}")
        t = time.perf_counter()
        restore_snapshot(snap, buffer=host, verify=True)
        figs.fig("host_warm_verified", _gbps(total, time.perf_counter() - t), "GB/s", path="host")

    # the host path cold, last, while the budget allows
    need = total / (raw * 1e9) + 5 if raw > 0 else 0
    if time.perf_counter() - t0 + need > budget_s:
        figs.note(f"host_cold_verified skipped: {time.perf_counter() - t0:.0f} s spent, it needs "
                  f"~{need:.0f} s of the {budget_s:.0f} s budget")
    else:
        files.cold("snap")
        t = time.perf_counter()
        r = restore_snapshot(snap, buffer=host, verify=True)
        on_device = {k: v.to(device, non_blocking=True) for k, v in r.tensors.items()}
        _sync(device)
        figs.fig("host_cold_verified", _gbps(total, time.perf_counter() - t), "GB/s", path="host",
                 limit={"raw_read_cold": raw})
        del on_device, r
    del host
    shutil.rmtree(root, ignore_errors=True)
    os.sync()
    figs.fig("step_s", round(time.perf_counter() - t0, 1), "s")


class Table:
    """The ``Figures`` interface of bench/device_check.py, kept in memory (the smoke run)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {"figures": {}, "notes": []}

    def fig(self, name: str, value: Any, unit: str, path: str = "-", limit: dict | None = None,
            target: str | None = None, met: bool | None = None) -> None:
        self.data["figures"][name] = {"value": value, "unit": unit, "path": path,
                                      "limit": limit or {}, "target": target, "met": met}

    def note(self, text: str) -> None:
        self.data["notes"].append(text)

    def render(self) -> str:
        lines = [f"{'figure':<40}{'value':>10} {'unit':<6}{'path':<8}{'limit':<30}{'target':<18}met"]
        for name, f in self.data["figures"].items():
            limit = ", ".join(f"{k}={v}" for k, v in f["limit"].items())
            met = {True: "yes", False: "NO", None: ""}[f["met"]]
            lines.append(f"{name:<40}{str(f['value']):>10} {f['unit']:<6}{f['path']:<8}{limit:<30}"
                         f"{f['target'] or '':<18}{met}")
        return "\n".join(lines + [f"note: {n}" for n in self.data["notes"]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", required=True,
                    help="run every step with a CPU tensor as the device (the GPU node runs "
                         "this module through bench/device_check.sh)")
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--root", type=Path, default=REPO / "var" / "throughput_check" / "tp-smoke")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    table = Table()
    run_throughput(table, args.size_mib << 20, args.root, device="cpu")
    table.data["meta"] = {"command": "bench/throughput_check.py --cpu-smoke --size-mib "
                                     f"{args.size_mib}", "cores": os.cpu_count(),
                          "loadavg": Path("/proc/loadavg").read_text().split()[:3],
                          "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(table.render())
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(table.data, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
