"""Restore throughput: rewarm's verified restore against the disk, memcpy and the loaders users pick.

    python bench/restore_throughput.py --size-gib 1 4 --peers --json var/bench/restore_throughput.json
    (``make bench`` installs the peers and runs exactly this)

Generates N GiB of bf16 tensors once per size (a Llama-style layer mix: embedding, per layer
two 4 KiB norms, q/k/v/o with grouped KV, gate/up/down; hidden 2048, intermediate 8192, KV
dim 512, vocabulary 32768; the last tensor cut to fit), written as a rewarm snapshot, one
.safetensors file, one tensorizer file (with hashes) and one torch.save file, and measures on
that same data.

In this process (the zygote path: a buffer allocated and faulted in before the clock):

- odirect_limit: raw O_DIRECT sequential reads of the snapshot's data file (no hashing), best
  over a sweep of block size × queue depth, and the best setting again in turn with each cold
  restore run (the disk's speed drifts on a shared machine; the limit is the best seen, here
  and in the per-process rounds below);
- memcpy: one host-to-host copy of min(N GiB, 1 GiB) between two prefaulted buffers, run in
  turn with the warm restores;
- rewarm cold (page cache dropped: fsync + posix_fadvise DONTNEED, checked with mincore) and
  warm (file in the page cache), with and without verification (best of --repeat);
- without --peers: safetensors.torch.load_file cold and warm (every page faulted in) and
  torch.load(mmap=True) warm, as before.

In a fresh process per load (bench/restore_peers.py; --rounds alternating rounds, each round
every loader cold then warm; medians and min–max), each load followed by the same full
touch pass (every byte read) inside the clock:

- rewarm_fresh: restore_snapshot(path) as a fresh process calls it (the locked private map);
  rewarm_fresh_copy: the safe copy into fresh anonymous memory (4 KiB pages);
  rewarm_fresh_copy_huge: the same copy into transparent huge pages; rewarm_fresh_noverify;
  rewarm_zygote: into a buffer prefaulted in that process before the clock;
- first_touch: faulting fresh 4 KiB anonymous memory in, one thread; odirect_raw: the limit
  again, once per round;
- with --peers: runai-model-streamer, fastsafetensors (nogds, CPU), tensorizer with and without
  verify_hash, safetensors load_file (pread backend), load(bytes) and load_file's mmap backend,
  torch.load(mmap=True).  sllm-store is not measured: it builds only with CUDA or ROCm.

Memory: each fresh-process load's peak RSS (VmHWM, reset after its imports) less its baseline.
GB/s is 10^9 bytes per second.  Targets (1 GiB and 4 GiB, the 2-core machine):
fresh-process verified cold ≥ 0.85 × O_DIRECT limit and warm ≥ 0.8 × first touch; zygote cold
≥ 0.9 × limit and warm ≥ 0.6 × memcpy; fresh verified cold ≥ 1.5 × the best peer's cold;
verification overhead ≤ 10 %; RSS added ≤ snapshot bytes + 64 MiB.  The zygote path's targets
against safetensors are kept in the table too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent import _restore  # noqa: E402
from agent.snapshot.format import ModelIdentity  # noqa: E402
from agent.snapshot.reader import HostBuffer, read_manifest, restore_snapshot  # noqa: E402
from agent.snapshot.writer import DATA_NAME, write_snapshot  # noqa: E402
from restore_peers import drop_cache, warm_cache  # noqa: E402 (bench/ is the script's dir)

# A Llama-style layer (Llama 3.2 1B's widths): (name, shape) of bf16 tensors, every one a
# multiple of 4 KiB so the snapshot holds exactly the requested bytes.
HIDDEN, INTER, KV, VOCAB = 2048, 8192, 512, 32768
LAYER = [("input_layernorm.weight", (HIDDEN,)), ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
         ("self_attn.k_proj.weight", (KV, HIDDEN)), ("self_attn.v_proj.weight", (KV, HIDDEN)),
         ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)), ("post_attention_layernorm.weight", (HIDDEN,)),
         ("mlp.gate_proj.weight", (INTER, HIDDEN)), ("mlp.up_proj.weight", (INTER, HIDDEN)),
         ("mlp.down_proj.weight", (HIDDEN, INTER))]


def layer_mix(size_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of bf16 tensors totalling exactly ``size_bytes`` (a multiple of 4 KiB):
    embedding, layers, final norm, lm_head, in that order, the last one cut by rows."""
    seq = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    i = 0
    while sum(2 * _numel(s) for _, s in seq) < size_bytes:
        seq += [(f"model.layers.{i}.{n}", s) for n, s in LAYER]
        i += 1
    seq += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    out, left = [], size_bytes
    for name, shape in seq:
        if left <= 0:
            break
        if 2 * _numel(shape) > left:
            row = 2 * _numel(shape[1:])
            shape = (left // row, *shape[1:]) if left >= row else (left // 2,)
        out.append((name, shape))
        left -= 2 * _numel(shape)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def best(fn, repeat: int) -> float:
    """Smallest wall time of ``repeat`` calls of fn() (fn does its own setup before timing)."""
    return min(fn() for _ in range(repeat))


def generate(root: Path, size_bytes: int) -> tuple[Path, Path, Path]:
    """The same tensors as a snapshot, model.safetensors, model.tensors (tensorizer) and model.pt
    under ``root`` (kept while the snapshot's recorded size matches)."""
    snap, st_path, pt_path, tz_path = root / "snapshot", root / "model.safetensors", root / "model.pt", root / "model.tensors"
    import importlib.util
    need = [snap / "manifest.msgpack", st_path, pt_path] + ([tz_path] if importlib.util.find_spec("tensorizer") else [])
    if all(p.exists() for p in need) \
            and read_manifest(snap).extra.get("size_bytes") == size_bytes \
            and read_manifest(snap).extra.get("mix") == "llama-layers":
        return snap, st_path, pt_path
    import shutil
    for p in (snap, st_path, pt_path, tz_path):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in layer_mix(size_bytes)}
    write_snapshot(snap, tensors, model=ModelIdentity("bench", "1", "sha256:0"),
                   extra={"size_bytes": size_bytes, "mix": "llama-layers"})
    save_file(tensors, st_path)
    torch.save(tensors, pt_path)
    try:
        from tensorizer import TensorSerializer
        ser = TensorSerializer(str(tz_path))
        ser.write_state_dict(tensors)
        ser.close()
    except ImportError:
        pass                       # no peers installed: the tensorizer rows are skipped
    return snap, st_path, pt_path


def raw_odirect(data: Path, nbytes: int, buf: HostBuffer, block: int, qd: int) -> float:
    """Seconds for one cold sequential O_DIRECT read of ``data``: ``qd`` threads, ``block`` preads."""
    try:
        fd_d = os.open(data, os.O_RDONLY | os.O_DIRECT)
    except OSError:             # e.g. tmpfs: no direct I/O; the figure is then a buffered read
        fd_d = -1
    fd_b = os.open(data, os.O_RDONLY)
    try:
        jobs = [(fd_d, fd_b, off, min(block, nbytes - off), off, 0) for off in range(0, nbytes, block)]
        drop_cache(data)
        t = time.perf_counter()
        res = _restore.read_chunks(buf.memory, jobs, qd, False, block)
        s = time.perf_counter() - t
        assert all(r[0] == 0 and r[2] == (fd_d >= 0) for r in res), "O_DIRECT read failed"
        return s
    finally:
        if fd_d >= 0:
            os.close(fd_d)
        os.close(fd_b)


def odirect_sweep(data: Path, nbytes: int, buf: HostBuffer, repeat: int) -> tuple[tuple[int, int], dict]:
    """Best (block, queue depth) over the sweep, and GB/s of each (one run each: the best
    setting is run again in every round, which is where the limit's repeats come from)."""
    sweep, best_cfg, best_gbps = {}, (0, 0), 0.0
    for block in (1 << 20, 4 << 20):
        for qd in (2, 4, 8):
            gbps = nbytes / raw_odirect(data, nbytes, buf, block, qd) / 1e9
            sweep[f"{block >> 20}MiB x qd{qd}"] = gbps
            if gbps > best_gbps:
                best_cfg, best_gbps = (block, qd), gbps
    return best_cfg, sweep


def memcpy_once(src: torch.Tensor, dst: torch.Tensor) -> float:
    """Seconds for one copy of ``src`` into ``dst`` (uint8, prefaulted; torch's threads)."""
    t = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t


ODIRECT_USED: dict[str, bool] = {}


def rewarm_once(snap: Path, data: Path, buf: HostBuffer, cold: bool, verify: bool, share: list) -> float:
    """One restore's seconds; ``direct="auto"`` picks O_DIRECT when cold, page-cache copies when warm."""
    share.append(drop_cache(data) if cold else warm_cache(data))
    r = restore_snapshot(snap, buffer=buf, verify=verify)
    ODIRECT_USED[f"{'cold' if cold else 'warm'}{'' if verify else '_noverify'}"] = r.stats.odirect
    return r.stats.seconds


def interleaved(fns: dict, repeat: int) -> dict:
    """Best time of each fn, running them in turn ``repeat`` times: on a shared machine the
    disk's and CPU's speed drift, and compared figures should see the same drift."""
    times = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            times[k] = min(times[k], fn())
    return times


def touch_pages(tensors: dict) -> None:
    """Read one byte of every 4 KiB page: faults each page of a lazily mapped tensor in."""
    for v in tensors.values():
        v.reshape(-1).view(torch.uint8)[::4096].sum()


def safetensors_time(path: Path, cold: bool, repeat: int, touch: bool) -> tuple[float, float]:
    """load_file maps the file lazily (pages are read on first use), so with ``touch`` every
    page is faulted in before the clock stops: the weights are then in memory, as after a restore."""
    share = []

    def run():
        share.append(drop_cache(path) if cold else warm_cache(path))
        t = time.perf_counter()
        out = load_file(path)
        if touch:
            touch_pages(out)
        s = time.perf_counter() - t
        del out
        gc.collect()
        return s
    return best(run, repeat), max(share)


def torch_load_time(path: Path, repeat: int) -> float:
    warm_cache(path)

    def run():
        t = time.perf_counter()
        out = torch.load(path, mmap=True, weights_only=True)
        for v in out.values():
            v.view(torch.int32).sum(dtype=torch.int64)
        s = time.perf_counter() - t
        del out
        return s
    return best(run, repeat)


PEERS_PY = REPO / "bench" / "restore_peers.py"
REWARM_LOADERS = ["rewarm_fresh", "rewarm_fresh_copy", "rewarm_fresh_copy_huge", "rewarm_fresh_noverify",
                  "rewarm_zygote"]


def child(*args: str) -> dict:
    """Run bench/restore_peers.py in a process of its own; its last stdout line is JSON."""
    out = subprocess.run([sys.executable, str(PEERS_PY), *args], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["exit %d" % out.returncode])[-1][:300]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def peers_available() -> tuple[list[str], dict[str, str]]:
    """The peer loaders whose packages import here, and why each other one is missing."""
    import importlib.util
    sys.path.insert(0, str(REPO / "bench"))
    from restore_peers import IMPORT_FIRST, PEERS
    have, missing = [], {"sllm_store": "builds only with CUDA or ROCm (not on this machine)"}
    for name in PEERS:
        mod = IMPORT_FIRST.get(name, "torch").split(".")[0]
        if importlib.util.find_spec(mod) is None:
            missing[name] = f"{mod} not installed (make bench installs the peers)"
        else:
            have.append(name)
    return have, missing


def _summary(runs: list[dict], nbytes: int) -> dict:
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"gbps": None, "min_gbps": None, "max_gbps": None, "error": runs[0].get("error") if runs else "no run"}
    g = sorted(nbytes / r["seconds"] / 1e9 for r in ok)
    out = {"gbps": statistics.median(g), "min_gbps": g[0], "max_gbps": g[-1], "runs": len(ok)}
    if "rss_peak_bytes" in ok[0]:
        worst = max(ok, key=lambda r: r["rss_peak_bytes"] - r["rss_baseline_bytes"])
        out["peak_rss_delta_bytes"] = worst["rss_peak_bytes"] - worst["rss_baseline_bytes"]
        out["rss_baseline_bytes"], out["rss_peak_bytes"] = worst["rss_baseline_bytes"], worst["rss_peak_bytes"]
        out["resident_before"] = max(r["resident_before"] for r in ok) if ok[0]["resident_before"] is not None else None
        out["mode"] = ok[0]["mode"]
    return out


def fresh_rounds(d: Path, nbytes: int, loaders: list[str], rounds: int, block: int, qd: int) -> dict:
    """Alternating rounds: each round runs every loader cold then warm, each in its own process,
    plus one first-touch and one raw O_DIRECT run.  Returns per-loader summaries."""
    runs: dict[str, list[dict]] = {}
    loads = []
    for r in range(rounds):
        runs.setdefault("first_touch", []).append(child("first_touch", str(nbytes)))
        runs.setdefault("odirect_raw", []).append(child("odirect_raw", str(d), str(block), str(qd)))
        for name in loaders:
            for mode in ("cold", "warm"):
                runs.setdefault(f"{name}/{mode}", []).append(child(name, str(d), mode))
        loads.append(os.getloadavg()[0])
        print(f"  round {r + 1}/{rounds} done, load average {loads[-1]:.2f}", file=sys.stderr, flush=True)
    out = {k: _summary(v, nbytes) for k, v in runs.items()}
    out["_load_average"] = loads
    out["_cold_over_round_limit"] = {name: _paired(runs[f"{name}/cold"], runs["odirect_raw"]) for name in loaders}
    return out


def _paired(loads: list[dict], raws: list[dict]) -> dict:
    """Each round's cold load GB/s over the raw O_DIRECT read of the same round (the disk's
    speed drifts between rounds on a shared machine; a ratio within one round sees one speed):
    median and min-max over the rounds where both ran."""
    r = sorted(raw["seconds"] / load["seconds"] for load, raw in zip(loads, raws, strict=True)
               if "error" not in load and "error" not in raw)
    return {"median": statistics.median(r), "min": r[0], "max": r[-1]} if r else {"median": None}


def in_process(snap: Path, st_path: Path, pt_path: Path, repeat: int, classic: bool) -> dict:
    """The zygote-path figures of the earlier benchmark (this process, prefaulted buffer)."""
    data = snap / DATA_NAME
    nbytes = read_manifest(snap).total_bytes
    buf = HostBuffer.allocate(nbytes, prefault=True)      # a zygote's buffer, allocated ahead
    (block, qd), sweep = odirect_sweep(data, nbytes, buf, repeat)
    cold_share, warm_share = [], []
    t = interleaved({
        "raw": lambda: raw_odirect(data, nbytes, buf, block, qd),
        "cold": lambda: rewarm_once(snap, data, buf, True, True, cold_share),
        "cold_nv": lambda: rewarm_once(snap, data, buf, True, False, cold_share),
    }, repeat)
    n_copy = min(nbytes, 1 << 30)
    src, dst = torch.ones(n_copy, dtype=torch.uint8), torch.zeros(n_copy, dtype=torch.uint8)
    t.update(interleaved({
        "memcpy": lambda: memcpy_once(src, dst),
        "warm": lambda: rewarm_once(snap, data, buf, False, True, warm_share),
        "warm_nv": lambda: rewarm_once(snap, data, buf, False, False, warm_share),
    }, repeat))
    src = dst = buf = None   # drop the buffers (the lambdas above are done with them)
    gc.collect()
    g = lambda s: nbytes / s / 1e9  # noqa: E731
    res = {"bytes": nbytes, "odirect_limit_gbps": max(max(sweep.values()), g(t["raw"])),
           "memcpy_gbps": n_copy / t["memcpy"] / 1e9,
           "rewarm_cold_gbps": g(t["cold"]), "rewarm_warm_gbps": g(t["warm"]),
           "rewarm_cold_noverify_gbps": g(t["cold_nv"]), "rewarm_warm_noverify_gbps": g(t["warm_nv"]),
           "verify_overhead_pct": 100 * (t["cold"] - t["cold_nv"]) / t["cold"],
           "verify_overhead_warm_pct": 100 * (t["warm"] - t["warm_nv"]) / t["warm"],
           "resident_after_drop": max(cold_share), "resident_warm": min(warm_share),
           "odirect_sweep_gbps": sweep, "odirect_best": {"block_bytes": block, "queue_depth": qd},
           "odirect_used": dict(ODIRECT_USED)}
    if classic:
        st_cold, st_share = safetensors_time(st_path, True, repeat, touch=True)
        res.update({"safetensors_cold_gbps": g(st_cold),
                    "safetensors_warm_gbps": g(safetensors_time(st_path, False, repeat, touch=True)[0]),
                    "safetensors_cold_lazy_gbps": g(safetensors_time(st_path, True, repeat, touch=False)[0]),
                    "safetensors_warm_lazy_gbps": g(safetensors_time(st_path, False, repeat, touch=False)[0]),
                    "torch_load_warm_gbps": g(torch_load_time(pt_path, repeat))})
        res["resident_after_drop"] = max(res["resident_after_drop"], st_share)
    return res


def measure(root: Path, size_bytes: int, repeat: int, rounds: int, peers: bool) -> tuple[dict, list]:
    """Every figure for one size: the JSON dict and the table rows."""
    root.mkdir(parents=True, exist_ok=True)
    snap, st_path, pt_path = generate(root, size_bytes)
    res = in_process(snap, st_path, pt_path, repeat, classic=not peers)
    nbytes = res["bytes"]
    have, missing = peers_available() if peers else ([], {})
    block, qd = res["odirect_best"]["block_bytes"], res["odirect_best"]["queue_depth"]
    f = fresh_rounds(root, nbytes, REWARM_LOADERS + have, rounds, block, qd)
    limit = max([res["odirect_limit_gbps"]] + [f["odirect_raw"][k] for k in ("max_gbps",) if f["odirect_raw"]["max_gbps"]])
    res["odirect_limit_gbps"] = limit
    res["load_average"] = f.pop("_load_average")
    res["cold_over_round_limit"] = f.pop("_cold_over_round_limit")
    res["first_touch_gbps"] = f["first_touch"]["gbps"]
    for path in ("fresh", "zygote"):
        for mode in ("cold", "warm"):
            res[f"rewarm_{path}_{mode}_gbps"] = f[f"rewarm_{path}/{mode}"]["gbps"]
    for mode in ("cold", "warm"):
        res[f"rewarm_fresh_copy_{mode}_gbps"] = f[f"rewarm_fresh_copy/{mode}"]["gbps"]
        res[f"rewarm_fresh_copy_huge_{mode}_gbps"] = f[f"rewarm_fresh_copy_huge/{mode}"]["gbps"]
        res[f"rewarm_fresh_noverify_{mode}_gbps"] = f[f"rewarm_fresh_noverify/{mode}"]["gbps"]
    sys.path.insert(0, str(REPO / "bench"))
    from restore_peers import LOADERS
    res["peers"] = {name: {"cold_gbps": f[f"{name}/cold"]["gbps"], "warm_gbps": f[f"{name}/warm"]["gbps"],
                           "verified": LOADERS[name][3] or False,
                           "peak_rss_delta_bytes": max(f[f"{name}/{m}"].get("peak_rss_delta_bytes", 0) for m in ("cold", "warm")),
                           "cold_min_max_gbps": [f[f"{name}/cold"]["min_gbps"], f[f"{name}/cold"]["max_gbps"]],
                           "warm_min_max_gbps": [f[f"{name}/warm"]["min_gbps"], f[f"{name}/warm"]["max_gbps"]],
                           **({"error": f[f"{name}/cold"]["error"]} if "error" in f[f"{name}/cold"] else {})}
                    for name in have}
    res["peers_not_measured"] = missing
    res["fresh_process"] = f
    if peers:   # the classic keys, from the same fresh-process runs
        for key, name, mode in (("safetensors_cold_gbps", "safetensors_mmap", "cold"),
                                ("safetensors_warm_gbps", "safetensors_mmap", "warm"),
                                ("torch_load_warm_gbps", "torch_load_mmap", "warm")):
            res[key] = f.get(f"{name}/{mode}", {}).get("gbps") or 0.0
    fresh = f["rewarm_fresh/cold"]        # RSS: the fresh-process restore, cold, its worst round
    fresh_rss = fresh.get("peak_rss_delta_bytes", 0)
    res["baseline_rss_bytes"], res["peak_rss_bytes"] = fresh.get("rss_baseline_bytes", 0), fresh.get("rss_peak_bytes", 0)
    res["fresh_peak_rss_delta_bytes"] = fresh_rss
    fv, fnv = f["rewarm_fresh/cold"]["gbps"], f["rewarm_fresh_noverify/cold"]["gbps"]
    res["fresh_verify_overhead_pct"] = 100 * (1 - fv / fnv) if fv and fnv else None
    res["cache_drop_effective"] = res["resident_after_drop"] <= 0.05 and all(
        (v.get("resident_before") or 0) <= 0.05 for k, v in f.items() if k.endswith("/cold"))
    best_peer = max((p["cold_gbps"] or 0 for p in res["peers"].values()), default=0)
    res["best_peer_cold_gbps"] = best_peer
    z = lambda x: x or 0.0  # noqa: E731
    checks = [
        ("fresh cold >= 0.85 x O_DIRECT limit", z(res["rewarm_fresh_cold_gbps"]) >= 0.85 * limit),
        ("fresh warm >= 0.8 x first touch", z(res["rewarm_fresh_warm_gbps"]) >= 0.8 * z(res["first_touch_gbps"])),
        ("zygote cold >= 0.9 x O_DIRECT limit", z(res["rewarm_zygote_cold_gbps"]) >= 0.9 * limit),
        ("zygote warm >= 0.6 x memcpy", z(res["rewarm_zygote_warm_gbps"]) >= 0.6 * res["memcpy_gbps"]),
        ("verification overhead <= 10 % (zygote path, in process)", res["verify_overhead_pct"] <= 10),
        ("verification overhead <= 10 % (fresh process)", (res["fresh_verify_overhead_pct"] or 0) <= 10),
        ("fresh RSS added <= bytes + 64 MiB", fresh_rss <= nbytes + (64 << 20)),
    ]
    if peers:
        checks.append(("fresh verified cold >= 1.5 x best peer cold",
                       z(res["rewarm_fresh_cold_gbps"]) >= 1.5 * best_peer))
    res["targets_met"] = {n: ok for n, ok in checks}
    return res, _rows(res, f, checks, missing)


def _rows(res: dict, f: dict, checks: list, missing: dict) -> list[tuple[str, str]]:
    def fmt(s: dict) -> str:
        if s.get("gbps") is None:
            return "failed: " + str(s.get("error"))[:60]
        return f"{s['gbps']:.2f} ({s['min_gbps']:.2f}-{s['max_gbps']:.2f})"
    rows = [("bytes", f"{res['bytes']}"), ("load average over the rounds", ", ".join(f"{x:.1f}" for x in res["load_average"])),
            ("O_DIRECT limit (best of sweep and rounds)", f"{res['odirect_limit_gbps']:.2f} GB/s"),
            ("memcpy", f"{res['memcpy_gbps']:.2f} GB/s"),
            ("first touch, fresh 4 KiB memory, 1 thread", fmt(f["first_touch"]) + " GB/s"),
            ("zygote path, in process: cold / warm (verified)", f"{res['rewarm_cold_gbps']:.2f} / {res['rewarm_warm_gbps']:.2f} GB/s"),
            ("zygote path, in process: verification overhead cold / warm",
             f"{res['verify_overhead_pct']:.1f} % / {res['verify_overhead_warm_pct']:.1f} %"),
            ("", ""), ("fresh process, median (min-max) GB/s, load + touch", "cold | warm | verified | RSS added")]
    from restore_peers import LOADERS
    for name in [k.split("/")[0] for k in f if k.endswith("/cold")]:
        c, w = f[f"{name}/cold"], f[f"{name}/warm"]
        rss = max(c.get("peak_rss_delta_bytes", 0), w.get("peak_rss_delta_bytes", 0)) >> 20
        rows.append((name + (f" [{c.get('mode')}]" if c.get("mode") else ""),
                     f"{fmt(c)} | {fmt(w)} | {LOADERS[name][3] or 'no'} | {rss} MiB"))
    rows += [(f"not measured: {k}", v) for k, v in missing.items()]
    for name in ("rewarm_fresh", "rewarm_fresh_copy", "rewarm_fresh_copy_huge", "rewarm_zygote"):
        p = res.get("cold_over_round_limit", {}).get(name, {})
        if p.get("median") is not None:
            rows.append((f"{name} cold / same round's O_DIRECT (not the target's ratio)",
                         f"{p['median']:.2f} ({p['min']:.2f}-{p['max']:.2f})"))
    if res.get("fresh_verify_overhead_pct") is not None:
        rows.append(("fresh process: verification overhead (cold)", f"{res['fresh_verify_overhead_pct']:.1f} %"))
    rows.append(("page cache drop effective", f"{res['cache_drop_effective']} (resident after drop "
                                              f"{res['resident_after_drop']:.3f})"))
    rows += [(f"target: {n}", "met" if ok else "MISSED") for n, ok in checks]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gib", type=float, nargs="+", default=[1.0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--dir", type=Path, default=REPO / "var" / "bench" / "restore")
    ap.add_argument("--repeat", type=int, default=3, help="in-process runs of each (best taken)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating fresh-process rounds (medians)")
    ap.add_argument("--peers", action="store_true", help="add the peer loaders (make bench installs them)")
    args = ap.parse_args(argv)
    results = {}
    for gib in args.size_gib:
        size = int(gib * (1 << 30)) // 4096 * 4096
        root = args.dir if len(args.size_gib) == 1 else args.dir / f"{gib:g}gib"
        print(f"{gib:g} GiB: measuring ({args.rounds} fresh-process rounds)", file=sys.stderr, flush=True)
        res, rows = measure(root, size, args.repeat, args.rounds, args.peers)
        results[f"{gib:g}"] = res
        width = max(len(r[0]) for r in rows)
        print(f"\n### {gib:g} GiB ({res['bytes']} bytes)")
        print("\n".join(f"| {a:<{width}} | {b} |" for a, b in rows), flush=True)
        # written after each size, so a long run that is stopped keeps what it measured.
        # One size: the flat dict (the keys as before); several: {"sizes": {"1": {...}, "4": {...}}}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = res if len(args.size_gib) == 1 else {"sizes": results}
        from bench.run_meta import run_meta   # command, machine, load average, date, commit

        out = {**out, "meta": run_meta()}
        args.json.write_text(json.dumps(out, indent=2))
    print("\n" + readme_table(results))
    return 0


PATH_OF = {"rewarm_fresh": "fresh process (locked map)", "rewarm_fresh_copy": "fresh process (copy)",
           "rewarm_fresh_copy_huge": "fresh process (copy, huge pages)",
           "rewarm_fresh_noverify": "fresh process (locked map)", "rewarm_zygote": "zygote (prefaulted buffer)"}


def readme_table(results: dict) -> str:
    """The README's peer table: every loader, cold and warm at each size (median, fresh processes)."""
    from restore_peers import LOADERS
    sizes = list(results)
    head = " / ".join(f"{s} GiB" for s in sizes)
    lines = [f"| loader | path | verified | cold GB/s {head} | warm GB/s {head} |", "|---|---|---|---|---|"]
    first = results[sizes[0]]["fresh_process"]
    for name in [k.split("/")[0] for k in first if k.endswith("/cold")]:
        cells = []
        for mode in ("cold", "warm"):
            vals = [results[s]["fresh_process"].get(f"{name}/{mode}", {}).get("gbps") for s in sizes]
            cells.append(" / ".join("-" if v is None else f"{v:.2f}" for v in vals))
        lines.append(f"| {name} | {PATH_OF.get(name, 'fresh process')} | {LOADERS[name][3] or 'no'} | {cells[0]} | {cells[1]} |")
    for what, key in (("O_DIRECT limit", "odirect_limit_gbps"), ("memcpy", "memcpy_gbps"),
                      ("first touch (1 thread, 4 KiB)", "first_touch_gbps")):
        lines.append(f"| {what} | | | {' / '.join(f'{results[s][key]:.2f}' for s in sizes)} | |")
    loads = [x for s in sizes for x in results[s]["load_average"]]
    lines.append(f"\nload average during the rounds: {min(loads):.1f}-{max(loads):.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
