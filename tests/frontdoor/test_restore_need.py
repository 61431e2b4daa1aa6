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
