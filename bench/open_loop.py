"""The open-loop clients of bench/http_load.py: HTTP and msgpack, alike but for the protocol.

Both are one sender loop writing pre-encoded requests at their Poisson arrival times over
persistent connections opened beforehand, and one ``asyncio.Protocol`` per connection
stamping the answer's arrival.  HTTP/1.1 has one request in flight per keep-alive connection
(no pipelining, as real clients do), so the HTTP sender takes an idle connection of its
``conns`` and waits for one when none is idle, as aiohttp's connector does at its limit
(counted in ``waits``); the answer is parsed by httptools (the HTTP parser uvicorn uses).
msgpack multiplexes, so its requests are dealt round-robin over ``conns`` connections.

Latency runs from the write to the answer's last byte.  How late the writes were against
their schedule is kept in :data:`CLIENT_STATS` beside it (``send_late_ms_p99``), so that a
client that fell behind shows.  The client's own collector is off while it sends (it
allocates a few objects per request): a collection there would be counted as the door's
latency.  Why not aiohttp's client, as before: measured here at 1,442 rps it spent 217 us of
CPU per request and paused 28-47 ms in its own collector (a coroutine per request, made up
front), on the same two cores as the door; this one spends about 86 us and does not collect.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time

import numpy as np

from agent.protocol import Decoder, pack

MODEL = "bench"
PROMPT = "Once upon a time there was a small model that answered quickly."
CLIENT_STATS: list[dict] = []   # per load run: {"waits", "send_late_ms_p99"}


class _HttpConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of :func:`http_load`: at most one request in
    flight (``rid``); back in ``idle`` once its answer is complete."""

    def __init__(self, run: _Run, idle: list, freed: asyncio.Event) -> None:
        import httptools

        self.run, self.idle, self.freed, self.rid = run, idle, freed, -1
        self.parser = httptools.HttpResponseParser(self)
        self.t: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.t = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.idle.append(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:        # httptools.HttpParserError: a malformed answer is lost
            self.t.close()

    def on_message_complete(self) -> None:
        rid, self.rid = self.rid, -1
        self.run.answer(rid, self.parser.get_status_code())
        if self.parser.should_keep_alive():
            self.idle.append(self)
            self.freed.set()
        else:
            self.t.close()

    def connection_lost(self, exc) -> None:
        if self in self.idle:
            self.idle.remove(self)
        if self.rid >= 0:        # an answer cut off is lost: its status stays 0
            self.run.pending -= 1
            self.rid = -1


class _Run:
    """One open-loop run's bookkeeping: per request the send time, latency and status
    (0: no answer)."""

    def __init__(self, n: int) -> None:
        self.lat, self.status, self.sent = np.full(n, np.nan), np.zeros(n, np.int32), np.zeros(n)
        self.pending, self.waits = n, 0
        self.late_s = np.zeros(n)     # write time minus scheduled arrival

    def answer(self, rid: int, code: int) -> None:
        if rid >= 0 and self.status[rid] == 0:
            self.lat[rid], self.status[rid] = time.perf_counter() - self.sent[rid], code
            self.pending -= 1

    async def paced(self, arrivals_s: np.ndarray, send) -> None:
        """Calls ``send(i)`` at each arrival (open loop), the collector off meanwhile."""
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            for i in range(len(arrivals_s)):
                delay = t0 + arrivals_s[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await send(i)
                self.late_s[i] = self.sent[i] - t0 - arrivals_s[i]
        finally:
            gc.enable()

    async def drain(self, drain_s: float) -> None:
        end = time.perf_counter() + drain_s
        while self.pending and time.perf_counter() < end:
            await asyncio.sleep(0.005)


async def http_load(port: int, arrivals_s: np.ndarray, *, stream: bool = False,
                     max_tokens: int = 16, deadline_ms: float | None = None,
                     conns: int = 64, timeout_s: float = 30.0) -> tuple[np.ndarray, np.ndarray]:
    """Open-loop: request i is sent at ``arrivals_s[i]`` on an idle keep-alive connection;
    returns (latency_s, status) per request (status 0: no answer within ``timeout_s`` of the
    last send)."""
    loop = asyncio.get_running_loop()
    run, idle, freed = _Run(len(arrivals_s)), [], asyncio.Event()
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                       "stream": stream, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n")
    if deadline_ms:
        head += f"x-rewarm-deadline-ms: {deadline_ms:g}\r\n"
    request = head.encode() + b"\r\n" + body
    opened = await asyncio.gather(*(loop.create_connection(
        lambda: _HttpConn(run, idle, freed), "127.0.0.1", port) for _ in range(conns)))

    async def send(i: int) -> None:
        if not idle:
            run.waits += 1
        while not idle:
            freed.clear()
            await freed.wait()
        conn = idle.pop()
        conn.rid = i
        run.sent[i] = time.perf_counter()
        conn.t.write(request)

    await run.paced(arrivals_s, send)
    await run.drain(timeout_s)
    for transport, _ in opened:
        transport.close()
    CLIENT_STATS.append({"waits": run.waits, "send_late_ms_p99": pct(run.late_s, 99)})
    return run.lat, run.status


class _MsgConn(asyncio.Protocol):
    def __init__(self, run: _Run) -> None:
        self.run, self.d = run, Decoder()

    def connection_made(self, transport) -> None:
        self.t = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        for m in self.d.feed(data):
            kind = m.get("type")
            if kind == "done":
                self.run.answer(m["id"], 200)
            elif kind == "error" and m.get("id") is not None:
                self.run.answer(m["id"], m["code"])


async def msgpack_load(port: int, arrivals_s: np.ndarray, *, max_tokens: int = 16,
                        conns: int = 64, model: str = MODEL,
                        drain_s: float = 10.0) -> tuple[np.ndarray, np.ndarray]:
    """The same open-loop load over the msgpack protocol (to the front door or a stub),
    requests dealt round-robin over ``conns`` connections (the protocol multiplexes)."""
    loop = asyncio.get_running_loop()
    run = _Run(len(arrivals_s))
    links = [(await loop.create_connection(lambda: _MsgConn(run), "127.0.0.1", port))[0]
             for _ in range(conns)]
    frames = [pack({"op": "generate", "id": i, "model": model, "prompt": PROMPT,
                    "max_tokens": max_tokens}) for i in range(len(arrivals_s))]

    async def send(i: int) -> None:
        run.sent[i] = time.perf_counter()
        links[i % conns].write(frames[i])

    await run.paced(arrivals_s, send)
    await run.drain(drain_s)
    for t in links:
        t.close()
    CLIENT_STATS.append({"waits": 0, "send_late_ms_p99": pct(run.late_s, 99)})
    return run.lat, run.status


async def serve_stubs(protocol, count: int) -> None:
    """Listen with ``count`` servers of ``protocol`` on loopback, print ``READY port...`` (the
    parent process reads it) and serve until killed."""
    loop = asyncio.get_running_loop()
    ports = []
    for _ in range(count):
        server = await loop.create_server(protocol, "127.0.0.1", 0)
        ports.append(server.sockets[0].getsockname()[1])
    print("READY", *ports, flush=True)
    await asyncio.Event().wait()


def poisson(rate: float, duration_s: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = max(1, int(rate * duration_s))
    return np.cumsum(rng.exponential(1.0 / rate, n))



def pct(values: np.ndarray, q: float) -> float:
    values = values[~np.isnan(values)]
    return float(np.percentile(values, q) * 1000.0) if len(values) else float("nan")


