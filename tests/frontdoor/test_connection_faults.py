"""Connection faults at the front door: bad requests in a pipeline, half-closes, busy
pipeliners, oversized messages, shutdown and nonsense configuration.  Real sockets on
loopback against stub replicas; no timing assertions beyond generous bounds."""

import asyncio
import pathlib
import socket
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_server import FakeCapacity, raw, run, setup  # noqa: E402

from agent.errors import ConfigError  # noqa: E402
from agent.frontdoor.server import FrontDoorConfig  # noqa: E402
from agent.protocol import Decoder, pack  # noqa: E402


def gen(rid, **kw):
    return {"op": "generate", "id": rid, "model": "m", "tokens": [1, 2],
            "max_tokens": 3, **kw}


class Peer:
    """A raw client connection that reads answers (and notices EOF or a reset)."""

    @classmethod
    async def open(cls, host, port):
        self = cls()
        self.reader, self.writer = await asyncio.open_connection(host, port)
        self.decoder, self.msgs, self.eof = Decoder(), [], False
        return self

    async def read_until(self, pred, timeout=5.0):
        """Read until ``pred(self.msgs)`` holds or the server closes; returns the messages."""
        async def loop():
            while not pred(self.msgs):
                chunk = await self.reader.read(65536)
                if not chunk:
                    self.eof = True
                    return
                self.msgs.extend(self.decoder.feed(chunk))
        await asyncio.wait_for(loop(), timeout)
        return self.msgs

    async def read_to_eof(self, timeout=5.0):
        return await self.read_until(lambda msgs: False, timeout)

    def final(self):
        """id -> the final answer (done / error / result) for each id answered."""
        return {m["id"]: m for m in self.msgs if m["type"] != "tokens"}

    def close(self):
        self.writer.close()


async def until(cond, timeout=5.0):
    """Wait (polling) until ``cond()`` holds."""
    async def loop():
        while not cond():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(loop(), timeout)


def answered(*ids):
    return lambda msgs: set(ids) <= {m["id"] for m in msgs if m["type"] != "tokens"}


# --- 1: a bad request in a pipeline is answered alone ------------------------------------

def test_a_bad_request_pipelined_between_good_ones_is_answered_alone_and_all_others_served():
    async def main():
        fd, stubs, host, port = await setup()
        peer = await Peer.open(host, port)
        peer.writer.write(pack(gen("a")) + pack(gen("b")) + pack(gen("c", max_tokens=0))
                          + pack(gen("d")))
        await peer.read_until(answered("a", "b", "c", "d"))
        final = peer.final()
        assert [final[i]["type"] for i in "abd"] == ["done"] * 3
        assert final["c"]["code"] == 400 and "max_tokens" in final["c"]["reason"]
        assert "value 0" in final["c"]["reason"] and "limit 4096" in final["c"]["reason"]
        peer.writer.write(pack({"op": "health", "id": "e"}))   # the connection is still open
        await peer.read_until(answered("e"))
        assert peer.final()["e"]["result"]["status"] == "ok" and not peer.eof
        assert sorted(m["id"] for m in stubs[0].received) == [1, 2, 3]  # a, b, d only
        peer.close()
        await fd.stop()
    run(main())


def test_a_long_stream_in_flight_survives_a_bad_request_after_it():
    async def main():
        fd, stubs, host, port = await setup(stub={"hold": True})
        peer = await Peer.open(host, port)
        peer.writer.write(pack(gen("long", max_tokens=200)) + pack(gen("bad", model=5)))
        await peer.read_until(answered("bad"))
        assert peer.final()["bad"]["code"] == 400 and "model" in peer.final()["bad"]["reason"]
        await until(lambda: stubs[0]._held)                    # "long" reached the replica
        stubs[0].release()                                     # the replica answers now
        await peer.read_until(answered("long"))
        tokens = [t for m in peer.msgs if m["id"] == "long" and m["type"] == "tokens"
                  for t in m["tokens"]]
        assert tokens == list(range(2, 202)) and peer.final()["long"]["type"] == "done"
        assert not peer.eof
        peer.close()
        await fd.stop()
    run(main())


def test_a_framing_error_closes_only_after_requests_in_flight_are_answered():
    async def main():
        fd, stubs, host, port = await setup(stub={"hold": True})
        peer = await Peer.open(host, port)
        peer.writer.write(pack(gen("a")))
        await until(lambda: stubs[0]._held)
        peer.writer.write(b"\xc1")                             # never valid msgpack
        await peer.read_until(answered(None))
        assert peer.final()[None]["code"] == 400 and not peer.eof
        stubs[0].release()
        await peer.read_to_eof()
        assert peer.final()["a"]["type"] == "done" and peer.eof
        peer.close()
        await fd.stop()
    run(main())


# --- 2: half-close --------------------------------------------------------------------

def test_half_close_after_a_complete_request_gets_the_answer_then_eof():
    async def main():
        fd, _, host, port = await setup()
        peer = await Peer.open(host, port)
        peer.writer.write(pack(gen("h")))
        peer.writer.write_eof()
        await peer.read_to_eof()
        assert [m["type"] for m in peer.msgs] == ["tokens", "done"] and peer.eof
        peer.close()
        await fd.stop()
    run(main())


def test_half_close_with_a_request_still_queued_answers_it_when_served():
    async def main():
        fd, stubs, host, port = await setup(stub={"max_seqs": 1, "hold": True},
                                            capacity=FakeCapacity(fail=True, delay_s=5))
        peer = await Peer.open(host, port)
        peer.writer.write(pack(gen("first")) + pack(gen("queued")))
        peer.writer.write_eof()
        await asyncio.sleep(0.1)
        assert len(fd.queues["m"]) == 1 and not peer.eof
        stubs[0].hold = False
        stubs[0].release()
        await peer.read_to_eof()
        assert {i: m["type"] for i, m in peer.final().items()} == {"first": "done",
                                                                    "queued": "done"}
        assert peer.eof
        peer.close()
        await fd.stop()
    run(main())


def test_half_close_mid_frame_is_a_400_truncated_frame_then_eof():
    async def main():
        fd, _, host, port = await setup()
        peer = await Peer.open(host, port)
        peer.writer.write(pack(gen("h"))[:7])
        peer.writer.write_eof()
        await peer.read_to_eof()
        assert len(peer.msgs) == 1 and peer.msgs[0]["code"] == 400
        assert "truncated frame" in peer.msgs[0]["reason"] and "7 bytes" in peer.msgs[0]["reason"]
        assert peer.eof
        peer.close()
        await fd.stop()
    run(main())


# --- 3: the frame deadline is per frame -------------------------------------------------

def test_a_busy_pipeliner_always_holding_a_partial_frame_is_not_cut_off():
    async def main():
        fd, _, host, port = await setup(frame_deadline_s=0.3, sweep_s=0.05)
        peer = await Peer.open(host, port)
        frames = [pack({"op": "health", "id": i}) for i in range(13)]
        peer.writer.write(frames[0][:3])
        for i in range(1, 13):        # ~1.2 s; each frame completes within ~0.1 s
            await asyncio.sleep(0.1)
            peer.writer.write(frames[i - 1][3:] + frames[i][:3])
        peer.writer.write(frames[12][3:])
        await peer.read_until(answered(*range(13)))
        assert all(m["type"] == "result" for m in peer.msgs), peer.msgs[-1]
        assert not peer.eof
        peer.close()
        await fd.stop()
    run(main())


# --- 4: an oversized message is answered 413, not reset ---------------------------------

def test_a_message_over_max_message_bytes_gets_its_413_not_a_reset():
    async def main():
        fd, _, host, port = await setup()
        big = pack({"op": "health", "id": 1, **{k: "a" * (256 * 1024) for k in "abcd"}})
        assert len(big) > 1 << 20

        def client():
            s = socket.create_connection((host, port), timeout=5)
            try:
                s.sendall(big)       # the server refuses early and drains the rest
                data = b""
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        return data, "eof"
                    data += chunk
            except ConnectionResetError:
                return data, "reset"
            finally:
                s.close()
        data, end = await asyncio.to_thread(client)
        assert end == "eof"
        answer = Decoder().feed(data)
        assert answer[0]["code"] == 413 and "max_message_bytes" in answer[0]["reason"]
        await fd.stop()
    run(main())


# --- 5: shutdown answers every request before closing -----------------------------------

def test_stop_answers_queued_requests_503_at_once_and_running_ones_503_after_grace():
    async def main():
        fd, stubs, host, port = await setup(stub={"max_seqs": 1, "hold": True},
                                            capacity=FakeCapacity(fail=True, delay_s=30))
        peer = await Peer.open(host, port)
        peer.writer.write(pack(gen("running")) + pack(gen("queued")))
        await asyncio.sleep(0.1)
        assert len(fd.queues["m"]) == 1 and len(stubs[0].received) == 1
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        stopping = asyncio.create_task(fd.stop(grace_s=1.0))
        await peer.read_until(answered("queued"))
        assert loop.time() - t0 < 0.9                          # before the grace ends
        queued = peer.final()["queued"]
        assert queued["code"] == 503 and "shutting down" in queued["reason"]
        await peer.read_to_eof()
        running = peer.final()["running"]
        assert running["code"] == 503 and "grace_s(1.0)" in running["reason"]
        assert peer.eof
        await stopping
        peer.close()
    run(main())


def test_a_request_arriving_during_the_grace_is_refused_503():
    async def main():
        fd, stubs, host, port = await setup(stub={"hold": True})
        peer = await Peer.open(host, port)
        peer.writer.write(pack(gen("running")))
        await asyncio.sleep(0.1)
        stopping = asyncio.create_task(fd.stop(grace_s=0.5))
        await asyncio.sleep(0.05)
        peer.writer.write(pack(gen("late")))
        await peer.read_until(answered("late"))
        assert peer.final()["late"]["code"] == 503
        assert "shutting down" in peer.final()["late"]["reason"]
        await until(lambda: stubs[0]._held)
        stubs[0].release()                                     # finishes within the grace
        await peer.read_to_eof()
        assert peer.final()["running"]["type"] == "done" and peer.eof
        await stopping
        peer.close()
    run(main())


def test_stop_drains_for_the_configured_grace_and_says_when_to_retry():
    async def main():
        fd, stubs, host, port = await setup(stub={"hold": True}, drain_grace_s=0.3)
        peer = await Peer.open(host, port)
        peer.writer.write(pack(gen("running")))
        await until(lambda: stubs[0].received)
        stopping = asyncio.create_task(fd.stop())        # no grace given: the config's
        await asyncio.sleep(0.05)
        late = await Peer.open(host, port)               # still accepting while draining
        late.writer.write(pack(gen("late")))
        await late.read_until(answered("late"))
        refused = late.final()["late"]
        assert refused["code"] == 503 and "draining" in refused["reason"]
        assert 1 <= refused["retry_after_ms"] <= 1000
        await peer.read_to_eof()
        assert "grace_s(0.3)" in peer.final()["running"]["reason"]
        await stopping
        peer.close()
        late.close()
    run(main())


def test_the_drain_grace_defaults_to_30_s_and_refuses_nonsense():
    assert FrontDoorConfig().drain_grace_s == 30.0
    with pytest.raises(ConfigError, match="drain_grace_s"):
        FrontDoorConfig(drain_grace_s=0)


# --- 6: configuration is checked --------------------------------------------------------

@pytest.mark.parametrize("kw, name, value, limit", [
    ({"max_queue_depth": -1}, "max_queue_depth", -1, 1),
    ({"max_connections": 0}, "max_connections", 0, 1),
    ({"models": {"m": -5.0}}, "models['m']", -5.0, 600_000),
    ({"models": {"m": 700_000}}, "models['m']", 700_000, 600_000),
    ({"max_wait_s": 0}, "max_wait_s", 0, 0),
    ({"default_deadline_ms": float("nan")}, "default_deadline_ms", None, 0),
    ({"frame_deadline_s": -1}, "frame_deadline_s", -1, 0),
    ({"restores_per_model": 0}, "restores_per_model", 0, 1),
    ({"port": 70000}, "port", 70000, (0, 65535)),
    ({"at_capacity_backoff_s": -0.1}, "at_capacity_backoff_s", -0.1, 0),
])
def test_front_door_config_refuses_nonsense_naming_knob_value_and_limit(kw, name, value, limit):
    with pytest.raises(ConfigError) as err:
        FrontDoorConfig(**kw)
    assert err.value.name == name and err.value.limit == limit
    if value is not None:
        assert err.value.value == value
    assert name in err.value.message


def test_front_door_config_defaults_are_accepted():
    assert FrontDoorConfig(models={"m": 5000.0}).max_queue_depth == 1024


def test_good_messages_in_the_same_read_as_a_framing_error_are_still_answered():
    async def main():
        fd, stubs, host, port = await setup()
        msgs, closed = await raw(host, port, pack({"op": "generate", "id": "a", "model": "m",
                                                   "tokens": [1], "max_tokens": 1}) + b"\xc1")
        kinds = {(m.get("id"), m["type"]) for m in msgs}
        assert ("a", "done") in kinds and closed
        assert any(m["type"] == "error" and m["code"] == 400 for m in msgs)
        await fd.stop()
    run(main())
