"""The asyncio front door end to end against stub replicas (real sockets, loopback)."""

import asyncio
import json
import socket
import struct
import sys
import pathlib

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from stub_replica import StubReplica  # noqa: E402

from agent.client import AsyncClient  # noqa: E402
from agent.cluster.local import LocalRegistry  # noqa: E402
from agent.errors import ModelNotFound, NoCapacity, Overloaded, Unauthorized  # noqa: E402
from agent.frontdoor.auth import TokenAuth  # noqa: E402
from agent.frontdoor.capacity import RestoreResult  # noqa: E402
from agent.frontdoor.server import FrontDoor, FrontDoorConfig  # noqa: E402
from agent.protocol import Decoder, pack  # noqa: E402
from agent.telemetry import Telemetry  # noqa: E402


class FakeCapacity:
    """Restores by starting a stub replica after ``delay_s``; or fails every time."""

    def __init__(self, fail=False, delay_s=0.05):
        self.fail, self.delay_s = fail, delay_s
        self.calls, self.concurrent, self.peak = 0, 0, 0

    async def request_restore(self, model):
        self.calls += 1
        self.concurrent += 1
        self.peak = max(self.peak, self.concurrent)
        try:
            await asyncio.sleep(self.delay_s)
            if self.fail:
                raise NoCapacity(f"no node for {model}", model=model)
            stub = await StubReplica(model, f"restored-{self.calls}").start()
            from agent.frontdoor.router import ReplicaLoad
            return RestoreResult(ReplicaLoad.from_instance(stub.instance()),
                                 "snapshot_restore", 42.0)
        finally:
            self.concurrent -= 1


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def setup(replicas=1, capacity=None, auth=None, events=None, **cfg):
    registry = LocalRegistry()
    stubs = []
    for i in range(replicas):
        stub = await StubReplica("m", f"r{i}", **cfg.pop("stub", {})).start()
        registry.register(stub.instance(), 60)
        stubs.append(stub)
    # the deadline at the SLO, the SLO without prefill: the contract these tests work out
    # their times by (the default one is tested in test_slo_deadline.py)
    cfg.setdefault("deadline_factor", 1.0)
    cfg.setdefault("slo_counts_prefill", False)
    config = FrontDoorConfig(models={"m": 5000.0}, **cfg)
    fd = FrontDoor(config, registry=registry, capacity=capacity, auth=auth,
                   telemetry=Telemetry(events))
    host, port = await fd.start()
    return fd, stubs, host, port


async def raw(host, port, data, read=True):
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    await writer.drain()
    msgs, closed = [], False
    if read:
        dec = Decoder()
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), 5)
            if not chunk:
                closed = True
                break
            msgs.extend(dec.feed(chunk))
    writer.close()
    return msgs, closed


def test_warm_hit_streams_tokens_then_done_and_writes_an_event(tmp_path):
    async def main():
        fd, stubs, host, port = await setup(events=tmp_path / "ev.jsonl")
        c = await AsyncClient.connect(host, port)
        g = await c.generate("m", tokens=[5, 6], max_tokens=3)
        assert g.tokens == [2, 3, 4]
        assert g.done["path"] == "warm_hit" and g.done["replica"] == "r0"
        assert g.done["ttft_ms"] >= 0 and g.done["total_ms"] >= g.done["ttft_ms"]
        assert stubs[0].received[0]["tokens"] == [5, 6]
        assert (await c.info("models"))["m"] == {"warm": 1, "queued": 0}
        assert (await c.info("health"))["status"] == "ok"
        await c.close()
        await fd.stop()
    run(main())
    event = json.loads((tmp_path / "ev.jsonl").read_text().splitlines()[0])
    assert event["path"] == "warm_hit" and event["code"] == 200 and event["model"] == "m"
    assert event["sla_breached"] is False and event["queue_wait_ms"] == 0.0


def test_pipelined_requests_on_one_connection_all_answer():
    async def main():
        fd, stubs, host, port = await setup(replicas=2)
        data = b"".join(pack({"op": "generate", "id": i, "model": "m", "tokens": [1],
                              "max_tokens": 1}) for i in range(200))
        msgs, _ = await asyncio.wait_for(raw_until(host, port, data, 400), 10)
        done = sorted(m["id"] for m in msgs if m["type"] == "done")
        assert done == list(range(200))
        assert {m["replica"] for m in msgs if m["type"] == "done"} <= {"r0", "r1"}
        await fd.stop()
    run(main())


async def raw_until(host, port, data, n):
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    dec, msgs = Decoder(), []
    while len(msgs) < n:
        chunk = await reader.read(65536)
        if not chunk:                    # closed before n answers
            writer.close()
            return msgs, True
        msgs.extend(dec.feed(chunk))
    writer.close()
    return msgs, False


def test_error_codes_404_401():
    async def main():
        fd, _, host, port = await setup(auth=TokenAuth({"acme": "s" * 20}))
        c = await AsyncClient.connect(host, port, token="s" * 20)
        with pytest.raises(ModelNotFound) as err:
            await c.generate("nope", tokens=[1], max_tokens=1)
        assert err.value.code == 404
        assert (await c.generate("m", tokens=[1], max_tokens=1)).tokens == [1]
        bad = await AsyncClient.connect(host, port, token="t" * 20)
        with pytest.raises(Unauthorized):
            await bad.generate("m", tokens=[1], max_tokens=1)
        await c.close(), await bad.close()
        await fd.stop()
    run(main())


def test_queue_full_429_then_a_prediction_gone_bad_429_before_the_deadline():
    async def main():
        # The only replica has one sequence slot, held by a request it never answers: the
        # front door's estimate of when that slot frees turns out wrong.
        fd, stubs, host, port = await setup(stub={"max_seqs": 1, "hold": True},
                                            max_queue_depth=2, capacity=FakeCapacity(fail=True, delay_s=5))
        fd.path.restore_times.record("m", 5000.0)   # restores measured: too slow to help here
        c = await AsyncClient.connect(host, port, max_retries=0)
        first = asyncio.create_task(c.generate("m", tokens=[1], max_tokens=1))
        await asyncio.sleep(0.05)
        queued = [asyncio.create_task(c.generate("m", tokens=[1], max_tokens=1,
                                                 deadline_ms=d)) for d in (400, 600)]
        await asyncio.sleep(0.02)
        with pytest.raises(Overloaded) as err:   # the queue is full
            await c.generate("m", tokens=[1], max_tokens=1)
        assert err.value.retry_after_ms > 0
        for task in queued:
            with pytest.raises(Overloaded, match="capacity now in sight cannot start it"):
                await task
        assert fd.path.counts["expired_504"] == 0   # refused when known, not at the deadline
        assert len(stubs[0].received) == 1     # the refused ones never reached the replica
        stubs[0].release()
        assert (await first).tokens == [1]
        await c.close()
        await fd.stop()
    run(main())


def test_restore_serves_queued_requests_earliest_deadline_first_within_the_cap():
    async def main():
        cap = FakeCapacity(delay_s=0.1)
        # default_max_seqs: the restored stubs' 64 slots, known before the first one is seen
        fd, _, host, port = await setup(replicas=0, capacity=cap, restores_per_model=2,
                                        default_max_seqs=64)
        c = await AsyncClient.connect(host, port)
        order = []

        async def one(d):
            g = await c.generate("m", tokens=[1], max_tokens=1, deadline_ms=d)
            order.append(d)
            return g
        gens = await asyncio.gather(*(one(d) for d in (3000, 1000, 2000) * 10))
        assert all(g.done["path"] == "snapshot_restore" for g in gens)
        assert all(g.done["queue_wait_ms"] > 0 for g in gens)
        assert cap.peak <= 2 and cap.calls <= 2
        await c.close()
        await fd.stop()
    run(main())


def test_restores_failing_everywhere_answer_503_promptly():
    async def main():
        fd, _, host, port = await setup(replicas=0, capacity=FakeCapacity(fail=True, delay_s=0.02))
        c = await AsyncClient.connect(host, port)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        results = await asyncio.gather(*(c.generate("m", tokens=[1], max_tokens=1)
                                         for _ in range(5)), return_exceptions=True)
        assert all(isinstance(r, NoCapacity) for r in results)
        assert loop.time() - t0 < 1.0          # not held to the 5 s deadline
        await c.close()
        await fd.stop()
    run(main())


def vm_rss_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024


HOSTILE = {  # framing errors: the byte stream cannot be trusted past them
    "array_4g": b"\xdd\xff\xff\xff\xff",
    "bin_4g_in_map": b"\x82\xa1v\x01\xa1b\xc6\xff\xff\xff\xff",
    "nested_10000": b"\x81\xa1a" + b"\x91" * 10_000 + b"\x01",
    "bad_utf8": b"\x81\xa1v\xa2\xff\xfe",
    "non_map": pack({"x": 1})[:0] + b"\x93\x01\x02\x03",
}

BAD_REQUESTS = {  # well-framed messages that are wrong: answered alone, connection kept
    "unknown_op": ({"op": "launch", "id": 1}, "op"),
    "wrong_type": ({"op": "generate", "id": 1, "model": "m", "tokens": [1],
                    "max_tokens": "many"}, "max_tokens"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_input_gets_an_error_and_close_while_others_are_served(case):
    async def main():
        fd, _, host, port = await setup()
        good = await AsyncClient.connect(host, port)
        before = vm_rss_bytes()
        msgs, closed = await raw(host, port, HOSTILE[case])
        assert closed and msgs and msgs[-1]["type"] == "error"
        assert msgs[-1]["code"] in (400, 413)
        assert vm_rss_bytes() - before < 16 << 20
        assert (await good.generate("m", tokens=[1], max_tokens=2)).tokens == [1, 2]
        await good.close()
        await fd.stop()
    run(main())


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_a_bad_request_is_answered_400_and_the_connection_stays_open(case):
    async def main():
        fd, _, host, port = await setup()
        bad, field = BAD_REQUESTS[case]
        health = {"op": "health", "id": 2}
        msgs, _ = await asyncio.wait_for(raw_until(host, port, pack(bad) + pack(health), 2), 5)
        assert msgs[0]["type"] == "error" and msgs[0]["id"] == 1 and msgs[0]["code"] == 400
        assert field in msgs[0]["reason"]
        assert msgs[1]["type"] == "result" and msgs[1]["id"] == 2
        await fd.stop()
    run(main())


def test_slow_frame_is_cut_off_and_idle_connection_closed():
    async def main():
        fd, _, host, port = await setup(frame_deadline_s=0.3, idle_timeout_s=0.45, sweep_s=0.05)
        frame = pack({"op": "health", "id": 1})
        reader, writer = await asyncio.open_connection(host, port)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for b in frame[:-1]:             # one byte every 0.1 s: fresh bytes, never complete
            if loop.time() - t0 > 0.25:  # stop before the cut so no RST loses the answer
                break
            writer.write(bytes([b]))
            await asyncio.sleep(0.1)
        data = await asyncio.wait_for(reader.read(), 3)
        answer = Decoder().feed(data)[0]
        assert answer["code"] == 400 and "frame_deadline_s" in answer["reason"]
        assert loop.time() - t0 < 2.0
        idle_r, idle_w = await asyncio.open_connection(host, port)
        assert await asyncio.wait_for(idle_r.read(), 3) == b""   # closed, nothing said
        writer.close(), idle_w.close()
        await fd.stop()
    run(main())


def test_connection_cap():
    async def main():
        fd, _, host, port = await setup(max_connections=2)
        a = await AsyncClient.connect(host, port)
        b = await AsyncClient.connect(host, port)
        await a.info("health"), await b.info("health")
        msgs, closed = await raw(host, port, b"")
        assert closed and msgs[0]["code"] == 429
        await a.close(), await b.close()
        await fd.stop()
    run(main())


def test_front_door_registers_itself_and_discovery_finds_it():
    from agent.client import discover

    async def main():
        fd, _, host, port = await setup(announce=True)
        assert discover(registry=fd.registry) == [(host, port)]
        await fd.stop()
        assert discover(registry=fd.registry) == []
    run(main())


def test_loopback_only_without_tokens():
    from agent.errors import ConfigError
    from agent.frontdoor.auth import check_bind
    check_bind("127.0.0.1", TokenAuth(), allow_open=False)
    with pytest.raises(ConfigError, match="0.0.0.0"):
        check_bind("0.0.0.0", TokenAuth(), allow_open=False)
    check_bind("0.0.0.0", TokenAuth({"t": "x" * 16}), allow_open=False)
    with pytest.raises(ConfigError):
        TokenAuth({"t": "short"})


def test_a_request_cut_at_every_byte_boundary_or_coalesced_gets_the_same_answer():
    async def main():
        fd, _, host, port = await setup()
        frame = pack({"op": "generate", "id": 3, "model": "m", "tokens": [7, 8],
                      "max_tokens": 2})
        answers = []
        for cut in range(1, len(frame)):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(frame[:cut])
            await writer.drain()
            await asyncio.sleep(0.002)           # a separate TCP read on the server
            writer.write(frame[cut:])
            dec, got = Decoder(), []
            while len(got) < 2:
                got.extend(dec.feed(await reader.read(4096)))
            answers.append([(m["type"], m.get("tokens")) for m in got])
            writer.close()
        assert answers == [[("tokens", [2, 3]), ("done", None)]] * (len(frame) - 1)
        msgs, _ = await raw_until(host, port, frame * 5, 10)
        assert [m.get("tokens") for m in msgs if m["type"] == "tokens"] == [[2, 3]] * 5
        await fd.stop()
    run(main())


def test_replica_errors_are_forwarded_and_a_crash_before_any_token_is_a_429_not_a_loss():
    from agent.errors import MessageTooLarge, Overloaded

    async def main():
        fd, stubs, host, port = await setup(stub={"fail_with": 413})
        c = await AsyncClient.connect(host, port, max_retries=0)
        with pytest.raises(MessageTooLarge):
            await c.generate("m", tokens=[1], max_tokens=1)
        assert fd.router.get("r0").active_seqs == 0   # completion counted
        stubs[0].fail_with, stubs[0].crash = None, True
        with pytest.raises(Overloaded, match="not started at replica r0 .connection to "
                           "replica lost") as err:  # nothing streamed, no other replica
            await c.generate("m", tokens=[1], max_tokens=1)
        assert err.value.code == 429 and err.value.retry_after_ms > 0
        assert fd.router.get("r0") is None             # out of the view until listed again
        assert fd.path.counts["rerouted"] == 1
        await c.close()
        await fd.stop()
    run(main())


def test_a_replica_leaving_the_registry_is_hung_up_on():
    async def main():
        fd, stubs, host, port = await setup(registry_poll_s=0.02)
        c = await AsyncClient.connect(host, port)
        await c.generate("m", tokens=[1], max_tokens=1)
        link = fd.links["r0"]
        fd.registry.deregister("r0")
        for _ in range(200):
            if "r0" not in fd.links:
                break
            await asyncio.sleep(0.01)
        assert "r0" not in fd.links and link.closed and fd.router.get("r0") is None
        with pytest.raises(NoCapacity):
            await c.generate("m", tokens=[1], max_tokens=1)
        await c.close()
        await fd.stop()
    run(main())


def test_a_request_no_replica_could_ever_hold_is_413_at_once():
    from agent.errors import MessageTooLarge

    async def main():
        fd, _, host, port = await setup(stub={"kv_capacity_tokens": 100})
        c = await AsyncClient.connect(host, port)
        assert (await c.generate("m", tokens=[1] * 90, max_tokens=10)).tokens[0] == 90
        with pytest.raises(MessageTooLarge, match="holds 100"):
            await c.generate("m", tokens=[1] * 90, max_tokens=11)
        await c.close()
        await fd.stop()
    run(main())


def test_a_client_leaving_takes_its_queued_requests_out_of_the_queue():
    async def main():
        fd, stubs, host, port = await setup(stub={"max_seqs": 1, "hold": True},
                                            max_queue_depth=1,
                                            capacity=FakeCapacity(fail=True, delay_s=5))
        c = await AsyncClient.connect(host, port)
        first = asyncio.create_task(c.generate("m", tokens=[1], max_tokens=1))
        leaving = await AsyncClient.connect(host, port)
        queued = asyncio.create_task(leaving.generate("m", tokens=[1], max_tokens=1))
        await asyncio.sleep(0.1)
        assert len(fd.queues["m"]) == 1
        # Gone for good (reset).  A plain FIN reads as a half-close, whose requests are
        # still answered (test_connection_faults.py); the server cannot tell the two apart.
        leaving._writer.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        leaving._writer.transport.abort()
        await leaving.close()
        await asyncio.sleep(0.1)
        assert len(fd.queues["m"]) == 0
        later = asyncio.create_task(c.generate("m", tokens=[2, 2], max_tokens=1))
        await asyncio.sleep(0.05)
        assert len(fd.queues["m"]) == 1         # took the place, not refused with 429
        stubs[0].hold = False
        stubs[0].release()
        assert (await first).tokens == [1] and (await later).tokens == [2]
        queued.cancel()
        await c.close()
        await fd.stop()
    run(main())


def test_measured_restore_p99_sets_default_deadlines_and_refuses_hopeless_waits():
    class SlowRestores(FakeCapacity):
        async def request_restore(self, model):
            result = await super().request_restore(model)
            result.restore_ms = 20_000.0   # as the node agent reports it
            return result

    async def main():
        fd, _, host, port = await setup(replicas=0, capacity=SlowRestores(delay_s=0.01),
                                        max_wait_s=10.0, default_deadline_ms=5000.0)
        fd.known_models.add("n")           # seen in the registry, not configured
        c = await AsyncClient.connect(host, port, max_retries=0)
        g = await c.generate("n", tokens=[1], max_tokens=1)
        assert g.done["path"] == "snapshot_restore"
        assert fd.path.models.of("n").deadline_ms == 30_000.0       # 1.5 x p99, above the 5 s default
        assert fd.path.models.of("m").deadline_ms == 5000.0         # configured models keep theirs
        for rid in list(fd.router._replicas):         # the restored replicas go away
            fd.router.remove(rid)
        with pytest.raises(Overloaded, match="cannot start within 4000 ms") as err:
            await c.generate("n", tokens=[1], max_tokens=1)
        assert err.value.retry_after_ms == 20_000     # restore p99 20 s > the 4 s restore SLO
        await c.close()
        await fd.stop()
    run(main())


class AtCapCapacity:
    """A node at its replica cap: every restore answers with the replica it already has."""

    def __init__(self, stub):
        self.stub, self.calls = stub, 0

    async def request_restore(self, model):
        from agent.frontdoor.router import ReplicaLoad
        self.calls += 1
        return RestoreResult(ReplicaLoad.from_instance(self.stub.instance()), "warm_hit", 1.0)


def test_a_node_at_its_cap_is_asked_again_after_a_backoff_not_in_a_loop():
    async def main():
        # One replica with one slot held by a request it does not answer yet: the rest queue.
        fd, stubs, host, port = await setup(stub={"max_seqs": 1, "hold": True},
                                            at_capacity_backoff_s=0.2)
        cap = AtCapCapacity(stubs[0])
        fd.capacity = cap
        c = await AsyncClient.connect(host, port)
        first = asyncio.create_task(c.generate("m", tokens=[1], max_tokens=1))
        await asyncio.sleep(0.05)
        queued = [asyncio.create_task(c.generate("m", tokens=[1], max_tokens=1))
                  for _ in range(3)]
        await asyncio.sleep(1.0)
        # ~1 s / 0.2 s backoff: a handful of asks, not thousands.
        assert 1 <= cap.calls <= 8, cap.calls
        assert len(stubs[0].received) == 1      # the re-reported replica's slot stays taken
        stubs[0].hold = False
        stubs[0].release()
        assert [(await t).tokens for t in [first, *queued]] == [[1]] * 4
        await c.close()
        await fd.stop()
    run(main())


class RegistryFirstCapacity:
    """A node agent that registers the new replica, then answers the restore late: the
    registry shows the replica (and the queue is dispatched to it) before the answer.  The
    replica holds its answers until the test releases them."""

    def __init__(self, registry, answer_after_s):
        self.registry, self.answer_after_s = registry, answer_after_s
        self.stub = None

    async def request_restore(self, model):
        from agent.frontdoor.router import ReplicaLoad
        self.stub = await StubReplica(model, "booted-1", hold=True).start()
        self.registry.register(self.stub.instance(), 60)
        await asyncio.sleep(self.answer_after_s)
        return RestoreResult(ReplicaLoad.from_instance(self.stub.instance()), "cold_boot", 900.0)


def test_a_request_dispatched_before_the_restore_answer_still_counts_as_that_restore():
    async def main():
        fd, _, host, port = await setup(replicas=0, registry_poll_s=0.02)
        cap = fd.capacity = RegistryFirstCapacity(fd.registry, answer_after_s=0.3)
        c = await AsyncClient.connect(host, port)
        first = asyncio.create_task(c.generate("m", tokens=[1], max_tokens=1))
        await asyncio.sleep(0.2)
        assert len(cap.stub.received) == 1                 # dispatched through the registry
        await asyncio.sleep(0.3)                           # the restore's answer is in
        cap.stub.hold = False
        cap.stub.release()
        first = await first
        assert first.done["path"] == "cold_boot"           # it waited for the cold boot
        later = await c.generate("m", tokens=[1], max_tokens=1)
        assert later.done["path"] == "warm_hit"            # arrived once the replica was up
        assert later.done["replica"] == first.done["replica"] == "booted-1"
        await c.close()
        await fd.stop()
    run(main())


def test_answered_msgpack_requests_leave_no_cycle_for_the_collector():
    """As on the HTTP door: each request's sink and flight are freed by reference counting
    once answered (no garbage for the collector, whose pauses are a door's latency tail)."""
    import gc

    from agent.frontdoor.msgpack_entrance import MsgpackSink
    from agent.frontdoor.request import Flight

    async def main():
        fd, stubs, host, port = await setup(replicas=1)
        await raw_until(host, port, pack({"op": "generate", "id": 0, "model": "m",
                                          "tokens": [1], "max_tokens": 1}), 2)  # warm up
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            data = b"".join(pack({"op": "generate", "id": i, "model": "m", "tokens": [1],
                                  "max_tokens": 2}) for i in range(20))
            msgs, _ = await asyncio.wait_for(raw_until(host, port, data, 40), 10)
            gc.collect()
            left = [o for o in gc.garbage if isinstance(o, (MsgpackSink, Flight))]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        await fd.stop()
        return msgs, left

    msgs, left = run(main())
    assert sum(m["type"] == "done" for m in msgs) == 20
    assert left == []


def test_a_tick_that_raises_does_not_end_the_front_doors_loops(caplog):
    """The ticker (expiry, re-checks, first-token bounds) and the sweeper keep running after
    one pass raised (a bug, or a figure the arithmetic cannot take): the exception is logged
    (rate-limited) and the next pass runs.  An exception used to end the task for good, silently: queued
    requests were then never expired or re-checked again."""
    async def main():
        fd, stubs, host, port = await setup()
        calls = {"expire": 0, "sweep": 0}

        def expire():
            calls["expire"] += 1
            if calls["expire"] == 1:
                raise OverflowError("cannot convert float infinity to integer")

        def sweep():
            calls["sweep"] += 1
            if calls["sweep"] == 1:
                raise RuntimeError("sweep failed")

        fd.path.expire_queued = expire
        fd.msgpack.sweep = sweep
        fd.path.queued_models.add("m")
        try:
            for _ in range(200):
                await asyncio.sleep(0.01)
                if calls["expire"] >= 3 and calls["sweep"] >= 3:
                    break
            assert calls["expire"] >= 3 and calls["sweep"] >= 3
            assert all(not t.done() for t in fd._tasks)
        finally:
            fd.path.queued_models.discard("m")
            await fd.stop(grace_s=0)
            for s in stubs:
                await s.stop()
    with caplog.at_level("WARNING"):
        run(main())
    assert "OverflowError" in caplog.text and "sweep failed" in caplog.text
