"""A restore is asked for only where the SLO needs one: a queue the warm replicas start in
time asks for nothing; one they cannot asks for a replica (virtual time, virtual_fleet)."""

import asyncio
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from virtual_fleet import Fleet  # noqa: E402

from agent.speed import SpeedProfile  # noqa: E402

# 40 ms per 100-token prompt: a burst of 20 is done in under a second on one replica
QUICK = SpeedProfile(prefill_tokens_per_s=2500.0, prefill_overhead_s=0.0, decode_base_s=0.01,
                     decode_per_seq_s=0.001, decode_per_ctx_token_s=0.0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_burst_the_warm_replica_serves_in_time_asks_for_no_restore():
    async def main():
        f = Fleet(speed=QUICK, max_seqs=2, restore_s=0.5, measured_restores_s=(0.5,))
        for _ in range(20):                   # more than its 2 slots: most of them queue
            f.submit(prompt_tokens=100, max_tokens=1)
        assert len(f.path.models.queue("m")) > 0
        await f.timeline.run_until(f.clock.now() + 10)
        assert [s.code for s in f.sinks] == [200] * 20
        assert all(s.first_s - s.arrival_s <= 2.0 for s in f.sinks)
        assert f.capacity.calls == 0          # one replica was enough: none more paid for
    run(main())


def test_a_burst_past_what_the_warm_replica_serves_in_time_asks_for_one():
    async def main():
        f = Fleet(speed=QUICK, max_seqs=2, restore_s=0.5, measured_restores_s=(0.5,))
        for _ in range(120):                  # 4.8 s of prefill: past the 2 s SLO on one
            f.submit(prompt_tokens=100, max_tokens=1)
        await f.timeline.run_until(f.clock.now() + 20)
        assert f.capacity.calls >= 1
        assert len(f.replicas) >= 2           # the restore came up and served
        assert sum(1 for s in f.sinks if s.final and s.final.get("replica", "").startswith(
            "restored")) > 0
    run(main())


def measured(rps):
    from agent.throughput import BacklogCapacity

    return BacklogCapacity(rps=rps, seconds=10.0, batch=2.0, prompt_tokens=100.0,
                           gen_tokens=1.0)


def test_with_a_measured_capacity_the_rate_decides_whether_a_restore_is_needed():
    async def main():
        # the replica was measured at 30 requests/s backlogged, faster than the profile
        # alone predicts (40 ms a prompt, one at a time: 25/s); 50 prompts start in 1.7 s
        f = Fleet(speed=QUICK, max_seqs=2, restore_s=0.5, measured_restores_s=(0.5,))
        f.replicas[0].load.backlog = measured(30.0)
        f.path.upsert(f.replicas[0].load)
        flights = []
        for _ in range(50):
            flights.append(f.submit(prompt_tokens=100, max_tokens=1))
        queued = [p.payload for p in f.path.models.queue("m").ordered()]
        assert f.path.planner.restores_needed("m", queued, f.clock.now(), 2) == 0
        # at 10 requests/s measured, the same queue needs a replica more
        f.replicas[0].load.backlog = measured(10.0)
        f.path.upsert(f.replicas[0].load)
        assert f.path.planner.restores_needed("m", queued, f.clock.now(), 2) >= 1
        # and no replica at all when none is needed by the deadlines: an empty queue
        assert f.path.planner.restores_needed("m", [], f.clock.now(), 2) == 0
    run(main())


def test_the_default_cooldown_is_one_lead_time():
    from agent.predictor.policy import ModelPolicy

    p = ModelPolicy("m", lead_time_s=7.0, restore_p99_s=2.0)
    assert p.cooldown_s == 7.0
    assert ModelPolicy("m", scale_down_cooldown_s=30.0).cooldown_s == 30.0


def test_the_restores_needed_are_found_in_few_placements_however_large_the_room():
    """restores_needed is asked on every held arrival and every re-check (20 ms); it places
    the queue once per count it tries, so with a room of 64 (restores_per_model 64) trying
    each count in turn placed a queue 65 times a call (22 ms for 128 queued requests, past
    the re-check interval) where no count helps.  The counts are tried by bisection instead
    (fewer replicas never start more of the queue in time), with the same answers."""
    async def main():
        f = Fleet(speed=QUICK, max_seqs=2, restore_s=0.5, measured_restores_s=(0.5,),
                  restores_per_model=64, restores_overall=64)
        for _ in range(120):
            f.submit(prompt_tokens=100, max_tokens=1, deadline_ms=600_000)
        planner = f.path.planner
        queued = [p.payload for p in f.path.models.queue("m").ordered(128)]
        now = f.clock.now()
        calls = []
        short = planner._short_by_rate
        place = planner._place

        def counted_short(*a, **kw):
            calls.append(a[3])
            return short(*a, **kw)

        def counted_place(*a, **kw):
            if kw.get("new_replicas") is not None:
                calls.append(kw["new_replicas"])
            return place(*a, **kw)
        planner._short_by_rate, planner._place = counted_short, counted_place

        def needed(deadline_s):
            for fl in queued:
                fl.deadline_s = fl.warm_deadline_s = deadline_s
            f.path.models.forget_slots("m")
            calls.clear()
            return planner.restores_needed("m", queued, now, 64), len(calls)

        for measured_rps in (None, 10.0):
            if measured_rps is not None:
                f.replicas[0].load.backlog = measured(measured_rps)
                f.path.upsert(f.replicas[0].load)
            assert needed(now + 0.01) == (0, 2)        # none can help: two placements
            assert needed(now + 3600.0) == (0, 1)      # none needed: one
            n, placements = needed(now + 3.0)           # some help: by bisection
            assert 1 <= n <= 64 and placements <= 2 + 6
    run(main())
