"""Which HTTP stack for the OpenAI-compatible entrance: server CPU per request, measured.

Each candidate serves the same two endpoints from its own process, with no rewarm logic:
``POST /v1/completions`` (parse a ~250-byte JSON body, answer ~350 bytes of JSON) and
``POST /v1/completions`` with ``"stream": true`` (16 SSE ``data:`` chunks and ``[DONE]``).
A client process (aiohttp's client, ``--conns`` keep-alive connections) sends ``--requests``
of each kind; the server's user+system CPU (``/proc/<pid>/stat``, clock ticks) over the run,
divided by the requests, is the figure.  Candidates: aiohttp's web server, uvicorn with
httptools, uvicorn with h11 (both with a bare ASGI app, no framework), all on the asyncio
loop (uvloop too when installed, as ``--loop uvloop``).

Usage: ``python bench/http_stack.py --json var/bench/http_stack.json`` (prints a table).
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

BODY = json.dumps({"model": "smollm2-135m", "prompt": "Once upon a time there was a small "
                   "model that served requests quickly.", "max_tokens": 16,
                   "temperature": 0.7, "top_p": 0.9, "seed": 1}).encode()
ANSWER = json.dumps({"id": "cmpl-0123456789abcdef", "object": "text_completion",
                     "created": 1700000000, "model": "smollm2-135m", "choices": [{
                         "index": 0, "text": " it was a sunny day and the model answered",
                         "finish_reason": "length", "logprobs": None}],
                     "usage": {"prompt_tokens": 14, "completion_tokens": 16,
                               "total_tokens": 30}}).encode()
CHUNK = b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":' \
        b'1700000000,"model":"smollm2-135m","choices":[{"index":0,"text":" word",' \
        b'"finish_reason":null}]}\n\n'
CHUNKS = 16


# --- servers -----------------------------------------------------------------------------

def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        if not body.get("stream"):
            return web.Response(body=ANSWER, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(CHUNKS):
            await resp.write(CHUNK)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def asgi_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        return
    chunks = []
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            break
    body = json.loads(b"".join(chunks))
    if not body.get("stream"):
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(ANSWER)).encode())]})
        await send({"type": "http.response.body", "body": ANSWER})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(CHUNKS):
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def serve_uvicorn(port: int, http: str, loop: str) -> None:
    import uvicorn

    uvicorn.run(asgi_app, host="127.0.0.1", port=port, http=http, loop=loop,
                log_level="warning", access_log=False, lifespan="off")


# --- client ------------------------------------------------------------------------------

async def client(port: int, requests: int, conns: int, stream: bool) -> dict:
    import aiohttp

    body = json.loads(BODY)
    body["stream"] = stream
    payload = json.dumps(body).encode()
    url = f"http://127.0.0.1:{port}/v1/completions"
    left = requests
    bad = 0
    connector = aiohttp.TCPConnector(limit=conns)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            nonlocal left, bad
            while left > 0:
                left -= 1
                async with session.post(url, data=payload,
                                        headers={"Content-Type": "application/json"}) as r:
                    data = await r.read()
                    if r.status != 200 or (stream and not data.endswith(b"[DONE]\n\n")):
                        bad += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conns)))
        return {"wall_s": time.perf_counter() - t0, "bad": bad}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_port(port: int, timeout_s: float = 30.0) -> None:
    import socket

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"server on port {port} did not listen within {timeout_s} s")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(stack: str, requests: int, conns: int) -> dict:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", stack, "--port", str(port)])
    try:
        _wait_port(port)
        asyncio.run(client(port, 200, conns, False))  # warm up
        out = {"stack": stack}
        for stream in (False, True):
            cpu0 = _cpu_s(proc.pid)
            run = asyncio.run(client(port, requests, conns, stream))
            cpu = _cpu_s(proc.pid) - cpu0
            kind = "sse" if stream else "json"
            out[f"{kind}_cpu_us_per_request"] = round(cpu / requests * 1e6, 1)
            out[f"{kind}_rps"] = round(requests / run["wall_s"])
            out[f"{kind}_bad"] = run["bad"]
        return out
    finally:
        proc.terminate()
        proc.wait(10)


STACKS = {"aiohttp": lambda p: serve_aiohttp(p),
          "uvicorn-httptools": lambda p: serve_uvicorn(p, "httptools", "asyncio"),
          "uvicorn-h11": lambda p: serve_uvicorn(p, "h11", "asyncio")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--serve", choices=sorted(STACKS), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        STACKS[args.serve](args.port)
        return
    rows = [measure(stack, args.requests, args.conns) for stack in STACKS]
    load = os.getloadavg()
    print(f"{'stack':<20}{'json us/req':>12}{'json rps':>10}{'sse us/req':>12}{'sse rps':>9}")
    for r in rows:
        print(f"{r['stack']:<20}{r['json_cpu_us_per_request']:>12}{r['json_rps']:>10}"
              f"{r['sse_cpu_us_per_request']:>12}{r['sse_rps']:>9}")
    print(f"load average {load[0]:.2f}; {args.requests} requests each, {args.conns} connections")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"stacks": rows, "loadavg_1m": load[0],
                                         "requests": args.requests, "conns": args.conns},
                                        indent=2))


if __name__ == "__main__":
    main()
