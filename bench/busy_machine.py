"""``rewarm up`` on a busy machine: one core kept busy by another process, the embedded default
serving SmolLM2-135M as users meet it, through the official ``openai`` client and guidellm.

    bench/busy_machine.py [--busy-core 0] [--concurrent 8] [--max-tokens 32]
                          [--rate 0.5] [--duration-s 30] [--aot] [--json PATH]

1. a busy loop (``python -c 'while True: pass'``, a process of its own) is pinned to
   ``--busy-core`` (``sched_setaffinity``) and dies with this process (``PR_SET_PDEATHSIG``)
   or at the end; it is killed and waited for in every case;
2. ``rewarm up`` starts as a child process on free ports (its banner says when it serves),
   eager unless ``--aot`` (the AOT package is built once per machine, minutes on two cores);
   the node agent's ``status`` is sampled every 0.5 s: the replicas it ran (up, coming up
   or draining), against the node's ``replica_limit`` (agent/node/capacity.py);
3. the cold model's first request (a 32-token completion): its first token or its refusal,
   and how long either took;
4. ``--concurrent`` streamed ``--max-tokens``-token completions at once through the official
   ``openai`` client (``AsyncOpenAI.completions.create(stream=True)``): each one's code, TTFT
   (from the send to the first streamed chunk) and refusal reason;
5. the RSS and PSS of every process of the stack while it serves (``/proc/PID/smaps_rollup``:
   the ``rewarm up`` process with the front door, node agent and predictor, each replica and
   zygote) and their sums;
6. guidellm (its ``constant`` profile) at ``--rate`` requests/s for ``--duration-s``
   (``rate x duration`` requests of 64 prompt / 32 output tokens, bench/http_load.py's
   invocation); where guidellm is not installed, the same open-loop rate through the openai
   client, and the table says so.

Prints a table and writes ``--json`` (``meta``: bench/run_meta.py; ``targets``: the three
targets of the busy-machine case, met or not, with the load average; ``headline`` and
``tables`` for bench/render_docs.py).  Run it under the
bench lock (``flock /tmp/rewarm-bench.lock``).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.argtypes import nonneg_int, positive_float, positive_int  # noqa: E402

TTFT_TARGET_MS = 4000.0      # every one of the concurrent requests (the restore-path SLO)
SERVED_TARGET = 0.95         # of guidellm's requests
SAMPLE_S = 0.5
RUNNING = ("cold", "restoring", "warm")   # counted by agent/node/capacity.py (and draining
                                          # replicas with requests in flight)
PR_SET_PDEATHSIG = 1         # <linux/prctl.h>


def say(text: str) -> None:
    print(text, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy-core", type=nonneg_int, default=0, help="core the busy loop holds")
    ap.add_argument("--concurrent", type=positive_int, default=8)
    ap.add_argument("--max-tokens", type=positive_int, default=32)
    ap.add_argument("--rate", type=positive_float, default=0.5, help="requests/s (guidellm)")
    ap.add_argument("--duration-s", type=positive_float, default=30.0)
    ap.add_argument("--aot", action="store_true", help="serve the AOT package (built if absent)")
    ap.add_argument("--state-dir", type=Path, default=REPO / "var" / "busy")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "busy_machine.json")
    return ap.parse_args(argv)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when this process dies (prctl(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def start_busy_loop(core: int) -> subprocess.Popen:
    """The background busy loop, pinned to ``core``; ValueError for a core not ours."""
    if core not in os.sched_getaffinity(0):
        raise ValueError(f"--busy-core {core}: not one of this process's cores "
                         f"{sorted(os.sched_getaffinity(0))}")

    def pin() -> None:
        _die_with_parent()
        os.sched_setaffinity(0, {core})

    return subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
    """Signal ``proc`` and wait for it; SIGKILL after ``timeout_s``.  Returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class Up:
    """``rewarm up`` as a child process on free ports; :meth:`wait_banner` reads its banner."""

    def __init__(self, state_dir: Path, aot: bool, extra: list[str] | None = None) -> None:
        self.ports = {k: free_port() for k in ("port", "http", "metrics", "agent")}
        self.agent = f"127.0.0.1:{self.ports['agent']}"
        self.base_url = f"http://127.0.0.1:{self.ports['http']}/v1"
        argv = [sys.executable, "-m", "agent.cli", "up", "--state-dir", str(state_dir),
                "--port", str(self.ports["port"]), "--http-port", str(self.ports["http"]),
                "--metrics-port", str(self.ports["metrics"]), "--agent-listen", self.agent]
        if not aot:
            argv.append("--no-aot")
        argv += extra or []
        self.lines: list[str] = []
        self.banner = threading.Event()
        self.model = ""
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=_die_with_parent)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if line.startswith("rewarm up: model "):
                self.model = line.split()[3]
                self.banner.set()

    def wait_banner(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while not self.banner.wait(1.0):
            if self.proc.poll() is not None:
                raise RuntimeError("rewarm up exited before serving: "
                                   + " | ".join(self.lines[-5:]))
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"rewarm up did not serve within {timeout_s:.0f} s")
        return time.monotonic() - t0


class ReplicaSampler:
    """The node agent's ``status`` every ``SAMPLE_S``: the most replicas not dead, the
    node's replica limit, and each change of the count (seconds since start, count)."""

    def __init__(self, agent: str) -> None:
        self.agent, self.peak, self.peak_listed, self.limit = agent, 0, 0, None
        self.changes: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self.t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from agent.cluster.control import control_call
        from agent.errors import RewarmError

        last = -1
        while not self._stop.wait(SAMPLE_S):
            try:
                st = control_call(self.agent, "status", timeout_s=5.0)
            except (RewarmError, OSError, TimeoutError):
                continue
            listed = st.get("replicas") or []
            # what takes the node's cores: replicas coming up, warm, or draining with requests
            # still in flight (an idle one draining after a scale-in only exits; every listed
            # one is counted in peak_listed)
            n = sum(1 for r in listed if r.get("state") in RUNNING
                    or (r.get("state") == "draining" and r.get("in_flight")))
            self.limit = (st.get("capacity") or {}).get("replica_limit", self.limit)
            self.peak = max(self.peak, n)
            self.peak_listed = max(self.peak_listed, len(listed))
            if n != last:
                self.changes.append((round(time.monotonic() - self.t0, 1), n))
                last = n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def descendants(root: int) -> list[int]:
    """``root`` and every process under it (``/proc/*/stat``'s parent pid), root first."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the comm field is in parentheses and may hold spaces: the fields after the last ")"
        parent[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    out, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out.extend(frontier)
    return out


def memory_of(pid: int) -> dict | None:
    """``rss_bytes`` and ``pss_bytes`` of ``pid`` (``/proc/PID/smaps_rollup``, kB lines; PSS
    shares each shared page among the processes mapping it), and what it is, from its
    command line; None once it is gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    kb = {}
    for line in rollup.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] == "kB":
            kb[parts[0].rstrip(":")] = int(parts[1])
    words = [a.decode(errors="replace") for a in argv if a]
    if "up" in words:
        what = "rewarm up (front door, node agent, predictor)"
    elif "--zygote" in words:
        what = "zygote"
    elif "replica" in words:
        what = "replica"
    else:
        what = " ".join(words)[:60]
    return {"pid": pid, "process": what, "rss_bytes": kb.get("Rss", 0) * 1024,
            "pss_bytes": kb.get("Pss", 0) * 1024}


def stack_memory(root: int) -> dict:
    """RSS and PSS of every process of the stack under ``root`` and their sums (the sum of
    PSS is the stack's share of memory; the sum of RSS counts shared pages once each)."""
    rows = [m for m in (memory_of(p) for p in descendants(root)) if m is not None]
    return {"processes": rows, "rss_bytes_sum": sum(r["rss_bytes"] for r in rows),
            "pss_bytes_sum": sum(r["pss_bytes"] for r in rows)}


async def one_completion(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: ``code`` (200, or the HTTP status of the refusal),
    ``ttft_ms`` (send to the first streamed chunk: the first token, whose text may be
    empty), ``total_ms``, ``reason``."""
    import openai

    t0 = time.monotonic()
    ttft = None
    try:
        stream = await client.completions.create(model=model, prompt=prompt,
                                                 max_tokens=max_tokens, stream=True)
        async for chunk in stream:
            if ttft is None and chunk.choices:   # the first token (its text may be empty)
                ttft = (time.monotonic() - t0) * 1000.0
        code, reason = 200, ""
    except openai.APIStatusError as err:
        code, reason = err.status_code, str(err.message)[:200]
    except openai.APIError as err:
        code, reason = 0, str(err)[:200]
    return {"code": code, "ttft_ms": None if ttft is None else round(ttft, 1),
            "total_ms": round((time.monotonic() - t0) * 1000.0, 1), "reason": reason}


async def concurrent(base_url: str, model: str, n: int, max_tokens: int) -> list[dict]:
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                  timeout=120.0) as client:
        prompts = [f"Write a short note about the number {i}." for i in range(n)]
        return list(await asyncio.gather(*(one_completion(client, model, p, max_tokens)
                                           for p in prompts)))


async def open_loop(base_url: str, model: str, rate: float, count: int,
                    max_tokens: int) -> list[dict]:
    """``count`` requests at ``rate``/s, each sent on time whatever the earlier ones do."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0,
                                  timeout=120.0) as client:
        tasks = []
        for i in range(count):
            tasks.append(asyncio.create_task(one_completion(
                client, model, f"Tell me about the year {1900 + i}.", max_tokens)))
            await asyncio.sleep(1.0 / rate)
        return list(await asyncio.gather(*tasks))


def rejections(metrics_port: int) -> dict[str, float]:
    """The stack's ``rewarm_rejections_total`` by ``code`` and ``reason`` label, from its
    /metrics (the whole run: the concurrent requests' and the rate's); {} when unreadable."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "rewarm_rejections":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.value:
                key = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                               if k in ("code", "reason"))
                out[key] = out.get(key, 0.0) + sample.value
    return out


def guidellm_rate(port: int, model: str, rate: float, count: int) -> dict:
    """guidellm at ``rate`` for ``count`` requests (bench/http_load.py's invocation): its
    served count, TTFT p50/p99; or, without guidellm, the open-loop openai client."""
    exe = Path(sys.executable).with_name("guidellm")
    if exe.is_file():
        from agent.replica.smollm2 import DEFAULT_DIR

        sys.path.insert(0, str(REPO / "bench"))   # http_load imports its sibling open_loop
        from bench.http_load import _guidellm, _guidellm_summary

        report = _guidellm(port, model, DEFAULT_DIR, REPO / "var" / "bench", rate=rate,
                           requests=count, prompt_tokens=64, output_tokens=32)
        s = _guidellm_summary(report, 0.0, count)
        return {"tool": "guidellm", "requests": count, "served": s["answered_200"],
                "ttft_ms_p50": s["ttft_ms_p50"], "ttft_ms_p99": s["ttft_ms_p99"]}
    rows = asyncio.run(open_loop(f"http://127.0.0.1:{port}/v1", model, rate, count, 32))
    ttfts = sorted(r["ttft_ms"] for r in rows if r["code"] == 200 and r["ttft_ms"] is not None)
    pick = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None  # noqa: E731
    return {"tool": "openai client, open loop (guidellm not installed)", "requests": count,
            "served": sum(r["code"] == 200 for r in rows), "ttft_ms_p50": pick(0.5),
            "ttft_ms_p99": pick(0.99), "refusals": [r["reason"] for r in rows if r["code"] != 200]}


def _ms(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def table(out: dict) -> str:
    c, g, first = out["concurrent"], out["rate"], out["first_request"]
    ttfts = [r["ttft_ms"] for r in c if r["ttft_ms"] is not None]
    lines = [f"rewarm up with core {out['busy_core']} kept busy ({out['forward']}); "
             f"load average {' '.join(f'{x:.2f}' for x in out['loadavg'])}",
             f"  {'replicas run (peak / node limit)':<44}{out['replicas_peak']} / "
             f"{out['replica_limit']}",
             f"  {'first request (cold model): code, ms':<44}{first['code']}, "
             f"{_ms(first['ttft_ms'] or first['total_ms'])}",
             f"  {'concurrent served (TTFT <= 4 s) / sent':<44}"
             f"{sum(r['code'] == 200 for r in c)} "
             f"({sum(r['code'] == 200 and (r['ttft_ms'] or 1e9) <= TTFT_TARGET_MS for r in c)})"
             f" / {len(c)}",
             f"  {'concurrent TTFT min / max ms':<44}{_ms(min(ttfts, default=None))} / "
             f"{_ms(max(ttfts, default=None))}",
             f"  {g['tool'][:30] + ' served / sent':<44}{g['served']} / {g['requests']}",
             f"  {'  TTFT p50 / p99 ms':<44}{_ms(g['ttft_ms_p50'])} / {_ms(g['ttft_ms_p99'])}"]
    for m in out["memory"]["processes"]:
        lines.append(f"  {m['process'][:36] + ' ' + str(m['pid']):<44}RSS "
                     f"{m['rss_bytes'] / 2**20:,.0f} MiB, PSS {m['pss_bytes'] / 2**20:,.0f} MiB")
    lines.append(f"  {'sum':<44}RSS {out['memory']['rss_bytes_sum'] / 2**20:,.0f} MiB, PSS "
                 f"{out['memory']['pss_bytes_sum'] / 2**20:,.0f} MiB")
    for t in out["targets"]:
        lines.append(f"  {'MET' if t['met'] else 'NOT MET'}: {t['label']}: {t['value']}")
    return "\n".join(lines)


def targets(out: dict) -> list[dict]:
    """The busy-machine targets: ``{"label", "value", "met"}`` each (the load average in
    the label: every figure says what the machine was doing)."""
    c, g = out["concurrent"], out["rate"]
    on_time = sum(r["code"] == 200 and (r["ttft_ms"] or 1e9) <= TTFT_TARGET_MS for r in c)
    la = out["loadavg"][0]
    limit = out["replica_limit"]
    return [
        {"label": f"replicas run, peak / node limit (one core busy, load average {la:.2f})",
         "value": f"{out['replicas_peak']} / {limit}",
         "met": limit is not None and out["replicas_peak"] <= limit},
        {"label": f"{len(c)} concurrent {out['max_tokens']}-token completions served with "
                  f"TTFT <= 4 s (openai client)", "value": f"{on_time} of {len(c)}",
         "met": on_time == len(c)},
        {"label": f"{g['tool'].split(',')[0]} at {out['rate_rps']:g} requests/s, served "
                  f"(target >= {SERVED_TARGET:.0%})", "value": f"{g['served']} of {g['requests']}",
         "met": g["served"] >= SERVED_TARGET * g["requests"]},
    ]


def tables(out: dict) -> list[dict]:
    """The page's tables: the targets, and each concurrent request."""
    return [{"title": "rewarm up with one core kept busy by another process",
             "columns": ["figure", "value", "target met"],
             "rows": [[t["label"], t["value"], "yes" if t["met"] else "no"]
                      for t in out["targets"]]},
            {"title": "the concurrent completions, each",
             "columns": ["code", "TTFT ms", "total ms", "reason"],
             "rows": [[r["code"], r["ttft_ms"], r["total_ms"], r["reason"][:100]]
                      for r in out["concurrent"]]},
            {"title": "memory of the stack's processes while serving (/proc/PID/smaps_rollup)",
             "columns": ["process", "pid", "RSS MiB", "PSS MiB"],
             "rows": [[m["process"], m["pid"], round(m["rss_bytes"] / 2**20, 1),
                       round(m["pss_bytes"] / 2**20, 1)] for m in out["memory"]["processes"]]
             + [["sum", "", round(out["memory"]["rss_bytes_sum"] / 2**20, 1),
                 round(out["memory"]["pss_bytes_sum"] / 2**20, 1)]]}]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    busy = start_busy_loop(args.busy_core)
    up = sampler = None
    try:
        up = Up(args.state_dir, args.aot)
        banner_s = up.wait_banner(1800.0)
        say(f"rewarm up serving after {banner_s:.0f} s (model {up.model})")
        sampler = ReplicaSampler(up.agent)
        first = asyncio.run(concurrent(up.base_url, up.model, 1, args.max_tokens))[0]
        say(f"first request: {first}")
        time.sleep(5.0)   # the predictor sees the demand and the replica settles
        conc = asyncio.run(concurrent(up.base_url, up.model, args.concurrent, args.max_tokens))
        for r in conc:
            say(f"  concurrent: {r}")
        memory = stack_memory(up.proc.pid)   # serving: the replica warm, the zygote ready
        count = max(1, round(args.rate * args.duration_s))
        rate = guidellm_rate(up.ports["http"], up.model, args.rate, count)
        rate["rejections"] = rejections(up.ports["metrics"])   # guidellm keeps no reasons
        say(f"rate: {rate}")
        sampler.stop()
        out = {"busy_core": args.busy_core, "forward": "aot" if args.aot else "eager (--no-aot)",
               "model": up.model, "banner_s": round(banner_s, 1),
               "replicas_peak": sampler.peak, "replica_limit": sampler.limit,
               "replicas_peak_listed": sampler.peak_listed,
               "replica_changes": sampler.changes, "first_request": first,
               "max_tokens": args.max_tokens, "concurrent": conc, "rate_rps": args.rate,
               "rate": rate, "memory": memory, "loadavg": os.getloadavg()}
    finally:
        if sampler is not None:
            sampler.stop()
        if up is not None:
            code = stop(up.proc, signal.SIGINT)
            say(f"rewarm up stopped (exit {code})")
        stop(busy, signal.SIGKILL)
    out["targets"] = targets(out)
    out["title"] = ("rewarm up on a busy machine: one core held by a busy loop, SmolLM2-135M "
                    "through the openai client and guidellm")
    out["tables"] = tables(out)
    out["headline"] = [[t["label"], t["value"]] for t in out["targets"]]
    say(table(out))
    from bench.run_meta import run_meta

    out["meta"] = run_meta()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    say(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
