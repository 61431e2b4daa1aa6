"""A live trace replay against a running front door, and what its clients saw.

Used by ``bench/trace_replay.py`` and ``rewarm up --demo``: requests
of a scaled trace window (:mod:`agent.sim.replay_scale`) are sent at their wall times over
one msgpack/TCP connection (no client retries: a 429 is an outcome, not something to hide),
and every answer is recorded as a client sees it.

Outcome classes: 200 -> served (by the ``path`` the front door reports), 429 -> shed (and
whether it came within :data:`FAST_REFUSAL_MS` of sending), 504 -> expired, anything else
(503, a broken connection, no answer) -> lost.  The SLA attainment is the share of *all*
requests answered 200 with a TTFT within their path's SLO (:data:`PATH_SLO_MS`; 429s and
504s are misses).

:func:`calibrate` measures the replica behind the front door (a :class:`~agent.speed.SpeedProfile`
from the TTFT of single prompts of several lengths and the time per token of single and
concurrent decodes), and :func:`saturate` what it sustains while backlogged (requests per
second, end to end), for a replay whose scale must come from the machine it runs on.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

from agent.errors import RewarmError
from agent.sim.replay_scale import ReplayRequest
from agent.speed import SpeedProfile
from agent.throughput import BacklogCapacity

PATHS = ("cold_boot", "snapshot_restore", "suspended_resume", "warm_hit")
# TTFT SLO per path (ms), the front door's defaults (docs/architecture.md, "Admission"):
# a warm hit within 2 s at p99, a request that waits for a restore within 4 s.
PATH_SLO_MS = {"warm_hit": 2000.0, "snapshot_restore": 4000.0, "suspended_resume": 4000.0,
               "cold_boot": 4000.0}
FAST_REFUSAL_MS = 50.0
# Calibration requests measure speed, not the SLO: they carry a deadline long enough that
# admission never refuses them on a slow machine (a request's deadline_ms replaces the SLO).
CALIBRATION_DEADLINE_MS = 60_000.0


@dataclass
class Outcome:
    """One request as the client saw it: ``code`` 200 on success; ``ttft_ms`` and
    ``answered_ms`` (first token; final answer or error) measured at the client from the
    moment it was sent; ``path`` from the front door's ``done``; ``sent_s`` wall seconds after
    the replay began."""

    code: int
    path: str | None = None
    ttft_ms: float | None = None
    answered_ms: float | None = None
    sent_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    reason: str = ""
    predicted_ttft_ms: float | None = None  # the front door's, from arrival (its ``done``)
    replica: str | None = None
    queue_wait_ms: float | None = None


async def one_request(client, model: str, tokens: list[int], max_tokens: int,
                      sent_s: float = 0.0, deadline_ms: float | None = None) -> Outcome:
    """Send one generate over ``client`` (an :class:`~agent.client.AsyncClient`); without
    ``deadline_ms`` the front door gives it its path's SLO."""
    start = time.perf_counter()
    out = Outcome(code=0, sent_s=sent_s)
    try:
        async for msg in client.stream(model, tokens=tokens, max_tokens=max_tokens,
                                       deadline_ms=deadline_ms):
            if msg["type"] == "tokens":
                if out.ttft_ms is None:
                    out.ttft_ms = (time.perf_counter() - start) * 1000.0
                out.tokens.extend(msg["tokens"])
            else:
                out.code, out.path = 200, msg.get("path")
                out.predicted_ttft_ms = msg.get("predicted_ttft_ms")
                out.replica, out.queue_wait_ms = msg.get("replica"), msg.get("queue_wait_ms")
    except RewarmError as err:
        out.code, out.reason = int(getattr(err, "code", 500) or 500), str(err)
    except (TimeoutError, OSError) as err:
        out.code, out.reason = 599, f"{type(err).__name__}: {err}"
    if out.code == 0:
        out.code, out.reason = 598, "no done message"
    out.answered_ms = (time.perf_counter() - start) * 1000.0
    return out


async def one_request_at(address: str, model: str, tokens: list[int], max_tokens: int,
                         deadline_ms: float | None = None) -> Outcome:
    """One request on its own connection to the front door at ``address`` (``HOST:PORT``)."""
    from agent.client import AsyncClient

    host, _, port = address.rpartition(":")
    client = await AsyncClient.connect(host, int(port), max_retries=0)
    try:
        return await one_request(client, model, tokens, max_tokens, deadline_ms=deadline_ms)
    finally:
        await client.close()


def prompt_tokens(base: Sequence[int], i: int, n: int) -> list[int]:
    """``n`` prompt token ids for request ``i``, drawn from ``base`` (distinct per request,
    so no two requests are the same prompt)."""
    return [base[(7 * i + j) % len(base)] for j in range(n)]


class _Connection:
    """The replay's one client connection, reopened when the front door has closed it (its
    idle timeout ends a connection quiet through a long gap): a request is only ever sent on
    an open connection, so reopening never repeats one."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.client = None
        self._lock = asyncio.Lock()

    async def get(self):
        from agent.client import AsyncClient

        async with self._lock:
            if self.client is None or self.client._task.done():
                if self.client is not None:
                    await self.client.close()
                self.client = await AsyncClient.connect(self.host, self.port, max_retries=0)
            return self.client

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


async def send_plan(address: str, model: str, plan: Sequence[ReplayRequest],
                    base: Sequence[int], *, until_s: float = 0.0) -> list[Outcome]:
    """Send ``plan`` to the front door at ``address`` (``HOST:PORT``) at its wall times, on
    one connection (reopened if the front door closed it while idle); returns an
    :class:`Outcome` per request, in plan order, once every request is answered and at least
    ``until_s`` wall seconds have passed (the window's end: a quiet tail is part of it)."""
    host, _, port = address.rpartition(":")
    conn = _Connection(host, int(port))

    async def send(i: int, r: ReplayRequest, sent_s: float) -> Outcome:
        try:
            client = await conn.get()
        except (OSError, RewarmError) as err:
            return Outcome(599, sent_s=sent_s, reason=f"cannot connect: {err}")
        return await one_request(client, model, prompt_tokens(base, i, r.prompt_tokens),
                                 r.output_tokens, sent_s)

    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks = []
        for i, r in enumerate(plan):
            delay = t0 + r.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(send(i, r, loop.time() - t0)))
        outcomes = list(await asyncio.gather(*tasks))
        rest = t0 + until_s - loop.time()
        if rest > 0:
            await asyncio.sleep(rest)
        return outcomes
    finally:
        await conn.close()


# --- measuring the replica behind the front door ---------------------------------------------

async def saturate(address: str, model: str, base: Sequence[int],
                   lengths: Sequence[tuple[int, int]], *, concurrency: int, seconds: float,
                   warmup_s: float = 1.0, max_s: float | None = None) -> BacklogCapacity:
    """What the replicas behind ``address`` sustain while backlogged, measured by clients:
    ``concurrency`` clients each send requests back to back (closed loop, so the front door
    and the replicas always have more waiting than they serve) for ``warmup_s + seconds``,
    and on until each client has had two requests answered after ``warmup_s`` (``2 x
    concurrency`` departures counted) or ``max_s`` (default ``4 x (warmup_s + seconds)``)
    has passed; request ``k`` with ``lengths[k % len(lengths)]`` (prompt, output tokens:
    the replay's own mix).  The completions after ``warmup_s`` are counted over the time
    they took (departures per busy second, agent/throughput.py).  The two requests a client:
    a window shorter than a batch's cycle counts a fraction of one cycle's departures over
    the whole window (45-token answers to 100-token prompts, 16 clients on 8 slots: 3
    departures in 8 s, a quarter of the rate), and the simulator fitted to that ran every
    request four times slower than the live replica did.  Every request carries
    :data:`CALIBRATION_DEADLINE_MS`, so admission holds rather than refuses.  ``batch`` of
    the result is ``concurrency`` (what the clients offered; a replica's own meter reports
    the batch it ran).  Raises RuntimeError when a request fails or none completes,
    ConfigError for a concurrency, duration or length list out of range."""
    from agent.client import AsyncClient
    from agent.errors import ConfigError

    if concurrency < 1 or not lengths or not (seconds > 0 and math.isfinite(seconds)) \
            or not warmup_s >= 0:
        raise ConfigError(f"saturate: concurrency={concurrency}, {len(lengths)} lengths, "
                          f"seconds={seconds}, warmup_s={warmup_s}; limits are >= 1, >= 1, "
                          "> 0 and >= 0", name="saturate", value=(concurrency, seconds),
                          limit=">= 1")
    host, _, port = address.rpartition(":")
    client = await AsyncClient.connect(host, int(port), max_retries=0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    start_s, end_s = t0 + warmup_s, t0 + warmup_s + seconds
    last_s = t0 + (4.0 * (warmup_s + seconds) if max_s is None else max(max_s, 0.0))
    wanted = 2 * concurrency
    done: list[tuple[float, int, int]] = []     # (answered at, prompt, generated)
    counter = iter(range(1 << 30))

    stopped: list[float] = []   # when sending stopped: later answers drain a shrinking batch

    def going() -> bool:
        now = loop.time()
        if now < end_s or (now < last_s and sum(1 for d in done if d[0] >= start_s) < wanted):
            return True
        if not stopped:
            stopped.append(now)
        return False

    async def worker() -> None:
        while going():
            k = next(counter)
            prompt, gen = lengths[k % len(lengths)]
            out = await one_request(client, model, prompt_tokens(base, 1000 + k, prompt),
                                    gen, deadline_ms=CALIBRATION_DEADLINE_MS)
            if out.code != 200:
                raise RuntimeError(f"saturation request failed: {out.code} {out.reason}")
            done.append((loop.time(), prompt, len(out.tokens)))

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    stop_s = stopped[0] if stopped else loop.time()
    counted = [d for d in done if start_s <= d[0] <= stop_s]
    if not counted:
        raise RuntimeError(f"saturation: no request completed in "
                           f"{last_s - start_s:g} s after the warm-up")
    span_s = max(d[0] for d in counted) - start_s
    return BacklogCapacity(rps=len(counted) / max(span_s, 1e-9), seconds=max(span_s, 1e-9),
                           batch=float(concurrency),
                           prompt_tokens=statistics.fmean(p for _, p, _ in counted),
                           gen_tokens=statistics.fmean(g for _, _, g in counted))


async def calibrate(address: str, model: str, base: Sequence[int], *, max_seq_len: int,
                    repeats: int = 5) -> SpeedProfile:
    """A :class:`SpeedProfile` of the warm replica behind ``address``, measured by clients.

    Prefill: the median TTFT of ``repeats`` single requests (1 output token) at prompt
    lengths 1, 4, 16, 64 and 128 (capped by ``max_seq_len``; a scaled replay's prompts are
    short), fitted to ``overhead + P / rate`` by least squares on relative error.  Decode: the median time per
    token after the first of a single 17-token request (``decode_base_s``), and of four at
    once (``decode_per_seq_s`` from the difference);
    ``decode_per_ctx_token_s`` is left 0 (these short contexts cannot resolve it).  Every
    figure includes the front door's and the socket's overhead, as a replay's requests do.
    The requests carry :data:`CALIBRATION_DEADLINE_MS`, so admission does not refuse them.
    """
    from agent.client import AsyncClient

    host, _, port = address.rpartition(":")
    client = await AsyncClient.connect(host, int(port), max_retries=0)
    try:
        async def ttft(n: int, i: int) -> float:
            out = await one_request(client, model, prompt_tokens(base, i, n), 1,
                                    deadline_ms=CALIBRATION_DEADLINE_MS)
            if out.code != 200 or out.ttft_ms is None:
                raise RuntimeError(f"calibration request failed: {out.code} {out.reason}")
            return out.ttft_ms / 1000.0

        async def per_token(batch: int, i: int, gen: int = 17) -> float:
            outs = await asyncio.gather(*(one_request(
                client, model, prompt_tokens(base, i + b, 8), gen,
                deadline_ms=CALIBRATION_DEADLINE_MS) for b in range(batch)))
            per_token_s = []
            for o in outs:
                if o.code != 200 or o.ttft_ms is None or o.answered_ms is None:
                    raise RuntimeError(f"calibration request failed: {o.code} {o.reason}")
                per_token_s.append((o.answered_ms - o.ttft_ms) / 1000.0 / max(1, len(o.tokens) - 1))
            return statistics.median(per_token_s)

        for i in range(2):           # warm up the path (connection, replica caches)
            await ttft(8, i)
        lengths = sorted({min(n, max(2, max_seq_len - 2)) for n in (1, 4, 16, 64, 128)})
        xs, ys = [], []
        for n in lengths:
            xs.append(float(n))
            ys.append(statistics.median([await ttft(n, 100 + r) for r in range(repeats)]))
        slope, intercept = _fit_line(xs, ys, relative=True)
        step1 = statistics.median([await per_token(1, 200 + r) for r in range(3)])
        step4 = statistics.median([await per_token(4, 300 + 4 * r) for r in range(3)])
    finally:
        await client.close()
    rate = 1.0 / slope if slope > 0 else 1e6
    return SpeedProfile(prefill_tokens_per_s=rate, prefill_overhead_s=max(0.0, intercept),
                        decode_base_s=max(1e-4, step1),
                        decode_per_seq_s=max(0.0, (step4 - step1) / 3.0),
                        decode_per_ctx_token_s=0.0)


def _fit_line(xs: list[float], ys: list[float], relative: bool = False) -> tuple[float, float]:
    """Least-squares ``y = slope * x + intercept``; with ``relative``, weighted by ``1 / y^2``
    (each point's relative error counts alike, so the short prompts a scaled replay sends
    set the intercept rather than the long ones' absolute noise)."""
    w = [1.0 / (y * y) if relative and y > 0 else 1.0 for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs, strict=True)) / sw
    my = sum(wi * y for wi, y in zip(w, ys, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs, strict=True))
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    if slope < 0:   # noise on a flat curve: no per-token cost resolved, the mean is overhead
        return 0.0, my
    return slope, my - slope * mx


# --- what the clients saw -----------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[k]


def summarise(outcomes: Sequence[Outcome], *, gpu_seconds: float, always_on_gpu_seconds: float,
              restores: int, slo_ms: dict[str, float] | None = None) -> dict[str, Any]:
    """The replay's numbers: ``requests, served, shed_429, shed_429_within_50ms, expired_504,
    lost, sla_attainment, ttft_ms {path: {p50, p99, count, within_slo}}, gpu_seconds,
    always_on_gpu_seconds, gpu_ratio, restores``."""
    slo_ms = slo_ms or PATH_SLO_MS
    ttft: dict[str, list[float]] = {p: [] for p in PATHS}
    on_time = dict.fromkeys(PATHS, 0)
    served = shed = fast = expired = lost = within = 0
    for o in outcomes:
        if o.code == 200:
            served += 1
            path = o.path if o.path in ttft else "warm_hit"
            if o.ttft_ms is not None:
                ttft[path].append(o.ttft_ms)
                made = o.ttft_ms <= slo_ms.get(path, slo_ms["warm_hit"])
                within += made
                on_time[path] += made
        elif o.code == 429:
            shed += 1
            fast += (math.inf if o.answered_ms is None else o.answered_ms) <= FAST_REFUSAL_MS
        elif o.code == 504:
            expired += 1
        else:
            lost += 1
    n = len(outcomes)
    return {
        "requests": n, "served": served, "shed_429": shed, "shed_429_within_50ms": fast,
        "expired_504": expired, "lost": lost,
        "sla_attainment": within / n if n else 1.0,
        "ttft_ms": {p: {"p50": percentile(v, 50), "p99": percentile(v, 99), "count": len(v),
                        "within_slo": on_time[p], "slo_ms": slo_ms.get(p)}
                    for p, v in ttft.items()},
        "gpu_seconds": round(gpu_seconds, 2),
        "always_on_gpu_seconds": round(always_on_gpu_seconds, 2),
        "gpu_ratio": gpu_seconds / always_on_gpu_seconds if always_on_gpu_seconds > 0 else None,
        "restores": restores,
    }
