"""A connection refused at a door's limits says why as data, like every other refusal: the
msgpack answer's ``refusal`` is ``max_connections`` (the connection cap, the per-peer cap,
the components' reserve) or ``fd_reserve`` (the descriptor limit), and the HTTP door's 503 at
its cap carries ``x-rewarm-refusal: max_connections`` and ``error.refusal``
(agent/wire/refusals.py, docs/http-api.md)."""

import asyncio
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from http_harness import http_door  # noqa: E402
from http_harness import run as run_http  # noqa: E402
from test_door_slots import ask  # noqa: E402
from test_server import run, setup  # noqa: E402

import msgpack  # noqa: E402

from agent.wire import refusals  # noqa: E402


def test_the_msgpack_per_peer_cap_and_total_cap_answer_max_connections():
    async def main():
        fd, _, host, port = await setup(max_connections_per_peer=1, component_peers=())
        held, w = await ask(host, port)
        assert held["type"] == "result"
        over, w2 = await ask(host, port)
        w.close()
        w2.close()
        await fd.stop()
        return over

    over = run(main())
    assert over["code"] == 429 and over.get("refusal") == refusals.MAX_CONNECTIONS


def test_the_msgpack_descriptor_limit_answer_says_fd_reserve():
    async def main():
        fd, _, host, port = await setup()
        sent = fd.msgpack._listener.refusal
        await fd.stop()
        return msgpack.unpackb(sent)

    answer = run(main())
    assert answer["code"] == 429 and answer.get("refusal") == refusals.FD_RESERVE


def test_the_http_connection_cap_answer_carries_the_refusal_header_and_field():
    async def main():
        async with http_door(http={"max_connections": 1}) as (fd, e, _):
            host, port = e.address
            r0, w0 = await asyncio.open_connection(host, port)
            while len(e.guards) < 1:
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection(host, port)
            over = await asyncio.wait_for(reader.read(), 5)
            w0.close()
            writer.close()
            return over

    over = run_http(main())
    head, _, body = over.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503")
    assert b"\r\nx-rewarm-refusal: max_connections" in head
    assert json.loads(body)["error"]["refusal"] == refusals.MAX_CONNECTIONS
