"""The HTTP entrance's limits, each probed at its value and just over it."""

import asyncio
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from http_harness import ManualClock, http_door, raw_http, run  # noqa: E402

from agent.errors import ConfigError  # noqa: E402
from agent.frontdoor.http_entrance import HttpConfig  # noqa: E402


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0


def _post(body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\n" + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def _body_of(size: int) -> bytes:
    """A valid completions body of exactly ``size`` bytes (the prompt pads it)."""
    base = {"model": "m", "prompt": "", "max_tokens": 1}
    pad = size - len(json.dumps(base).encode())
    return json.dumps({**base, "prompt": "a" * pad}).encode()


def test_body_size_at_and_over_the_limit():
    async def main():
        async with http_door(http={"max_body_bytes": 1000}) as (fd, e, stubs):
            at = await raw_http(e, _post(_body_of(1000)))
            over = await raw_http(e, _post(_body_of(1001)))
            # chunked (no Content-Length): refused while reading, past the limit
            chunked = _body_of(1001)
            over_chunked = await raw_http(e, (
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                b"Connection: close\r\n\r\n%x\r\n" % len(chunked) + chunked + b"\r\n0\r\n\r\n"))
            return at, over, over_chunked, len(stubs[0].received)

    at, over, over_chunked, sent = run(main())
    assert _status(at) == 200 and sent == 1
    assert _status(over) == 413 and b"max_body_bytes(1000)" in over
    assert _status(over_chunked) == 413 and b'"error"' in over_chunked


def test_header_value_and_target_length_at_and_over():
    async def main():
        async with http_door(http={"max_header_bytes": 100}) as (fd, e, _):
            out = []
            for n in (100, 101):
                out.append(await raw_http(e, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: "
                                          + b"a" * n + b"\r\nConnection: close\r\n\r\n"))
            for n in (100, 101):
                target = b"/health?" + b"a" * (n - 8)
                out.append(await raw_http(e, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n"
                                          b"Connection: close\r\n\r\n"))
            return out

    value_at, value_over, target_at, target_over = run(main())
    assert _status(value_at) == 200 and _status(value_over) == 400
    assert _status(target_at) == 200 and _status(target_over) == 400


def test_header_count_at_and_over():
    async def main():
        async with http_door(http={"max_headers": 6}) as (fd, e, _):
            out = []
            for n in (6, 7):   # Host and Connection count
                extra = b"".join(b"X-%d: v\r\n" % i for i in range(n - 2))
                out.append(await raw_http(e, b"GET /health HTTP/1.1\r\nHost: x\r\n" + extra
                                          + b"Connection: close\r\n\r\n"))
            return out

    at, over = run(main())
    assert _status(at) == 200 and _status(over) == 400


def test_a_slow_head_is_cut_at_header_timeout_and_not_before():
    clock = ManualClock()

    async def main():
        async with http_door(clock=clock, http={"header_timeout_s": 5.0}) as (fd, e, _):
            host, port = e.address
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")   # the head is not complete
            await writer.drain()
            while not any(g.head_start_s is not None for g in e.guards.values()):
                await asyncio.sleep(0.01)
            clock.t += 5.0
            e.sweep()                                    # at the limit: still open
            writer.write(b"X-A: 1\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            at_limit_open = len(e.guards) == 1
            clock.t += 0.01
            e.sweep()                                    # just over: 408 and closed
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return at_limit_open, answer, e.counts["timeouts"]

    at_limit_open, answer, timeouts = run(main())
    assert at_limit_open and _status(answer) == 408 and timeouts == 1
    assert b"header_timeout_s" in answer


def test_idle_connections_close_at_idle_timeout():
    clock = ManualClock()

    async def main():
        async with http_door(clock=clock, http={"idle_timeout_s": 30.0}) as (fd, e, _):
            host, port = e.address
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")   # keep-alive
            await writer.drain()
            await asyncio.wait_for(reader.readuntil(b'{"status": "ok"}'), 5)
            clock.t += 30.0
            e.sweep()
            kept = len(e.guards) == 1
            clock.t += 0.01
            e.sweep()
            eof = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return kept, eof

    kept, eof = run(main())
    assert kept and eof == b""


def test_a_slow_body_is_408():
    async def main():
        async with http_door(http={"body_timeout_s": 0.2}) as (fd, e, stubs):
            host, port = e.address
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n"
                         b"Connection: close\r\n\r\n{\"model\"")      # 8 of 50 bytes
            answer = await asyncio.wait_for(reader.readuntil(b"}}"), 10)
            writer.close()
            return answer, len(stubs[0].received)

    answer, sent = run(main())
    assert _status(answer) == 408 and b"body_timeout_s(0.2)" in answer and sent == 0


def test_connection_cap_at_and_over():
    async def main():
        async with http_door(http={"max_connections": 2}) as (fd, e, _):
            host, port = e.address
            conns = [await asyncio.open_connection(host, port) for _ in range(2)]
            while len(e.guards) < 2:
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection(host, port)
            over = await asyncio.wait_for(reader.read(), 5)
            r0, w0 = conns[0]
            w0.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            at = await asyncio.wait_for(r0.read(), 5)
            for _, w in conns:
                w.close()
            writer.close()
            return at, over, e.counts["refused_conns"]

    at, over, refused = run(main())
    assert _status(at) == 200 and _status(over) == 503 and refused == 1
    assert b"too many connections" in over


def test_deadline_header_at_and_over_max_deadline_ms():
    async def main():
        async with http_door() as (fd, e, _):
            body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode()
            at = await raw_http(e, _post(body, b"x-rewarm-deadline-ms: 600000\r\n"))
            over = await raw_http(e, _post(body, b"x-rewarm-deadline-ms: 600000.5\r\n"))
            zero = await raw_http(e, _post(body, b"x-rewarm-deadline-ms: 0\r\n"))
            return at, over, zero

    at, over, zero = run(main())
    assert _status(at) == 200 and _status(over) == 400 and _status(zero) == 400
    assert b"x-rewarm-deadline-ms" in over


@pytest.mark.parametrize("change,name", [
    ({"port": 70000}, "http_port"), ({"max_body_bytes": 0}, "max_body_bytes"),
    ({"max_headers": True}, "max_headers"), ({"header_timeout_s": 0}, "header_timeout_s"),
    ({"idle_timeout_s": float("nan")}, "idle_timeout_s"),
    ({"write_timeout_s": float("inf")}, "write_timeout_s")])
def test_config_refuses_nonsense(change, name):
    with pytest.raises(ConfigError) as err:
        HttpConfig(**change)
    assert err.value.name == name


def test_http_port_from_env():
    from agent.frontdoor.http_conn import http_port_from_env

    assert http_port_from_env({}) == 8000 and http_port_from_env({"REWARM_HTTP_PORT": "0"}) == 0
    assert http_port_from_env({"REWARM_HTTP_PORT": "65535"}) == 65535
    for bad in ("65536", "-1", "http"):
        with pytest.raises(ConfigError) as err:
            http_port_from_env({"REWARM_HTTP_PORT": bad})
        assert err.value.name == "REWARM_HTTP_PORT"


def test_catalog_states(tmp_path):
    from agent.frontdoor.http_entrance import CatalogStates
    from agent.snapshot.catalog import Catalog

    cat = Catalog(":memory:")
    cat.add_snapshot("s1", model_name="a", model_version="1", path=str(tmp_path), pins={},
                     size_bytes=1, digest="d", status="ready")
    cat.upsert_replica("r1", model_name="b", model_version="1", node_id="n", device="cpu",
                       state="suspended", snapshot_id=None)
    assert CatalogStates(cat, ["a", "b", "c"]).states() == {"a": "snapshot", "b": "suspended",
                                                            "c": "cold"}
