"""The msgpack door's slots under slow and idle clients: a per-peer cap, a reserve for the
node's own components, a short bound on frames begun with nothing in flight, and tuned TCP
keepalive.  Real sockets on loopback (127.0.0.2 stands for another host: Linux routes all
of 127/8 to the loopback interface)."""

import asyncio
import pathlib
import socket
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_server import run, setup  # noqa: E402

from agent.errors import ConfigError  # noqa: E402
from agent.frontdoor.config import FrontDoorConfig  # noqa: E402
from agent.protocol import Decoder, pack  # noqa: E402

HEALTH = pack({"op": "health", "id": 1})


async def ask(host, port, source="127.0.0.1"):
    """One health request from ``source``; returns the first answer and the open stream."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    writer.write(HEALTH)
    await writer.drain()
    dec = Decoder()
    while True:
        chunk = await asyncio.wait_for(reader.read(65536), 5)
        if not chunk:
            return None, writer
        msgs = dec.feed(chunk)
        if msgs:
            return msgs[0], writer


def test_one_peer_holds_at_most_its_share_of_slots():
    async def main():
        fd, _, host, port = await setup(max_connections_per_peer=3, component_peers=())
        held = []
        for _ in range(3):
            answer, w = await ask(host, port)
            assert answer["type"] == "result"
            held.append(w)
        answer, w = await ask(host, port)
        assert answer["code"] == 429 and "max_connections_per_peer(3)" in answer["reason"]
        assert answer["refusal"] == "max_connections"
        w.close()
        other, w2 = await ask(host, port, "127.0.0.2")          # another peer still gets in
        assert other["type"] == "result"
        held[0].close()
        await asyncio.sleep(0.1)
        again, w3 = await ask(host, port)                      # a slot of its own came free
        assert again["type"] == "result"
        for x in (*held[1:], w2, w3):
            x.close()
        await fd.stop()
    run(main())


def test_the_reserve_keeps_slots_for_the_nodes_own_components():
    async def main():
        fd, _, host, port = await setup(max_connections=6, component_reserve=2,
                                        component_peers=("127.0.0.2",))
        held = []
        for _ in range(4):                                     # 6 - 2 reserved
            answer, w = await ask(host, port)
            assert answer["type"] == "result"
            held.append(w)
        answer, w = await ask(host, port)
        assert answer["code"] == 429 and "node's own components" in answer["reason"]
        w.close()
        for _ in range(2):                                     # the predictor still gets in
            mine, w = await ask(host, port, "127.0.0.2")
            assert mine["type"] == "result"
            held.append(w)
        full, w = await ask(host, port, "127.0.0.2")
        assert full["code"] == 429                             # the reserve has its end too
        w.close()
        for x in held:
            x.close()
        await fd.stop()
    run(main())


def test_a_frame_begun_with_nothing_in_flight_is_cut_at_the_idle_bound():
    async def main():
        fd, _, host, port = await setup(idle_frame_deadline_s=0.3, frame_deadline_s=30.0,
                                        sweep_s=0.05)
        reader, writer = await asyncio.open_connection(host, port)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        writer.write(HEALTH[:1])                               # one byte, then nothing
        data = await asyncio.wait_for(reader.read(), 5)
        answer = Decoder().feed(data)[0]
        assert answer["code"] == 400 and "idle_frame_deadline_s(0.3)" in answer["reason"]
        assert loop.time() - t0 < 5.0                          # not frame_deadline_s (30 s)
        writer.close()
        await fd.stop()
    run(main())


@pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="Linux keepalive options")
def test_tcp_keepalive_is_tuned_on_each_client_connection():
    async def main():
        fd, _, host, port = await setup(keepalive_idle_s=42.0, keepalive_interval_s=7.0,
                                        keepalive_count=3)
        answer, w = await ask(host, port)
        assert answer["type"] == "result"
        (conn,) = fd.msgpack.conns
        sock = conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 42
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 7
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
        w.close()
        await fd.stop()
    run(main())


def test_defaults_and_nonsense():
    cfg = FrontDoorConfig()
    assert cfg.reserved_slots == 64 and cfg.idle_timeout_s <= 30.0
    assert FrontDoorConfig(max_connections=2).reserved_slots == 0
    for kw, name in (({"component_reserve": 10, "max_connections": 10}, "component_reserve"),
                     ({"max_connections_per_peer": 0}, "max_connections_per_peer"),
                     ({"keepalive_count": 0}, "keepalive_count"),
                     ({"idle_frame_deadline_s": 0}, "idle_frame_deadline_s"),
                     ({"component_peers": ["127.0.0.1"]}, "component_peers")):
        with pytest.raises(ConfigError) as err:
            FrontDoorConfig(**kw)
        assert err.value.name == name and name in err.value.message
