"""A replica that accepts a request and then says nothing (SIGSTOP, an engine that never
returns) is noticed within the silence bound derived from what admission predicted
(agent/frontdoor/first_token.py): the request is placed again once, or answered, and the
replica leaves routing until it answers a probe.  Virtual time; nothing sleeps."""

from __future__ import annotations

import asyncio
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from virtual_fleet import FAST, SLOW, Fleet, SimReplica  # noqa: E402

from agent.cluster.base import ServiceInstance  # noqa: E402
from agent.frontdoor.router import ReplicaLoad  # noqa: E402
from agent.wire import refusals  # noqa: E402


def run(coro):
    return asyncio.run(coro)


class Stopped(SimReplica):
    """Takes the frame and never answers (a SIGSTOPped worker: its socket stays open); counts
    the cancels and probes the front door sends it."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.cancels: list[int] = []
        self.probes = 0

    def dispatch(self, flight, message: dict) -> int:
        rid = next(self._ids)
        message["id"] = rid
        self.received.append(message)
        self.in_flight[rid] = flight
        return rid

    def cancel(self, rid: int) -> None:
        self.cancels.append(rid)
        self.in_flight.pop(rid, None)

    def probe(self) -> None:
        self.probes += 1


def stopped_fleet(warm_after: int = 1) -> tuple[Fleet, Stopped]:
    """A fleet whose first replica (the router's first choice: equal predictions go to the
    smaller id) is stopped, and ``warm_after`` healthy ones."""
    f = Fleet(warm=0)
    r0 = Stopped(f.path, f.timeline, "r0", "m", FAST, f.max_seqs)
    f.replicas.append(r0)
    f.path.upsert(r0.load)
    for i in range(1, warm_after + 1):
        f.path.upsert(f.add(f"r{i}").load)
    return f, r0


def instance(load: ReplicaLoad) -> ServiceInstance:
    return ServiceInstance("rewarm-replica", load.replica_id, "127.0.0.1", 1,
                           tags=["model=m"], meta={
                               "address": load.address, "max_seqs": str(load.max_seqs),
                               "active_seqs": "0", "kv_capacity_tokens": str(load.kv_capacity_tokens),
                               "kv_used_tokens": "0", **load.speed.to_meta()})


def test_a_request_at_a_stopped_replica_is_placed_again_within_the_bound_and_served():
    async def main():
        f, r0 = stopped_fleet()
        t0 = f.clock.now()
        sink = f.submit(deadline_ms=20_000)
        assert len(r0.received) == 1                      # it went to the stopped replica
        floor_s = f.path.config.slo_s("m")[0]
        await f.timeline.run_until(t0 + floor_s + 1.0)
        assert sink.code == 200 and sink.final["replica"] == "r1"
        # moved at the bound (the warm SLO floor here: the prediction is a few ms), served
        # at once after it, long before the client's 20 s deadline
        assert t0 + floor_s <= sink.first_s <= t0 + floor_s + 0.1
        assert r0.cancels == [1]                          # its slot there freed
        assert f.path.counts["silent_replica"] == 1 and f.path.counts["rerouted"] == 1
        assert f.path.router.get("r0") is None            # out of routing
        assert [r.replica_id for r in f.path.router.warm("m")] == ["r1"]
    run(main())


def test_a_silent_replica_stays_out_of_the_registry_view_until_it_answers_a_probe():
    async def main():
        f, r0 = stopped_fleet()
        r1 = f.replicas[1]
        t0 = f.clock.now()
        f.submit()
        await f.timeline.run_until(t0 + 3.0)
        assert r0.probes >= 1                             # probed on its link
        f.path.apply_replicas([instance(r0.load), instance(r1.load)])
        assert f.path.router.get("r0") is None            # the registry still lists it: kept out
        probes = r0.probes
        await f.timeline.run_until(t0 + 3.0 + f.path.config.registry_poll_s + 0.01)
        assert r0.probes > probes                          # probed again while silent
        stuck = {"type": "result", "result": {"ok": True, "state": "serving",
                                              "engine_busy_s": 60.0}}
        f.path.replica_answered(r0, stuck)                 # its loop answers, its engine not
        assert f.path.router.get("r0") is None
        f.path.replica_answered(r0, {"type": "result",    # SIGCONT: it answers the probe
                                     "result": {"ok": True, "state": "serving"}})
        assert f.path.router.get("r0") is not None         # back in routing at once (a
        f.path.apply_replicas([instance(r0.load), instance(r1.load)])   # blocking query may
        assert f.path.router.get("r0") is not None         # not change), and the view keeps it
    run(main())


def test_a_stopped_only_replica_answers_503_replica_failed_at_the_bound_not_at_the_timeout():
    async def main():
        f, r0 = stopped_fleet(warm_after=0)
        t0 = f.clock.now()
        sink = f.submit(deadline_ms=20_000)
        floor_s = f.path.config.slo_s("m")[0]
        # silent at the bound: out of routing, but with nowhere else to go the request waits
        # one bound more (a replica only slow would answer its probe meanwhile)
        await f.timeline.run_until(t0 + floor_s + 0.1)
        assert sink.final is None and f.path.router.get("r0") is None
        await f.timeline.run_until(t0 + 2 * floor_s + 0.1)
        assert sink.code == 503 and sink.final["refusal"] == refusals.REPLICA_FAILED
        assert sink.at_s <= t0 + 2 * floor_s + 0.01       # two bounds, well within the deadline
        assert sink.final["retry_after_ms"] >= 1
        assert r0.cancels == [1]
    run(main())


def test_a_slow_replica_that_answers_its_probe_serves_its_late_request_by_the_deadline():
    """Found silent, but alive (its loop answers the probe): the request it holds is not
    failed, it waits to its deadline; one past the deadline is answered 504 then."""
    async def main():
        f, r0 = stopped_fleet(warm_after=0)
        t0 = f.clock.now()
        slow = f.submit(deadline_ms=8_000)
        floor_s = f.path.config.slo_s("m")[0]
        await f.timeline.run_until(t0 + floor_s + 0.1)      # silent at the bound
        assert slow.final is None
        f.path.replica_answered(r0, {"type": "result", "result": {"ok": True,
                                                                   "state": "serving"}})
        f.timeline.at(t0 + 5.0, lambda: r0._answer(1, {"type": "tokens", "tokens": [1]}))
        f.timeline.at(t0 + 5.1, lambda: r0._answer(1, {"type": "done", "n_tokens": 1}))
        await f.timeline.run_until(t0 + 6.0)
        assert slow.code == 200 and slow.first_s == t0 + 5.0   # served where it was, late
        never = f.submit(deadline_ms=3_000)                 # r0 never answers this one
        t1 = f.clock.now()
        await f.timeline.run_until(t1 + 3.0 + floor_s + 0.1)
        assert never.code == 504 and never.final["refusal"] == refusals.DEADLINE
        assert never.at_s <= t1 + 3.0 + floor_s + 0.01      # by one bound past its deadline
    run(main())


def test_a_request_moved_once_is_not_moved_again():
    async def main():
        f = Fleet(warm=0)
        stopped = [Stopped(f.path, f.timeline, f"r{i}", "m", FAST, f.max_seqs) for i in range(3)]
        for r in stopped:
            f.path.upsert(r.load)
        t0 = f.clock.now()
        sink = f.submit(deadline_ms=30_000)
        await f.timeline.run_until(t0 + 10.0)
        # first replica silent: moved to the second; the second silent too: answered
        assert [len(r.received) for r in stopped] == [1, 1, 0]
        assert sink.code == 503 and f.path.counts["silent_replica"] == 2
    run(main())


def test_a_slow_replica_serving_at_its_prediction_is_never_called_silent():
    async def main():
        # a long prompt at a slow replica: predicted (and taking) several seconds, past the
        # floor; the bound scales with the prediction, so it is served where it is
        f = Fleet(speed=SLOW, warm=1)
        t0 = f.clock.now()
        sink = f.submit(prompt_tokens=2000, max_tokens=4, deadline_ms=60_000)
        await f.timeline.run_until(t0 + 30.0)
        assert sink.code == 200 and sink.final["replica"] == "r0"
        assert sink.first_s - t0 > f.path.config.slo_s("m")[0]   # past the floor, not cut off
        assert f.path.counts["silent_replica"] == 0
    run(main())


def test_a_stopped_replicas_streaming_request_is_answered_and_its_waiting_one_moved():
    async def main():
        f, r0 = stopped_fleet(warm_after=0)
        t0 = f.clock.now()
        streaming = f.submit(max_tokens=100)
        assert len(r0.received) == 1
        r0._answer(1, {"type": "tokens", "tokens": [1]})   # one token, then SIGSTOP
        waiting = f.submit(deadline_ms=20_000)
        assert len(r0.received) == 2                      # both at the stopped replica
        f.path.upsert(f.add("r1").load)                   # another comes up
        await f.timeline.run_until(t0 + 3.0)
        # nothing more came on its link: silent.  The one streaming cannot be sent again
        # (the client has part of its answer): 503; the other is moved and served
        assert streaming.code == 503 and streaming.final["refusal"] == refusals.REPLICA_FAILED
        assert "mid-stream" in streaming.final["reason"]
        assert waiting.code == 200 and waiting.final["replica"] == "r1"
        assert sorted(r0.cancels) == [1, 2] and f.path.router.get("r0") is None
    run(main())


def test_a_stream_whose_replica_stops_mid_answer_is_answered_503_not_left_hanging():
    async def main():
        f, r0 = stopped_fleet(warm_after=0)
        t0 = f.clock.now()
        stream = f.submit(max_tokens=100)
        for k in range(1, 11):                            # tokens for 1 s, then SIGSTOP
            f.timeline.at(t0 + 0.1 * k, lambda: r0._answer(1, {"type": "tokens",
                                                              "tokens": [1]}))
        # its end was due at its first token + 100 decode steps at a full batch; silent
        # past twice that from its last message (plus 8 steps), and then at the next scan
        await f.timeline.run_until(t0 + 1.05)
        load = f.path.router.get("r0")
        step_s = FAST.decode_step_s(load.max_seqs, load.active_ctx_tokens) * load.slowdown
        end_s = stream.first_s + 100 * step_s
        bound_s = max(2.0, 2 * (end_s - (t0 + 1.0)) + 8 * step_s)
        await f.timeline.run_until(t0 + 1.0 + bound_s - 0.01)
        assert stream.final is None                       # within the bound: still waited on
        await f.timeline.run_until(t0 + 1.0 + bound_s + f.path.config.registry_poll_s + 0.01)
        assert stream.code == 503 and stream.final["refusal"] == refusals.REPLICA_FAILED
        assert "mid-stream" in stream.final["reason"] and r0.cancels == [1]
        assert f.path.router.get("r0") is None
    run(main())


def test_a_replica_streaming_other_requests_is_alive_and_its_late_one_is_not_cut_off():
    async def main():
        f, r0 = stopped_fleet(warm_after=0)
        t0 = f.clock.now()
        busy = f.submit(max_tokens=1000)                  # r0 streams this one ...
        late = f.submit(deadline_ms=10_000)               # ... and starts this one late
        assert len(r0.received) == 2
        for k in range(1, 60):                            # a token every 0.1 s for 6 s
            f.timeline.at(t0 + 0.1 * k, lambda: r0._answer(1, {"type": "tokens",
                                                              "tokens": [1]}))
        f.timeline.at(t0 + 5.0, lambda: r0._answer(2, {"type": "tokens", "tokens": [1]}))
        f.timeline.at(t0 + 5.1, lambda: r0._answer(2, {"type": "done", "n_tokens": 2}))
        await f.timeline.run_until(t0 + 6.0)
        assert late.code == 200 and late.final["replica"] == "r0"   # served where it was
        assert late.first_s == t0 + 5.0 and busy.final is None
        assert f.path.counts["silent_replica"] == 0 and f.path.router.get("r0") is not None
    run(main())


def test_the_silence_bound_scales_with_the_prediction_and_the_measured_step():
    from agent.frontdoor.first_token import SILENT_FACTOR, SILENT_STEPS, silent_after_s

    load = ReplicaLoad("r", "m", "x", 8, 0, 1 << 16, 0, speed=SLOW)
    step_s = SLOW.decode_step_s(8, 0)
    assert silent_after_s(load, 0.01, 0.0, 2.0) == 2.0                 # the floor
    assert silent_after_s(load, 5.0, 0.0, 2.0) == SILENT_FACTOR * 5.0 + SILENT_STEPS * step_s
    load.slowdown = 3.0                                                 # measured slower
    assert silent_after_s(load, 5.0, 0.0, 2.0) == SILENT_FACTOR * 5.0 + SILENT_STEPS * step_s * 3


def test_a_replica_address_that_drops_syns_fails_the_link_within_the_requests_budget():
    from agent.clock import SystemClock
    from agent.frontdoor.config import FrontDoorConfig
    from agent.frontdoor.request_path import GenerateRequest, RequestPath
    from agent.telemetry import Telemetry
    from virtual_fleet import Sink

    attempts = []

    async def blackhole(link, address):      # a SYN nobody answers: the connect never ends
        attempts.append(address)
        await asyncio.get_running_loop().create_future()

    async def main():
        clock = SystemClock()
        path = RequestPath(FrontDoorConfig(models={"m": 60_000.0}), clock=clock,
                           telemetry=Telemetry(), connector=blackhole)
        path.upsert(ReplicaLoad("r0", "m", "10.255.255.1:9", 8, 0, 1 << 16, 0, speed=FAST))
        sink = Sink(clock, clock.now())
        path.submit(GenerateRequest(1, "m", [1] * 8, None, 4, deadline_ms=300), sink)
        for _ in range(200):                  # at most 2 s; the budget is 0.3 s
            if sink.final is not None:
                break
            await asyncio.sleep(0.01)
        assert attempts == ["10.255.255.1:9"]
        assert sink.final is not None and sink.final["type"] == "error"
        assert "cannot connect to replica 10.255.255.1:9 within 0.30 s" in sink.final["reason"]
        assert path.router.get("r0") is None  # the link failed: out of the view
    run(main())


STOPPABLE = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from stub_replica import StubReplica

async def main():
    stub = await StubReplica("m", "r0").start()
    print(stub.port, flush=True)
    await asyncio.get_running_loop().create_future()

asyncio.run(main())
"""


def test_a_sigstopped_replica_process_loses_its_request_to_another_within_the_bound():
    """A real replica process (a stub replica) stopped with SIGSTOP after it took the
    request: the front door's ticker moves the request to the other replica at the bound
    (the warm SLO floor, 0.5 s here), not at the client's timeout; after SIGCONT it answers
    the health probe on its link and is back in routing."""
    import os
    import signal
    import subprocess

    from agent.client import AsyncClient
    from agent.cluster.local import LocalRegistry
    from agent.frontdoor.server import FrontDoor, FrontDoorConfig
    from agent.telemetry import Telemetry
    from stub_replica import StubReplica

    here = str(pathlib.Path(__file__).parent)
    proc = subprocess.Popen([sys.executable, "-c", STOPPABLE, here], stdout=subprocess.PIPE,
                            text=True)

    async def main():
        port = int(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30))
        stopped = await StubReplica("m", "r0").start()   # its registry entry, at proc's port
        stopped.port = port
        other = await StubReplica("m", "r1", speed=SLOW).start()   # predicted slower: 2nd choice
        registry = LocalRegistry()
        registry.register(stopped.instance(), 60)
        registry.register(other.instance(), 60)
        # a client deadline of 3x the SLO: room to move the request once the bound is hit
        fd = FrontDoor(FrontDoorConfig(models={"m": 20_000.0}, warm_slo_ms=500.0,
                                       deadline_factor=3.0),
                       registry=registry, telemetry=Telemetry())
        host, fport = await fd.start()
        c = await AsyncClient.connect(host, fport)
        warm = await c.generate("m", tokens=[1], max_tokens=1)   # opens the link to r0
        assert warm.done["replica"] == "r0"
        os.kill(proc.pid, signal.SIGSTOP)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        moved = await asyncio.wait_for(c.generate("m", tokens=[1], max_tokens=1), 5)
        assert moved.done["replica"] == "r1"
        assert 0.5 <= loop.time() - t0 < 3.0              # at the bound, not at a timeout
        assert fd.path.counts["silent_replica"] == 1 and fd.router.get("r0") is None
        os.kill(proc.pid, signal.SIGCONT)                  # it answers the link's probe
        for _ in range(300):
            if fd.router.get("r0") is not None:
                break
            await asyncio.sleep(0.01)
        assert fd.router.get("r0") is not None and not fd.path.watch.suspects
        await c.close()
        await fd.stop(grace_s=0.1)
        await stopped.stop()
        await other.stop()

    try:
        run(main())
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
