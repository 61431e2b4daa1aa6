"""Synthetic overload through the request path in virtual time, on prefill-bound replicas
(long prompts, a token or two out: the regime where queued prefill, not the decode batch,
sets the TTFT): steady overload and step bursts at a multiple of one replica's capacity
computed from its profile.  Served requests start within their SLO, every request is
answered, refusals are 429s at arrival, nothing is lost; a replica that goes away before a
request's first token does not lose it (tests/frontdoor/virtual_fleet.py)."""

import asyncio
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from virtual_fleet import capacity_rps as fleet_capacity_rps, Fleet  # noqa: E402

from agent.speed import SpeedProfile  # noqa: E402

# prefill-bound: a 200-token prompt costs about eight decode steps
PREFILL_BOUND = SpeedProfile(prefill_tokens_per_s=300.0, prefill_overhead_s=0.05,
                             decode_base_s=0.06, decode_per_seq_s=0.01,
                             decode_per_ctx_token_s=1e-5)
PROMPT, GEN, SEQS = (20, 400), (1, 4), 8


def capacity_rps() -> float:
    """One replica's request rate at its sustainable concurrency within the warm SLO."""
    return fleet_capacity_rps(PREFILL_BOUND, PROMPT, GEN, SEQS)


def arrivals(shape: str, rng) -> np.ndarray:
    cap = capacity_rps()
    if shape == "steady_overload":
        n = rng.poisson(3.0 * cap * 40.0)
        return np.sort(rng.uniform(0, 40.0, n))
    # step bursts: 20 requests within 100 ms every 5 s, over a trickle at 0.3 of capacity
    out = list(np.sort(rng.uniform(0, 40.0, rng.poisson(0.3 * cap * 40.0))))
    for k in range(8):
        out.extend(5.0 * k + np.sort(rng.uniform(0, 0.1, 20)))
    return np.sort(np.array(out))


async def replay(f: Fleet, times: np.ndarray, rng) -> Fleet:
    """Send one request per arrival time (prompt and output lengths drawn from ``PROMPT`` and
    ``GEN``) and run the fleet's timeline 30 s past the last."""
    t0 = f.clock.now()
    for t in times:
        f.arrive(t0 + t, int(rng.integers(*PROMPT)), int(rng.integers(*GEN)))
    await f.timeline.run_until(t0 + times[-1] + 30)
    return f


def outcome(f: Fleet):
    codes = [s.code for s in f.sinks]
    served = [s for s in f.sinks if s.code == 200]
    refused = [s for s in f.sinks if s.code == 429]
    return codes, served, refused


HELD_FOR_RESTORE_MISS = pytest.mark.xfail(strict=True, reason=(
    "requests held for a restore near their 4 s deadline are refused at a later re-check "
    "(a few % of the refusals): the slot estimate of a queued request drifts later while "
    "the prefill ahead of it runs (the front door's accounting is in tokens, not time)"))


@pytest.mark.parametrize("shape,restore_s,max_replicas", [
    ("steady_overload", None, None), ("steady_overload", 1.0, None), ("step_bursts", None, None),
    pytest.param("step_bursts", 1.0, None, marks=HELD_FOR_RESTORE_MISS),
    # the node at its replica cap (as a CPU node is): no restore can help, refuse at once
    ("steady_overload", 1.0, 2), ("step_bursts", 1.0, 2)])
def test_overload_on_prefill_bound_replicas_refuses_at_arrival(shape, restore_s, max_replicas):
    rng = np.random.default_rng(7)
    times = arrivals(shape, rng)

    async def main():
        kw = {} if restore_s is None else dict(restore_s=restore_s, max_replicas=max_replicas,
                                               measured_restores_s=(restore_s,))
        f = Fleet(speed=PREFILL_BOUND, max_seqs=SEQS, warm=2, restores_per_model=1,
                  restores_overall=1, **kw)
        return await replay(f, times, rng)

    f = asyncio.run(main())
    codes, served, refused = outcome(f)
    assert len(codes) == len(times) and None not in codes          # every request answered
    assert set(codes) <= {200, 429}, sorted(set(codes))           # no 504, nothing lost
    assert f.path.counts["late_first_token"] == 0
    assert served
    for s in served:
        slo_s = 2.0 if s.final["path"] == "warm_hit" else 4.0
        assert s.first_s - s.arrival_s <= slo_s
    late = [round(s.at_s - s.arrival_s, 3) for s in refused if s.at_s - s.arrival_s > 0.050]
    assert len(late) <= 0.05 * len(refused), late                 # >= 95 % at once


def test_a_replica_slower_than_it_knows_is_predicted_slower_after_its_first_tokens():
    """Both replicas prefill at half the speed they report and their own 429 check uses
    too: the front door measures the error from its first tokens and admits by it."""
    import dataclasses

    half = dataclasses.replace(PREFILL_BOUND,
                               prefill_tokens_per_s=PREFILL_BOUND.prefill_tokens_per_s / 2)
    rng = np.random.default_rng(7)
    times = arrivals("steady_overload", rng)

    async def main():
        f = Fleet(speed=PREFILL_BOUND, max_seqs=SEQS, warm=0)
        for i in range(2):
            f.path.upsert(f.add(f"r{i}", actual=half, self_aware=False).load)
        return await replay(f, times, rng)

    f = asyncio.run(main())
    codes, served, refused = outcome(f)
    assert set(codes) <= {200, 429} and served
    late = [s for s in served if s.first_s - s.arrival_s > 2.0]
    # only what was sent before the error showed: at most a batch per replica
    assert len(late) <= 2 * SEQS, len(late)
    assert len(late) <= 0.25 * len(served)
    for i in range(2):
        slowdown = f.path.router.get(f"r{i}").slowdown
        assert 1.5 <= slowdown <= 2.0, slowdown   # prefill 2x slower, decode not


def test_a_replica_draining_before_the_first_token_does_not_lose_the_request():
    async def main():
        f = Fleet(speed=PREFILL_BOUND, max_seqs=SEQS, warm=2)
        going = f.replicas[0]

        def draining(flight, message):            # a scale-in the view has not seen yet
            rid = going.dispatch_count = getattr(going, "dispatch_count", 0) + 1
            going.in_flight[rid] = flight
            f.timeline.at(f.clock.now() + 0.001, lambda: going._answer(rid, {
                "type": "error", "code": 503, "reason": "replica draining",
                "retry_after_ms": 1000}))
            return rid
        going.dispatch = draining
        t0 = f.clock.now()
        sinks = [f.submit(prompt_tokens=50, max_tokens=2) for _ in range(3)]
        await f.timeline.run_until(t0 + 10)
        return f, sinks, t0

    f, sinks, t0 = asyncio.run(main())
    assert [s.code for s in sinks] == [200, 200, 200]
    assert {s.final["replica"] for s in sinks} == {"r1"}
    assert f.path.router.get("r0") is None and f.path.counts["rerouted"] >= 1
    assert all(s.first_s - s.arrival_s <= 2.0 for s in sinks)


def test_a_node_at_its_cap_counts_no_restorable_capacity_until_a_replica_leaves():
    """An ask answered by an existing replica (``warm_hit``), with nothing queued (the probe
    a refusal sends), caps the model: no ETA of capacity that a restore would bring, until
    a warm replica leaves; then an ask may restore again."""
    async def main():
        f = Fleet(speed=PREFILL_BOUND, max_seqs=SEQS, warm=2, restore_s=1.0, max_replicas=2,
                  measured_restores_s=(1.0,))
        now = f.clock.now()
        assert f.path.planner.etas_s("m", now) and not f.path.restores.at_cap("m")
        f.path.restores.restore_for("m", 1)
        await f.timeline.run_until(now + 0.5)
        assert f.path.restores.at_cap("m") and f.path.planner.etas_s("m", f.clock.now()) == []
        f.path.router.remove("r1")                  # scaled in: its slot may be free
        assert not f.path.restores.at_cap("m") and f.path.planner.etas_s("m", f.clock.now())
    asyncio.run(main())


def test_an_at_cap_answer_with_no_replica_in_view_does_not_cap():
    """A scale-in raced the answer (no warm replica in view, none in the answer): a cap set
    then could never be seen to lift, so none is set."""
    from agent.frontdoor.capacity import RestoreResult

    class Racing:
        async def request_restore(self, model):
            return RestoreResult(None, "warm_hit", None)

    async def main():
        f = Fleet(speed=PREFILL_BOUND, max_seqs=SEQS, warm=0, measured_restores_s=(1.0,))
        f.path.capacity = Racing()
        f.path.restores.restore_for("m", 1)
        await f.timeline.run_until(f.clock.now() + 0.1)
        assert not f.path.restores.at_cap("m") and f.path.planner.etas_s("m", f.clock.now())
    asyncio.run(main())


def test_capacity_is_found_again_when_a_node_joins_while_capped():
    """Overload while the only node is at its cap of 2 (requests refused at arrival, with
    nothing queued), then a node with room joins: the asks the refusals send find it, the
    cap ends, requests are served by the new replica, and none is left unanswered."""
    async def main():
        f = Fleet(speed=PREFILL_BOUND, max_seqs=SEQS, warm=2, restore_s=1.0, max_replicas=2,
                  measured_restores_s=(1.0,), models={"m": 4000.0})
        t0 = f.clock.now()
        rng = np.random.default_rng(3)
        for t in np.sort(rng.uniform(0, 8.0, int(3 * capacity_rps() * 8.0))):
            f.arrive(t0 + t, int(rng.integers(*PROMPT)), int(rng.integers(*GEN)))
        await f.timeline.run_until(t0 + 2.0)
        assert f.path.restores.at_cap("m") and len(f.path.router.warm("m")) == 2
        f.capacity.max_replicas = 3                  # a node with room joins
        await f.timeline.run_until(t0 + 20.0)
        warm = {r.replica_id for r in f.path.router.warm("m")}
        assert len(warm) == 3 and any(r.startswith("restored-") for r in warm)
        # capped again only at the new total (the joined node filled too), not at the old 2
        assert f.path.models.of("m").replica_cap in (None, 3)
        codes, served, refused = outcome(f)
        assert None not in codes and set(codes) <= {200, 429}
        assert any(s.final["replica"].startswith("restored-") for s in served)
        assert sum(len(q) for q in f.path.queues.values()) == 0
    asyncio.run(main())


def test_the_cap_is_remembered_across_a_scale_to_zero():
    """A model scaled to zero between bursts keeps its nodes' cap: once as many replicas as
    the node gave are back, admission counts no more (a request admitted on a restore the
    node cannot make is refused at the next re-check, late); a restore that goes past the
    cap forgets it."""
    async def main():
        f = Fleet(speed=PREFILL_BOUND, max_seqs=SEQS, warm=2, restore_s=1.0, max_replicas=2,
                  measured_restores_s=(1.0,))
        f.path.restores.restore_for("m", 1)
        await f.timeline.run_until(f.clock.now() + 0.5)
        assert f.path.restores.replica_room("m") == 0
        for rid in ("r0", "r1"):                     # scaled to zero
            f.path.router.remove(rid)
        assert f.path.restores.replica_room("m") == 2
        assert len(f.path.planner.etas_s("m", f.clock.now())) >= 1
        for r in f.replicas[:2]:                     # the next burst: both back
            f.path.upsert(r.load)
        assert f.path.restores.at_cap("m") and f.path.planner.etas_s("m", f.clock.now()) == []
        f.capacity.max_replicas = 3                  # a node joins: an ask gets a new replica
        f.path.models.of("m").capped_until_s = 0.0
        f.path.restores.restore_for("m", 1)
        await f.timeline.run_until(f.clock.now() + 2.0)
        assert len(f.path.router.warm("m")) == 3 and f.path.restores.replica_room("m") is None
    asyncio.run(main())


def test_the_cap_follows_a_node_that_left():
    """The cap was learnt at 3 replicas; a node leaves, taking one.  The next at-cap answer
    comes with 2 in view: that is the cap now, so admission counts no restore the nodes
    cannot make.  (Kept at the larger of the two, the cap stayed 3 for good: every later
    burst was admitted on a restore no node would make, and refused at a re-check, late.)"""
    async def main():
        f = Fleet(speed=PREFILL_BOUND, max_seqs=SEQS, warm=3, restore_s=1.0, max_replicas=3,
                  measured_restores_s=(1.0,))
        f.path.restores.restore_for("m", 1)
        await f.timeline.run_until(f.clock.now() + 0.5)
        assert f.path.models.of("m").replica_cap == 3 and f.path.restores.at_cap("m")
        gone = f.replicas.pop()                       # its node leaves
        f.path.router.remove(gone.replica_id)
        f.capacity.max_replicas = 2
        assert f.path.restores.replica_room("m") == 1  # not known yet
        f.path.models.of("m").capped_until_s = 0.0
        f.path.restores.restore_for("m", 1)            # answered at the cap, with 2 in view
        await f.timeline.run_until(f.clock.now() + 0.5)
        assert f.path.models.of("m").replica_cap == 2
        assert f.path.restores.at_cap("m") and f.path.planner.etas_s("m", f.clock.now()) == []
        # a burst past the two replicas: what they cannot serve is refused at arrival
        f.path.models.of("m").capped_until_s = f.clock.now() + 60.0
        t0 = f.clock.now()
        for _ in range(4 * SEQS):
            f.submit(prompt_tokens=PROMPT[1], max_tokens=GEN[0])
        await f.timeline.run_until(t0 + 10.0)
        codes, served, refused = outcome(f)
        assert None not in codes and refused
        assert all(s.at_s == s.arrival_s for s in refused)
    asyncio.run(main())
