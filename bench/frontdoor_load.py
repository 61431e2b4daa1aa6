"""Front-door load benchmark: open-loop load from another process through the front door.

Three processes: stub replicas (answer at once over the protocol), the front door, and an
open-loop load generator (Poisson arrivals, or replay of an Azure LLM trace's arrival times)
over ``--conns`` (>= 64) connections.  Reported (and written with ``--json PATH``):

- ``direct_rps`` / ``frontdoor_rps``: the highest offered Poisson rate (a ladder rising by
  25 %) at which every request was answered 200, straight to a stub replica / through the
  front door;
- ``frontdoor_cpu_us_per_request``: the front door process's user+system CPU (from
  /proc/<pid>/stat) during that run divided by the requests it answered;
- ``bare_relay_cpu_us_per_request``: a relay with no front-door logic (decode, re-id,
  forward, batched writes) carrying the same load at ``frontdoor_rps``: the machine's floor
  for this traffic, to read the front door's figure against;
- ``p50_added_ms`` / ``p99_added_ms``: latency percentiles through the front door minus the
  same percentiles straight to a replica, both at half of ``frontdoor_rps``;
- overload at twice ``frontdoor_rps``: ``offered``, ``ok``, ``shed_429``, ``expired_504``,
  ``lost`` (no answer at all) and the front door's peak RSS (VmHWM).

Targets: cpu/request <= 30 us, p99 added <= 2 ms, lost = 0, bounded memory.
Usage: ``python bench/frontdoor_load.py --json var/bench/frontdoor_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.protocol import Decoder, pack  # noqa: E402

TRACE = REPO / "bench" / "traces" / "azure_llm_2023_code.csv"
MODEL = "bench"


def _stub_speed():
    """The speed the stub replicas report (docs/architecture.md, "Replica load reports"): they answer at once (no model),
    so their prefill and decode step are loopback-fast; the front door routes and admits on
    it as on any replica's report."""
    from agent.speed import SpeedProfile
    return SpeedProfile(prefill_tokens_per_s=1e6, prefill_overhead_s=1e-4, decode_base_s=1e-4,
                        decode_per_seq_s=1e-6, decode_per_ctx_token_s=0.0)


STUB_SPEED = _stub_speed()


def _use_uvloop() -> None:
    """uvloop for the processes under test (stubs, front door, relay), as `rewarm frontdoor`
    runs; the load generator keeps asyncio's loop: on uvloop it fell behind reading its
    answers at 2x overload and counted 51,460 of 74,428 requests lost, where the same front
    door with an asyncio client lost none (one A/B run each, this machine)."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass


# --- role: stub replicas -----------------------------------------------------------------

class _Stub(asyncio.Protocol):
    def connection_made(self, transport):
        self.t, self.d = transport, Decoder()

    def data_received(self, data):
        out = []
        for m in self.d.feed(data):
            rid = m["id"]
            n = m.get("max_tokens", 1)
            out.append(pack({"id": rid, "type": "tokens", "tokens": list(range(n))}))
            out.append(pack({"id": rid, "type": "done", "ttft_ms": 0.0, "total_ms": 0.0,
                             "path": "warm_hit", "replica": "stub", "n_tokens": n}))
        self.t.write(b"".join(out))


async def _replicas(count: int) -> None:
    from open_loop import serve_stubs   # bench/ is this script's directory (sys.path[0])

    await serve_stubs(_Stub, count)


# --- role: front door --------------------------------------------------------------------

async def _frontdoor(ports: list[int], max_seqs: int, deadline_ms: float) -> None:
    from agent.cluster.base import ServiceInstance
    from agent.cluster.local import LocalRegistry
    from agent.frontdoor.server import FrontDoor, FrontDoorConfig
    from agent.telemetry import Telemetry

    registry = LocalRegistry()
    for i, port in enumerate(ports):
        registry.register(ServiceInstance(
            "rewarm-replica", f"stub-{i}", "127.0.0.1", port, tags=[f"model={MODEL}"],
            meta={"max_seqs": str(max_seqs), "active_seqs": "0",
                  "kv_capacity_tokens": str(max_seqs * 64), "kv_used_tokens": "0",
                  **STUB_SPEED.to_meta()}),
            ttl_s=float("inf"))
    events = REPO / "var" / "bench" / "frontdoor_events.jsonl"
    events.parent.mkdir(parents=True, exist_ok=True)
    events.unlink(missing_ok=True)
    # The TTFT SLOs are the deadline (as the deadline alone was before SLOs): the saturation
    # front door holds requests as long as it takes, the overload one sheds past 250 ms.
    config = FrontDoorConfig(models={MODEL: deadline_ms}, max_queue_depth=4096,
                             max_wait_s=deadline_ms / 1000.0, warm_slo_ms=deadline_ms,
                             restore_slo_ms=deadline_ms)
    fd = FrontDoor(config, registry=registry, telemetry=Telemetry(events))
    host, port = await fd.start()
    import gc
    gc.freeze()  # as `rewarm frontdoor` does
    print("READY", port, flush=True)
    await asyncio.Event().wait()


# --- role: bare relay (calibration: what the same traffic costs with no front-door logic)

class _Out(asyncio.Protocol):
    """Write batching as the front door does it: one transport.write per loop turn."""

    def __init__(self):
        self.buf, self.t = [], None
        self.loop = asyncio.get_running_loop()

    def send(self, data):
        if not self.buf:
            self.loop.call_soon(self.flush)
        self.buf.append(data)

    def flush(self):
        buf, self.buf = self.buf, []
        self.t.write(b"".join(buf))


async def _relay(port: int) -> None:
    import itertools
    import msgpack
    loop = asyncio.get_running_loop()
    pending: dict[int, tuple] = {}
    ids = itertools.count()
    packb = msgpack.Packer(use_bin_type=True).pack

    class Up(_Out):
        def connection_made(self, t):
            self.t, self.u = t, msgpack.Unpacker(raw=False)

        def data_received(self, data):
            self.u.feed(data)
            for m in self.u:
                conn, cid = (pending.pop if m["type"] == "done" else pending.get)(m["id"])
                m["id"] = cid
                conn.send(packb(m))

    _, up = await loop.create_connection(Up, "127.0.0.1", port)

    class Client(_Out):
        def connection_made(self, t):
            self.t, self.u = t, msgpack.Unpacker(raw=False)

        def data_received(self, data):
            self.u.feed(data)
            for m in self.u:
                rid = next(ids)
                pending[rid] = (self, m["id"])
                m["id"] = rid
                up.send(packb(m))

    server = await loop.create_server(Client, "127.0.0.1", 0)
    print("READY", server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


# --- role: open-loop load generator ------------------------------------------------------

class _LoadConn(asyncio.Protocol):
    def __init__(self, done_t, codes, t0_ref):
        self.done_t, self.codes, self.t0_ref = done_t, codes, t0_ref
        self.d = Decoder()
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport):
        self.t = transport

    def data_received(self, data):
        now = time.perf_counter() - self.t0_ref[0]
        for m in self.d.feed(data):
            kind = m.get("type")
            if kind == "done":
                self.done_t[m["id"]], self.codes[m["id"]] = now, 200
            elif kind == "error" and m.get("id") is not None:
                self.done_t[m["id"]], self.codes[m["id"]] = now, m["code"]


async def _load(port: int, arrivals_s: np.ndarray, max_tokens: np.ndarray, conns: int,
                drain_s: float) -> dict:
    loop = asyncio.get_running_loop()
    n = len(arrivals_s)
    done_t = np.full(n, np.nan)
    codes = np.zeros(n, dtype=np.int32)
    sent_t = np.full(n, np.nan)
    t0 = [0.0]
    links = []
    for _ in range(conns):
        _, proto = await loop.create_connection(lambda: _LoadConn(done_t, codes, t0),
                                                "127.0.0.1", port)
        links.append(proto)
    packed = [pack({"op": "generate", "id": i, "model": MODEL, "tokens": [1, 2, 3],
                    "max_tokens": int(max_tokens[i])}) for i in range(n)]
    t0[0] = time.perf_counter()
    i = 0
    while i < n:
        now = time.perf_counter() - t0[0]
        j = int(np.searchsorted(arrivals_s, now, side="right"))
        if j > i:
            batches: list[list[bytes]] = [[] for _ in range(conns)]
            for k in range(i, j):
                batches[k % conns].append(packed[k])
            sent_t[i:j] = now
            for link, batch in zip(links, batches, strict=True):
                if batch:
                    link.t.write(b"".join(batch))
            i = j
        await asyncio.sleep(0.0002)
    end = loop.time() + drain_s
    while np.isnan(done_t).any() and loop.time() < end:
        await asyncio.sleep(0.01)
    for link in links:
        link.t.close()
    answered = ~np.isnan(done_t)
    ok = answered & (codes == 200)
    lat = (done_t - sent_t)[ok] * 1000.0
    span = (np.nanmax(done_t) - sent_t[0]) if answered.any() else float("nan")
    return {"offered": n, "ok": int(ok.sum()), "shed_429": int((codes == 429).sum()),
            "expired_504": int((codes == 504).sum()),
            "other_errors": int((answered & ~np.isin(codes, [200, 429, 504])).sum()),
            "lost": int((~answered).sum()), "rps": float(ok.sum() / span) if span else 0.0,
            "p50_ms": float(np.percentile(lat, 50)) if len(lat) else float("nan"),
            "p99_ms": float(np.percentile(lat, 99)) if len(lat) else float("nan")}


def _arrivals(rate: float, duration_s: float, trace: bool, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    if not trace:
        n = max(1, int(rate * duration_s))
        return np.cumsum(rng.exponential(1.0 / rate, n)), np.ones(n, dtype=np.int64)
    stamps, gen = [], []
    with open(TRACE) as f:
        for row in csv.DictReader(f):
            stamps.append(datetime.datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp())
            gen.append(int(row["GeneratedTokens"]))
            if len(stamps) >= 200_000:
                break
    t = np.array(stamps) - stamps[0]
    t *= (len(t) / t[-1]) / rate  # rescale the trace's arrival process to ``rate``
    keep = t < duration_s
    return t[keep], np.clip(np.array(gen)[keep], 1, 16)


# --- orchestration -----------------------------------------------------------------------

def _spawn(*args: str) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split()
    if not line or line[0] != "READY":
        raise RuntimeError(f"{args[:2]} did not start: {line}")
    return proc, line[1:]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _vm(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _run_load(port: int, rate: float, duration_s: float, conns: int, trace: bool = False,
              seed: int = 0) -> dict:
    out = subprocess.run([sys.executable, __file__, "--role", "load", "--port", str(port),
                          "--rate", str(rate), "--duration", str(duration_s),
                          "--conns", str(conns), "--seed", str(seed)]
                         + (["--trace"] if trace else []),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ladder(port: int, pid: int | None, args) -> tuple[dict, float]:
    """Offer rising Poisson rates; the maximum is the last rate fully served (every request
    answered 200, none shed).  Returns that run and the process's CPU per request there."""
    best, cpu_us = None, float("nan")
    rate = args.start_rps
    while rate <= args.saturate_rps:
        cpu0 = _cpu_s(pid) if pid else 0.0
        run = _run_load(port, rate, args.duration, args.conns)
        if run["ok"] < run["offered"]:
            break
        best = run
        if pid:
            cpu_us = (_cpu_s(pid) - cpu0) * 1e6 / run["ok"]
        rate *= 1.25
    return best or run, cpu_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="main",
                    choices=["main", "replicas", "frontdoor", "relay", "load"])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--duration", type=float, default=2.0)
    ap.add_argument("--start-rps", type=float, default=2_000.0)
    ap.add_argument("--saturate-rps", type=float, default=60_000.0,
                    help="the ladder of offered rates stops here")
    ap.add_argument("--port", type=int)
    ap.add_argument("--ports", type=int, nargs="*")
    ap.add_argument("--rate", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--deadline-ms", type=float, default=250.0)
    args = ap.parse_args()
    if args.role != "load":
        _use_uvloop()
    if args.role == "replicas":
        return asyncio.run(_replicas(2))
    if args.role == "frontdoor":
        return asyncio.run(_frontdoor(args.ports, args.max_seqs, args.deadline_ms))
    if args.role == "relay":
        return asyncio.run(_relay(args.port))
    if args.role == "load":
        arrivals, max_tokens = _arrivals(args.rate, args.duration, args.trace, args.seed)
        drain_s = 5.0 + args.duration * 4  # a saturated front door works off its queue
        print(json.dumps(asyncio.run(_load(args.port, arrivals, max_tokens, args.conns, drain_s))))
        return None

    reps, ports = _spawn("--role", "replicas")
    # The maximum rate is measured with deadlines long enough that nothing is shed;
    # the overload run uses --deadline-ms (and so sheds and expires).
    sat_fd, (sat_port,) = _spawn("--role", "frontdoor", "--ports", *ports,
                                 "--max-seqs", str(args.max_seqs), "--deadline-ms", "600000")
    fd, (fd_port,) = _spawn("--role", "frontdoor", "--ports", *ports,
                            "--max-seqs", str(args.max_seqs),
                            "--deadline-ms", str(args.deadline_ms))
    relay, (relay_port,) = _spawn("--role", "relay", "--port", ports[1])
    pid = fd.pid
    try:
        rss_idle = _vm(pid, "VmRSS")
        direct, _ = _ladder(int(ports[0]), None, args)
        sat, cpu_us = _ladder(int(sat_port), sat_fd.pid, args)
        cpu0 = _cpu_s(relay.pid)
        relay_run = _run_load(int(relay_port), sat["rps"], args.duration, args.conns)
        relay_us = (_cpu_s(relay.pid) - cpu0) * 1e6 / max(1, relay_run["ok"])
        half = max(100.0, sat["rps"] / 2)
        d_half = _run_load(int(ports[0]), half, args.duration, args.conns, seed=1)
        f_half = _run_load(int(sat_port), half, args.duration, args.conns, seed=1)
        trace = _run_load(int(sat_port), half, args.duration, args.conns, trace=True, seed=2)
        over = _run_load(int(fd_port), 2 * sat["rps"], args.duration, args.conns, seed=3)
        result = {
            "direct_rps": direct["rps"], "frontdoor_rps": sat["rps"],
            "frontdoor_cpu_us_per_request": cpu_us, "half_rate_rps": half,
            "bare_relay_cpu_us_per_request": relay_us,
            "p50_added_ms": f_half["p50_ms"] - d_half["p50_ms"],
            "p99_added_ms": f_half["p99_ms"] - d_half["p99_ms"],
            "half_rate_direct": d_half, "half_rate_frontdoor": f_half,
            "trace_replay": trace, "overload": {k: over[k] for k in (
                "offered", "ok", "shed_429", "expired_504", "other_errors", "lost")},
            "rss_idle_bytes": rss_idle, "rss_peak_bytes": _vm(pid, "VmHWM"),
            "conns": args.conns, "duration_s": args.duration,
            "targets": {"frontdoor_cpu_us_per_request": 30, "p99_added_ms": 2, "lost": 0}}
    finally:
        for proc in (fd, sat_fd, relay, reps):
            proc.terminate()
    rows = [("direct_rps", f"{result['direct_rps']:.0f}"),
            ("frontdoor_rps", f"{result['frontdoor_rps']:.0f}"),
            ("frontdoor_cpu_us_per_request", f"{cpu_us:.1f}  (target <= 30)"),
            ("bare_relay_cpu_us_per_request", f"{relay_us:.1f}  (same rate; the floor here)"),
            ("p50_added_ms @ half rate", f"{result['p50_added_ms']:.2f}"),
            ("p99_added_ms @ half rate", f"{result['p99_added_ms']:.2f}  (target <= 2)"),
            ("trace replay ok/offered", f"{trace['ok']}/{trace['offered']}"),
            *((f"overload {k}", str(v)) for k, v in result["overload"].items()),
            ("rss idle / peak MiB", f"{rss_idle / 2**20:.1f} / {result['rss_peak_bytes'] / 2**20:.1f}")]
    for name, value in rows:
        print(f"{name:32s} {value}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
