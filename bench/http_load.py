"""HTTP entrance load benchmark: the OpenAI-compatible door beside the msgpack door.

Processes: stub replicas (answer with text over the protocol, after ``service_ms``), one
front door serving both doors over them, and the load from this process: one open-loop
client for each protocol, alike in everything but the protocol (see the load section; the
HTTP one on keep-alive connections, as real clients are).  In the stub runs the front door
has a core of its own and the rest hold the stubs and this process (``cpu_pinning``;
``--no-pin`` to share).  Reported (and written with ``--json PATH``):

- ``http_cpu_us_per_request`` / ``msgpack_cpu_us_per_request``: the front door process's
  user+system CPU (/proc/<pid>/stat) over a run of the same requests (16 tokens, answered at
  once by the stubs) through each door, divided by the requests answered: the median of
  ``--cpu-rounds`` alternating rounds (each round's figures in ``..._cpu_us_rounds`` and
  ``http_msgpack_cpu_ratio_rounds``); ``http_sse_...`` the same with ``stream: true``;
- ``http_p99_added_ms`` (and p50): latency through the HTTP door minus the same percentile
  straight to a stub replica, at half the HTTP door's capacity (``http_capacity_rps``: the
  highest Poisson rate of a ladder rising by half at which every request is answered 200
  with a median under 20 ms; ``http_capacity_by_cpu_rps`` = 1 / CPU per request beside it),
  in the same run as ``msgpack_p99_added_ms`` at the same rate, and how busy the door's
  core was meanwhile (``half_capacity_http_door_cpu_fraction``: its CPU seconds over the
  run's wall seconds; CPU per request falls with the rate, as the event loop answers more
  requests per wake-up, so the ladder, not the CPU runs at 400 rps, says where it saturates);
  ``latency_client``: per
  latency run, how late the client's writes were against their schedule (p99) and how often
  the HTTP client had to wait for a free connection, so that a client stall shows;
- ``overload``: twice the stub replicas' capacity (``slots x replicas / service_ms``) offered
  for ``--overload-s`` through the HTTP door with a deadline: answers by status, and
  ``lost`` (no answer, or a status other than 200, 429, 504);
- ``rss_growth_bytes_10k_connections``: the front door's VmRSS after 10,000 HTTP connections
  were opened, used once and closed, minus its VmRSS after the first 1,000;
- ``real_replica``: ``load_generator`` (guidellm, an LLM load generator speaking the OpenAI
  API) against the HTTP door in front of a real SmolLM2-135M replica: TTFT p50/p99, ITL p50,
  output tokens/s.  Skipped (null) with ``--no-real``.

Targets: HTTP CPU/request <= 2x msgpack's; p99 added <= 2 ms at half capacity on
stubs; at 2x overload only 200/429/504 and 0 lost; RSS bounded over 10,000 connections.
Usage: ``python bench/http_load.py --json var/bench/http_load.json`` (``--no-real`` to skip
the real model).  Needs the bench extra (``pip install -e '.[bench]'``) for the real run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from agent.protocol import Decoder, pack  # noqa: E402
from open_loop import (CLIENT_STATS, MODEL, http_load, msgpack_load, pct,  # noqa: E402
                       poisson, serve_stubs)



# --- role: stub replicas ------------------------------------------------------------------

class _Stub(asyncio.Protocol):
    """Answers each generate with ``max_tokens`` text tokens and a done, ``service_s`` late."""

    service_s = 0.0

    def connection_made(self, transport):
        self.t, self.d, self.loop = transport, Decoder(), asyncio.get_running_loop()

    def data_received(self, data):
        out = []
        for m in self.d.feed(data):
            if m.get("op") != "generate":
                continue
            rid, n = m["id"], m.get("max_tokens", 16)
            toks = b"".join(pack({"id": rid, "type": "tokens", "tokens": [i], "text": " w"})
                            for i in range(n))
            done = pack({"id": rid, "type": "done", "ttft_ms": 0.0, "total_ms": 0.0,
                         "path": "warm_hit", "replica": "stub", "n_tokens": n,
                         "prompt_tokens": 12, "finish_reason": "length", "text": " w" * n})
            if self.service_s:
                self.loop.call_later(self.service_s, self._write, toks + done)
            else:
                out.append(toks + done)
        if out:
            self.t.write(b"".join(out))

    def _write(self, data):
        if not self.t.is_closing():
            self.t.write(data)


async def _stubs(count: int, service_ms: float) -> None:
    _Stub.service_s = service_ms / 1000.0
    await serve_stubs(_Stub, count)


# --- role: the front door with both doors ---------------------------------------------------

async def _frontdoor(replicas: list[str], max_seqs: int, deadline_ms: float,
                     queue_depth: int, slo_ms: float | None = None,
                     metrics: bool = False) -> None:
    """The front door with both doors over ``replicas`` (``MODEL@HOST:PORT``); ``deadline_ms``
    is the model's default deadline and ``slo_ms`` (when given) both of its TTFT SLOs, as
    ``rewarm frontdoor --model M=DEADLINE_MS --slo M=SLO_MS,SLO_MS`` sets them; ``metrics``:
    serve the status port too (its port is the READY line's third word)."""
    from agent.cluster.base import ServiceInstance
    from agent.cluster.local import LocalRegistry
    from agent.frontdoor.http_entrance import HttpConfig, start_http
    from agent.frontdoor.server import FrontDoor, FrontDoorConfig

    registry = LocalRegistry()
    model = None
    for i, spec in enumerate(replicas):
        model, _, address = spec.partition("@")
        host, _, port = address.rpartition(":")
        registry.register(ServiceInstance(
            "rewarm-replica", f"r-{i}", host, int(port), tags=[f"model={model}"],
            meta={"max_seqs": str(max_seqs), "active_seqs": "0",
                  "kv_capacity_tokens": str(max_seqs * 512), "kv_used_tokens": "0"}),
            ttl_s=float("inf"))
    slos = {model: (slo_ms, slo_ms)} if slo_ms and model else {}
    config = FrontDoorConfig(models={model: deadline_ms}, max_queue_depth=queue_depth,
                             max_wait_s=deadline_ms / 1000.0, max_connections=20_000,
                             slos=slos)
    fd = FrontDoor(config, registry=registry)
    _, port = await fd.start()
    http = await start_http(fd, HttpConfig(port=0, max_connections=20_000))
    words = [port, http.address[1]]
    if metrics:
        words.append(fd.telemetry.serve_http(0).server_address[1])
    import gc
    gc.freeze()  # as `rewarm frontdoor` does
    print("READY", *words, flush=True)
    await asyncio.Event().wait()


def _spawn(*args: str, cpus: list[int] | None = None) -> tuple[subprocess.Popen, list[str]]:
    """Start a role of this script (pinned to ``cpus`` when given); returns it and the
    words after its READY line."""
    try:
        import uvloop  # noqa: F401  (the front door uses it when installed)
        use = ["--uvloop"]
    except ImportError:
        use = []
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen([sys.executable, __file__, *args, *use], stdout=subprocess.PIPE,
                            text=True, cwd=REPO, preexec_fn=pin)
    line = proc.stdout.readline().split()
    if not line or line[0] != "READY":
        proc.kill()
        raise RuntimeError(f"{args[:2]} did not start: {line}")
    return proc, line[1:]


def _pinning(enabled: bool) -> dict[str, list[int]]:
    """Where the stub runs place their processes: the front door alone on the last core this
    process may use, the clients (this process) and the stubs on the others, so that the
    door's latency is not the load generator's CPU time (in a deployment the clients are
    elsewhere).  Both doors are measured under the same placement.  ``{}`` (no pinning) with
    ``--no-pin`` or fewer than two cores."""
    cpus = sorted(os.sched_getaffinity(0))
    if not enabled or len(cpus) < 2:
        return {}
    return {"frontdoor": cpus[-1:], "clients_and_stubs": cpus[:-1]}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _busy(pid: int, run) -> tuple:
    """Run the load ``run()`` makes; returns its latencies and the share of one core the
    process ``pid`` was busy over the run's wall time (its CPU seconds / wall seconds)."""
    cpu0, wall0 = _cpu_s(pid), time.perf_counter()
    lat, _ = asyncio.run(run())
    return lat, (_cpu_s(pid) - cpu0) / (time.perf_counter() - wall0)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def _connections(port: int, count: int, concurrency: int = 50) -> int:
    """Open ``count`` connections (``concurrency`` at a time), one GET /health on each, close.
    Returns how many were answered 200."""
    ok = 0
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"

    async def one() -> None:
        nonlocal ok
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        data = await reader.read()
        ok += data.startswith(b"HTTP/1.1 200")
        writer.close()

    for start in range(0, count, concurrency):
        await asyncio.gather(*(one() for _ in range(min(concurrency, count - start))))
    return ok


def _ladder(http_port: int, step_s: float, start_rps: float = 50.0) -> float:
    """The HTTP door's capacity on this machine: the highest offered rate (rising by half
    each step) at which every request is answered 200 within ``step_s`` plus a second,
    with the median latency under 20 ms and no send waiting for a free connection (the
    door keeping up, not queueing: with its 64 connections busy the client would send
    late, offering less than the step's rate while its latencies stayed low)."""
    rate, best = start_rps, 0.0
    while rate < 20_000:
        arrivals = poisson(rate, step_s, seed=int(rate))
        lat, status = asyncio.run(http_load(http_port, arrivals, timeout_s=step_s + 1))
        if not (status == 200).all() or pct(lat, 50) > 20.0 or CLIENT_STATS[-1]["waits"]:
            break
        best, rate = rate, rate * 1.5
    return best or start_rps


# --- the real replica through guidellm ------------------------------------------------------

def _guidellm(http_port: int, model: str, tokenizer_dir: Path, out_dir: Path, *,
              rate: float, requests: int, prompt_tokens: int, output_tokens: int) -> dict:
    """guidellm (an LLM load generator speaking OpenAI's API, with TTFT/ITL accounting) at a
    constant ``rate`` for ``requests`` streamed completions; returns its JSON report."""
    exe = Path(sys.executable).with_name("guidellm")
    out = out_dir / "guidellm.json"
    out.unlink(missing_ok=True)
    cmd = [str(exe), "run",
           "--backend", f"kind=openai_http,target=http://127.0.0.1:{http_port},model={model}",
           "--profile", f"kind=constant,rate={rate:g}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
                     f"output_tokens={output_tokens}",
           "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
           "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"guidellm failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def _real_replica(args, out: dict) -> dict | None:
    """A real SmolLM2 replica (``rewarm replica``) behind its own front door, driven by
    guidellm through the HTTP door; also the HTTP door's CPU per request there."""
    from agent.replica.smollm2 import ensure_smollm2

    model_dir = ensure_smollm2(REPO / "var" / "models" / "smollm2-135m")
    replica = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "replica", "--model-dir", str(model_dir),
         "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        ready = json.loads(replica.stdout.readline())
        name = "smollm2-135m"
        # guidellm sends no deadline header: the budget is the model's, set on the front door
        # the documented way (docs/http-api.md, "Deadlines"): --real-slo-ms for both TTFT
        # SLOs and the model's default deadline, as `rewarm frontdoor --model
        # smollm2-135m=MS --slo smollm2-135m=MS,MS` does.  0: the default SLOs (2 s / 4 s).
        slo = ["--slo-ms", f"{args.real_slo_ms:g}"] if args.real_slo_ms else []
        fd, (_, http_port, metrics_port) = _spawn(
            "--role", "frontdoor", "--replica", f"{name}@{ready['ready']}", "--max-seqs", "8",
            "--deadline-ms", f"{args.real_slo_ms or 60000:g}", *slo, "--metrics")
        try:
            cpu0 = _cpu_s(fd.pid)
            report = _guidellm(int(http_port), name, model_dir, REPO / "var" / "bench",
                               rate=args.real_rate, requests=args.real_requests,
                               prompt_tokens=64, output_tokens=32)
            cpu = _cpu_s(fd.pid) - cpu0
            refused = _refusals(int(metrics_port))
        finally:
            fd.kill()
            fd.wait()
    finally:
        replica.terminate()
        replica.wait(30)
    summary = _guidellm_summary(report, cpu, args.real_requests)
    summary["slo_ms"] = args.real_slo_ms or None
    summary["refused_by_reason"] = refused
    return summary


def _refusals(metrics_port: int) -> dict[str, int]:
    """The front door's refusals by reason (``rewarm_rejections_total``, its status port):
    what a guidellm run counts only as "errored"."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "rewarm_rejections":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = f"{sample.labels['code']} {sample.labels['reason']}"
                    out[key] = out.get(key, 0) + int(sample.value)
    return out


def _guidellm_summary(report: dict, cpu_s: float, requests: int) -> dict:
    """TTFT, ITL and throughput out of guidellm's JSON report (its first benchmark)."""
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]

    def stat(name: str, key: str) -> float:
        dist = metrics[name]["successful"]
        if key in ("p50", "p99"):
            return float(dist["percentiles"][key])
        return float(dist[key])

    return {"ttft_ms_p50": stat("time_to_first_token_ms", "p50"),
            "ttft_ms_p99": stat("time_to_first_token_ms", "p99"),
            "itl_ms_p50": stat("inter_token_latency_ms", "p50"),
            "tokens_per_s": stat("output_tokens_per_second", "mean"),
            "requests": requests,
            "answered_200": int(metrics["request_totals"]["successful"]),
            # the whole run's front-door CPU, idle loops included (minutes at a few rps)
            "frontdoor_cpu_s": round(cpu_s, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cpu-requests", type=int, default=3000)
    ap.add_argument("--cpu-rate", type=float, default=400.0, help="offered rate of the CPU runs")
    ap.add_argument("--cpu-rounds", type=int, default=3,
                    help="alternating rounds of the CPU runs (medians reported)")
    ap.add_argument("--latency-s", type=float, default=6.0)
    ap.add_argument("--ladder-s", type=float, default=2.0, help="seconds per capacity step")
    ap.add_argument("--overload-s", type=float, default=4.0)
    ap.add_argument("--connections", type=int, default=10_000)
    ap.add_argument("--no-real", action="store_true", help="skip the real-replica run")
    ap.add_argument("--real-rate", type=float, default=0.5)
    ap.add_argument("--real-requests", type=int, default=20)
    ap.add_argument("--real-slo-ms", type=float, default=60_000.0,
                    help="the real replica's TTFT SLOs and default deadline on the front door "
                         "(guidellm cannot send x-rewarm-deadline-ms); 0: the defaults")
    ap.add_argument("--only-real", action="store_true", help="skip the stub runs")
    ap.add_argument("--no-pin", action="store_true",
                    help="stub runs: leave the front door, stubs and clients unpinned")
    ap.add_argument("--role", choices=["stubs", "frontdoor"], help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--service-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--replica", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--max-seqs", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--deadline-ms", type=float, default=2000.0, help=argparse.SUPPRESS)
    ap.add_argument("--slo-ms", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--metrics", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--queue-depth", type=int, default=4096, help=argparse.SUPPRESS)
    ap.add_argument("--uvloop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        if args.uvloop:
            import uvloop
            uvloop.install()
        if args.role == "stubs":
            asyncio.run(_stubs(args.count, args.service_ms))
        else:
            asyncio.run(_frontdoor(args.replica, args.max_seqs, args.deadline_ms,
                                   args.queue_depth, args.slo_ms, args.metrics))
        return
    out = {"load_generator": _load_generator()} if args.only_real else run_stubs(args)
    out["real_replica"] = None if args.no_real else _real_replica(args, out)
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    rows = _print(out)
    from run_meta import run_meta
    out["meta"] = run_meta()
    out["title"] = ("The HTTP door beside the msgpack door (stub replicas), and guidellm "
                    "through the HTTP door in front of a real SmolLM2-135M replica")
    out["tables"] = [{"title": "bench/http_load.py", "columns": ["measure", "value"],
                      "rows": [[name, value] for name, value in rows],
                      "notes": f"load generator: {out['load_generator']}"}]
    out["headline"] = [[name, value] for name, value in rows
                       if name.startswith(("HTTP / msgpack CPU", "HTTP p50 / p99 added",
                                           "real replica answered"))]
    real = out.get("real_replica")
    if real:
        out["tables"].append({
            "title": "guidellm refusals at the front door, by reason",
            "columns": ["status and reason", "requests"],
            "rows": [[k, v] for k, v in sorted(real["refused_by_reason"].items())]
            or [["none", 0]],
            "notes": (f"TTFT SLOs and default deadline {real['slo_ms']:g} ms on the front door "
                      "(guidellm sends no deadline header)" if real.get("slo_ms") else
                      "the default TTFT SLOs (2 s warm, 4 s restore)")})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))


def run_stubs(args) -> dict:
    """CPU per request (both doors), p99 added at half capacity, 10k connections (instant
    stubs); then overload against slow stubs."""
    out: dict = {"load_generator": _load_generator(), "event_loop": _event_loop()}
    pin = out["cpu_pinning"] = _pinning(not args.no_pin)
    door_cpus, other_cpus = pin.get("frontdoor"), pin.get("clients_and_stubs")
    all_cpus = os.sched_getaffinity(0)
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)
    try:
        out.update(_stub_runs(args, door_cpus, other_cpus))
        out["overload"] = _overload(args, door_cpus, other_cpus)
    finally:
        os.sched_setaffinity(0, all_cpus)
    return out


def _stub_runs(args, door_cpus: list[int] | None, other_cpus: list[int] | None) -> dict:
    out: dict = {}
    stubs, ports = _spawn("--role", "stubs", "--count", "2", cpus=other_cpus)
    fd, (msg_port, http_port) = _spawn("--role", "frontdoor",
                                       *[f"--replica={MODEL}@127.0.0.1:{p}" for p in ports],
                                       cpus=door_cpus)
    try:
        msg_port, http_port = int(msg_port), int(http_port)
        arrivals = poisson(args.cpu_rate, args.cpu_requests / args.cpu_rate, seed=1)
        asyncio.run(http_load(http_port, arrivals[:300]))          # warm up both doors
        asyncio.run(msgpack_load(msg_port, arrivals[:300]))
        runs = (("http", lambda: http_load(http_port, arrivals)),
                ("http_sse", lambda: http_load(http_port, arrivals, stream=True)),
                ("msgpack", lambda: msgpack_load(msg_port, arrivals)))
        per: dict[str, list[float]] = {name: [] for name, _ in runs}
        for _ in range(args.cpu_rounds):      # alternating rounds: drift hits every door
            for name, run in runs:
                cpu0 = _cpu_s(fd.pid)
                _, status = asyncio.run(run())
                cpu = _cpu_s(fd.pid) - cpu0
                ok = int((status == 200).sum())
                per[name].append(cpu / max(ok, 1) * 1e6)
                out[f"{name}_cpu_run_ok"] = min(ok, out.get(f"{name}_cpu_run_ok", ok))
        for name, values in per.items():
            out[f"{name}_cpu_us_per_request"] = round(float(np.median(values)), 1)
            out[f"{name}_cpu_us_rounds"] = [round(v, 1) for v in values]
        out["http_msgpack_cpu_ratio_rounds"] = [round(h / m, 2) for h, m in
                                                zip(per["http"], per["msgpack"], strict=True)]
        capacity = _ladder(http_port, args.ladder_s)
        half = capacity / 2
        out["http_capacity_rps"] = round(capacity)
        out["http_capacity_by_cpu_rps"] = round(1e6 / out["http_cpu_us_per_request"])
        lat_arrivals = poisson(half, args.latency_s, seed=2)
        CLIENT_STATS.clear()
        direct, _ = asyncio.run(msgpack_load(int(ports[0]), lat_arrivals))
        via_http, busy = _busy(fd.pid, lambda: http_load(http_port, lat_arrivals))
        via_msg, _ = asyncio.run(msgpack_load(msg_port, lat_arrivals))
        out["half_capacity_http_door_cpu_fraction"] = round(busy, 3)
        out["latency_client"] = dict(zip(("direct", "http", "msgpack"), CLIENT_STATS, strict=True))
        out["half_capacity_rps"] = round(half)
        for q in (50, 99):
            out[f"http_p{q}_added_ms"] = round(pct(via_http, q) - pct(direct, q), 3)
            out[f"msgpack_p{q}_added_ms"] = round(pct(via_msg, q) - pct(direct, q), 3)
        out["direct_p99_ms"] = round(pct(direct, 99), 3)
        rss0 = None
        asyncio.run(_connections(http_port, 1000))
        rss0 = _rss_bytes(fd.pid)
        answered = asyncio.run(_connections(http_port, args.connections))
        out["rss_growth_bytes_10k_connections"] = _rss_bytes(fd.pid) - rss0
        out["connections_answered"] = answered
    finally:
        fd.kill()
        stubs.kill()
        fd.wait()
        stubs.wait()
    return out


def _overload(args, door_cpus: list[int] | None, other_cpus: list[int] | None) -> dict:
    """Twice the stubs' capacity (2 replicas x 4 slots / 20 ms = 400 rps) for overload_s."""
    replicas, slots, service_ms, deadline_ms = 2, 4, 20.0, 500.0
    capacity = replicas * slots / (service_ms / 1000.0)
    stubs, ports = _spawn("--role", "stubs", "--count", str(replicas),
                          "--service-ms", str(service_ms), cpus=other_cpus)
    fd, (_, http_port) = _spawn("--role", "frontdoor", "--max-seqs", str(slots),
                                "--deadline-ms", str(deadline_ms), "--queue-depth", "256",
                                *[f"--replica={MODEL}@127.0.0.1:{p}" for p in ports],
                                cpus=door_cpus)
    try:
        arrivals = poisson(2 * capacity, args.overload_s, seed=3)
        _, status = asyncio.run(http_load(int(http_port), arrivals, conns=512,
                                           deadline_ms=deadline_ms, timeout_s=30.0))
    finally:
        fd.kill()
        stubs.kill()
        fd.wait()
        stubs.wait()
    counted = {code: int((status == code).sum()) for code in (200, 429, 504)}
    return {"offered": len(arrivals), "offered_rps": round(2 * capacity),
            "capacity_rps": round(capacity), "ok": counted[200], "shed_429": counted[429],
            "expired_504": counted[504], "lost": len(arrivals) - sum(counted.values())}


def _load_generator() -> str:
    return ("guidellm " + _guidellm_version() + " (real replica); open-loop HTTP (httptools, "
            "keep-alive) and msgpack clients in bench/http_load.py (stubs)")


def _event_loop() -> str:
    """The stubs' and the front door's loop: uvloop when installed (as `rewarm frontdoor`
    uses it), else asyncio's; the clients run on asyncio's."""
    try:
        import uvloop  # noqa: F401
        return "uvloop"
    except ImportError:
        return "asyncio"


def _guidellm_version() -> str:
    try:
        from importlib.metadata import version
        return version("guidellm")
    except Exception:
        return "(not installed)"


def _print(out: dict) -> list[tuple[str, object]]:
    """Print the table; returns its rows (name, value) for the JSON's ``tables``."""
    if "http_cpu_us_per_request" not in out:   # --only-real
        out = {**out, **{k: float("nan") for k in (
            "http_cpu_us_per_request", "http_sse_cpu_us_per_request",
            "msgpack_cpu_us_per_request", "http_p50_added_ms", "http_p99_added_ms",
            "msgpack_p50_added_ms", "msgpack_p99_added_ms", "half_capacity_rps",
            "rss_growth_bytes_10k_connections")},
               "overload": {"offered_rps": 0, "ok": 0, "shed_429": 0, "expired_504": 0,
                            "lost": 0}}
    rows = [("HTTP CPU per request (us)", out["http_cpu_us_per_request"]),
            ("HTTP SSE CPU per request (us)", out["http_sse_cpu_us_per_request"]),
            ("msgpack CPU per request (us)", out["msgpack_cpu_us_per_request"]),
            ("HTTP / msgpack CPU", round(out["http_cpu_us_per_request"]
                                         / out["msgpack_cpu_us_per_request"], 2)),
            (f"HTTP p50 / p99 added at {out['half_capacity_rps']} rps (ms)",
             f"{out['http_p50_added_ms']} / {out['http_p99_added_ms']}"),
            ("HTTP door busy at that rate (share of its core)",
             out.get("half_capacity_http_door_cpu_fraction", float("nan"))),
            ("msgpack p50 / p99 added, same load (ms)",
             f"{out['msgpack_p50_added_ms']} / {out['msgpack_p99_added_ms']}"),
            ("RSS growth over 10k connections (bytes)", out["rss_growth_bytes_10k_connections"])]
    client = out.get("latency_client")
    if client:   # the clients' own lag in the latency runs: large values void those lines
        rows.insert(7, ("client send late p99 direct / HTTP / msgpack (ms)", " / ".join(
            f"{client[k]['send_late_ms_p99']:.3f}" for k in ("direct", "http", "msgpack"))
            + f"; HTTP waits for a connection {client['http']['waits']}"))
    o = out["overload"]
    rows.append((f"overload {o['offered_rps']} rps: ok / 429 / 504 / lost",
                 f"{o['ok']} / {o['shed_429']} / {o['expired_504']} / {o['lost']}"))
    real = out.get("real_replica")
    if real:
        rows += [("real replica TTFT p50 / p99 (ms)",
                  f"{real['ttft_ms_p50']:.1f} / {real['ttft_ms_p99']:.1f}"),
                 ("real replica ITL p50 (ms)", f"{real['itl_ms_p50']:.1f}"),
                 ("real replica output tokens/s", f"{real['tokens_per_s']:.1f}"),
                 ("real replica answered 200 / requests",
                  f"{real['answered_200']} / {real['requests']}")]
    width = max(len(r[0]) for r in rows)
    print(f"load generator: {out['load_generator']}")
    if "cpu_pinning" in out:
        print(f"front door and stubs on {out['event_loop']}; CPUs "
              f"{out['cpu_pinning'] or 'not pinned'}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if real and real.get("refused_by_reason"):
        print("real replica refusals: " + ", ".join(
            f"{k} x{v}" for k, v in sorted(real["refused_by_reason"].items())))
    print(f"load average {out['loadavg_1m']}")
    return rows


if __name__ == "__main__":
    main()
