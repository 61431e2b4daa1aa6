"""The request path in virtual time (tests/frontdoor/virtual_fleet.py): routing by predicted
TTFT, early refusal, waiting for capacity that can arrive in time, re-checks, replica 429s,
cancel.  Every time asserted is the injected clock's."""

import asyncio
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from virtual_fleet import FAST, SLOW, Fleet  # noqa: E402


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_request_no_capacity_can_start_within_its_slo_is_refused_at_arrival():
    async def main():
        # One slot, taken by a long request; restores take 10 s (measured): nothing can
        # start a new request within the 4 s restore-path SLO.
        f = Fleet(max_seqs=1, restore_s=10.0, measured_restores_s=(10.0,))
        long = f.submit(max_tokens=500)
        t0 = f.clock.now()
        late = f.submit()
        assert late.code == 429 and late.at_s == t0        # at once, on the injected clock
        assert late.final["retry_after_ms"] >= 1
        assert "cannot start within 4000 ms" in late.final["reason"]
        assert f.path.counts["shed_429"] == 1 and f.path.gate.total == 1  # capacity still asked
        await f.timeline.run_until(t0 + 30)
        assert long.code == 200 and f.path.counts["expired_504"] == 0
    run(main())


def test_a_refusal_past_the_warm_budget_names_that_budget_not_the_restore_paths():
    async def main():
        # A warm, idle replica that prefills 1,000 tokens in ~2.5 s: past the warm-hit SLO
        # (2 s), and restores take 10 s: refused, and the reason says which budget it missed
        # (it read "cannot start within 4000 ms: best warm replica predicted 2520 ms").
        import re
        f = Fleet(speed=SLOW, restore_s=10.0, measured_restores_s=(10.0,))
        late = f.submit(prompt_tokens=1000)
        assert late.code == 429
        reason = late.final["reason"]
        assert "cannot start within 4000 ms" in reason
        got = re.search(r"best warm replica predicted (\d+) ms, past the warm-hit budget "
                        r"of (\d+) ms", reason)
        assert got is not None, reason
        assert int(got.group(2)) == 2000 and int(got.group(1)) > 2000
    run(main())


def test_a_queued_request_that_can_make_it_waits_for_the_restore_and_is_served():
    async def main():
        f = Fleet(max_seqs=1, restore_s=1.0, measured_restores_s=(1.0,))
        f.submit(max_tokens=500)
        t0 = f.clock.now()
        waits = f.submit(prompt_tokens=64)
        assert waits.final is None and len(f.path.queues["m"]) == 1
        await f.timeline.run_until(t0 + 5)
        assert waits.code == 200 and waits.final["path"] == "snapshot_restore"
        assert 1.0 <= waits.first_s - t0 <= 4.0                 # within the restore SLO
        assert abs(waits.final["queue_wait_ms"] - 1000.0) < 1.0
        assert waits.final["replica"] == "restored-1"
        assert f.path.counts["expired_504"] == 0 and f.capacity.calls == 1
    run(main())


def test_a_prediction_gone_bad_is_refused_when_known_not_at_the_deadline():
    async def main():
        # Restores measured p50 0.5 s, p99 3 s; this one never finishes.  Past its p99 the
        # front door gives it the measured spread (2.5 s) more: too late for a 4 s deadline.
        f = Fleet(max_seqs=1, restore_s=1.0, measured_restores_s=(0.5, 0.5, 3.0))
        f.capacity.hang = True
        f.submit(max_tokens=500)
        t0 = f.clock.now()
        held = f.submit()
        assert held.final is None
        await f.timeline.run_until(t0 + 6)
        assert held.code == 429 and "capacity now in sight cannot start it" in held.final["reason"]
        assert 3.0 <= held.at_s - t0 < 3.0 + 2 * f.path.config.recheck_s, held.final   # when known
        assert f.path.counts["expired_504"] == 0
    run(main())


def test_routing_follows_predicted_ttft_and_sends_deadline_ms():
    async def main():
        f = Fleet(warm=0)
        slow = f.add("slow", speed=SLOW, max_seqs=64)
        fast = f.add("fast", speed=FAST, max_seqs=4)
        slow.load.kv_capacity_tokens = 1 << 20           # far more headroom: not the criterion
        f.path.upsert(slow.load)
        f.path.upsert(fast.load)
        t0 = f.clock.now()
        first = f.submit(prompt_tokens=200)
        assert fast.received and not slow.received
        assert fast.received[0]["deadline_ms"] == 2000.0     # the warm SLO, none elapsed
        # in-flight accounting: queued prefill on "fast" until its first token
        load = f.path.router.get("fast")
        assert (load.active_seqs, load.waiting_seqs, load.queued_prefill_tokens) == (1, 1, 200)
        await f.timeline.run_until(t0 + 0.2)
        assert first.first_s is not None
        assert (load.waiting_seqs, load.queued_prefill_tokens, load.active_ctx_tokens) == (0, 0, 200)
        for _ in range(3):
            f.submit(prompt_tokens=200)
        assert len(fast.received) == 4                        # still the faster one
        f.submit(prompt_tokens=200)                           # fast's 4 slots are full
        assert len(slow.received) == 1
        await f.timeline.run_until(t0 + 10)
        assert all(s.code == 200 for s in f.sinks)
    run(main())


def test_a_replica_429_sends_the_request_to_another_replica():
    async def main():
        f = Fleet(warm=0)
        # "liar" reports FAST but really runs 50x slower: it refuses the deadline it gets.
        crawl = SLOW.__class__(prefill_tokens_per_s=8.0, prefill_overhead_s=1.0,
                               decode_base_s=4.0, decode_per_seq_s=0.5,
                               decode_per_ctx_token_s=0.0)
        liar = f.add("liar", speed=FAST, actual=crawl)
        honest = f.add("honest", speed=SLOW)
        f.path.upsert(liar.load)
        f.path.upsert(honest.load)
        t0 = f.clock.now()
        s = f.submit()
        assert liar.received and not honest.received
        await f.timeline.run_until(t0 + 0.001)
        assert liar.refused == 1 and len(honest.received) == 1
        assert f.path.counts["replica_429"] == 1
        assert f.path.router.get("liar").penalty_s > 1.0      # until its next report
        f.submit()
        assert len(liar.received) == 1 and len(honest.received) == 2
        await f.timeline.run_until(t0 + 10)
        assert s.code == 200 and s.final["replica"] == "honest"
        assert f.path.router.get("liar").active_seqs == 0     # the refusal freed its slot
    run(main())


def test_cancel_frees_the_slot_or_the_queue_place():
    async def main():
        f = Fleet(max_seqs=1, restore_s=1.0, measured_restores_s=(1.0,))
        replica = f.replicas[0]
        sink = f.sinks
        f.submit(max_tokens=500)
        flight = next(iter(replica.in_flight.values()))
        f.submit()
        queued = f.path.queues["m"].peek().payload
        queued.cancel()
        assert len(f.path.queues["m"]) == 0 and f.path.counts["cancelled"] == 1
        flight.cancel()
        assert not replica.in_flight and f.path.router.get("r0").active_seqs == 0
        await f.timeline.run_until(f.clock.now() + 30)
        assert all(s.final is None for s in sink)             # a cancelled request is not answered
    run(main())


def test_an_unprofiled_replica_is_predicted_with_the_slowest_reported_profile():
    async def main():
        f = Fleet(warm=0)
        f.path.upsert(f.add("measured", speed=SLOW).load)
        blind = f.add("blind", speed=None)
        blind.load.speed = None
        f.path.upsert(blind.load)
        assert f.path.router.prior("m") == SLOW
        assert f.path.router.get("blind").predict_ttft_s(100, f.path.router.prior("m")) == \
            SLOW.predict_ttft_s(100)
    run(main())


def test_a_deadline_passing_while_queued_is_a_504_logged_with_the_prediction_it_broke(caplog):
    async def main():
        f = Fleet(max_seqs=1, restore_s=1.0, measured_restores_s=(1.0,))
        f.capacity.hang = True
        f.submit(max_tokens=500)
        t0 = f.clock.now()
        held = f.submit()
        predicted_ms = held.final is None and f.path.queues["m"].peek().predicted_ttft_s * 1000
        assert 1000.0 <= predicted_ms <= 4000.0
        f.clock.advance(4.5)        # the loop stalled past its deadline: no re-check ran
        f.path.expire_queued()
        assert held.code == 504 and held.at_s == t0 + 4.5
        assert f"predicted TTFT {predicted_ms:.0f} ms" in held.final["reason"]
        assert f.path.counts["expired_504"] == 1
    with caplog.at_level("WARNING", logger="agent.frontdoor.request_path"):
        run(main())
    assert any("504" in r.message and "predicted TTFT was" in r.message for r in caplog.records)


def test_each_answer_passes_its_prediction_to_telemetry_when_telemetry_takes_it():
    from agent.telemetry import Telemetry

    class Recording(Telemetry):
        def __init__(self):
            super().__init__()
            self.seen = []

        def event(self, request_id, model, path, code, queue_wait_ms, restore_ms, ttft_ms,
                  sla_breached, *, reason=None, predicted_ttft_ms=None, **_answer):
            self.seen.append((code, ttft_ms, predicted_ttft_ms, reason))

    async def main():
        f = Fleet()
        f.path.telemetry = rec = Recording()
        f.path._event_kw = frozenset({"reason", "predicted_ttft_ms"})
        s = f.submit(prompt_tokens=100)
        await f.timeline.run_until(f.clock.now() + 5)
        assert s.code == 200
        code, ttft_ms, predicted_ms, _ = rec.seen[0]
        assert code == 200 and abs(ttft_ms - predicted_ms) < 1e-6   # right, here
        f.path.begin_stop(f.clock.now() + 1)
        f.submit()
        assert rec.seen[1][0] == 503 and "draining" in rec.seen[1][3]
    run(main())


def test_late_and_expired_lines_are_rate_limited(caplog):
    import logging

    from agent.clock import ManualClock
    from agent.frontdoor.ratelog import RateLimitedLog

    clock = ManualClock()
    rl = RateLimitedLog(logging.getLogger("t.rl"), "things", clock=clock, interval_s=10, burst=2)
    with caplog.at_level("WARNING", logger="t.rl"):
        for i in range(50):
            rl.warning("thing %d", i)
        clock.advance(10)
        rl.tick()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["thing 0", "thing 1", "things: 48 more in the last 10 s (not logged one by one)"]


def test_the_first_restore_is_awaited_to_the_default_deadline_then_measured_ones_count():
    async def main():
        # Nothing restored yet: the first restore may be a cold boot that no restore SLO
        # covers; the model's default deadline (60 s here) bounds the wait instead.
        f = Fleet(warm=0, restore_s=10.0)
        t0 = f.clock.now()
        first = f.submit()
        assert first.final is None
        await f.timeline.run_until(t0 + 12)
        assert first.code == 200 and 10.0 <= first.first_s - t0 <= 10.1
        # Now 10 s is the measured restore p99: a request no warm replica can take in time
        # and that a restore cannot start within 4 s is refused at once.
        for r in f.replicas:
            r.load.max_seqs = r.load.active_seqs = 1
        f.submit(max_tokens=500)
        t1 = f.clock.now()
        late = f.submit()
        assert late.code == 429 and late.at_s == t1
    run(main())


def test_a_request_no_replica_of_the_model_can_hold_is_413_even_at_zero_replicas():
    async def main():
        f = Fleet(max_seqs=2, restore_s=1.0, measured_restores_s=(1.0,))
        largest = f.replicas[0].load.kv_capacity_tokens
        f.path.router.remove("r0")                  # scaled to zero: nothing warm
        too_big = f.submit(prompt_tokens=largest, max_tokens=16)
        assert too_big.code == 413 and f"holds {largest}" in too_big.final["reason"]
        assert f.path.counts["shed_429"] == 0 and f.path.gate.total == 0  # no restore for it
        fits = f.submit(prompt_tokens=8, max_tokens=8)
        assert fits.final is None                   # held for the restore, as before
    run(main())


def test_requests_that_find_no_warm_replica_are_counted_with_their_misses():
    async def main():
        # a restore that makes the SLO: both cold arrivals served in time, no miss
        f = Fleet(max_seqs=4, warm=0, restore_s=1.0, measured_restores_s=(1.0,))
        t0 = f.clock.now()
        a, b = f.submit(), f.submit()
        await f.timeline.run_until(t0 + 6)
        assert a.code == b.code == 200
        assert f.path.info("stats")["cold"] == {"m": {"arrivals": 2, "misses": 0}}
        warm = f.submit()                           # a replica is warm now: not cold
        await f.timeline.run_until(t0 + 8)
        assert warm.code == 200 and (f.path.models.of("m").cold_arrivals, f.path.models.of("m").cold_misses) == (2, 0)
        # restores too slow for the 4 s restore SLO: refused at once, each a cold miss
        g = Fleet(max_seqs=4, warm=0, restore_s=10.0, measured_restores_s=(10.0,))
        refused = [g.submit() for _ in range(3)]
        assert [r.code for r in refused] == [429] * 3
        assert g.path.info("stats")["cold"] == {"m": {"arrivals": 3, "misses": 3}}
    run(main())


def test_a_replicas_garbage_retry_after_or_prediction_never_reaches_the_client_or_router():
    """A replica's 503/429 before the first token whose ``retry_after_ms`` is not a positive
    integer within RETRY_AFTER_MAX_MS, or whose ``predicted_ttft_ms`` is not a finite number
    >= 0, is answered with the front door's own default (and no penalty from it)."""
    from agent.frontdoor.reroute import RETRY_AFTER_MAX_MS, RETRY_AFTER_MS

    for code, retry, predicted in ((503, -5, None), (429, 0, float("inf")),
                                   (429, RETRY_AFTER_MAX_MS + 1, float("nan")),
                                   (429, True, -1e9), (503, 2.5, None)):
        async def main(code, retry, predicted):
            f = Fleet(warm=1)
            replica = f.replicas[0]
            s = f.submit()
            rid, flight = next(iter(replica.in_flight.items()))
            message = {"id": rid, "type": "error", "code": code, "reason": "x",
                       "retry_after_ms": retry}
            if predicted is not None:
                message["predicted_ttft_ms"] = predicted
            f.path.on_answer(replica, flight, message)
            assert s.code == 429 and s.final["retry_after_ms"] == RETRY_AFTER_MS, (code, retry)
            load = f.path.router.get("r0")
            assert load is None or load.penalty_s == 0.0, (predicted, load.penalty_s)
        run(main(code, retry, predicted))
    async def fine():
        f = Fleet(warm=1)
        replica = f.replicas[0]
        s = f.submit()
        rid, flight = next(iter(replica.in_flight.items()))
        f.path.on_answer(replica, flight, {"id": rid, "type": "error", "code": 429,
                                           "retry_after_ms": RETRY_AFTER_MAX_MS})
        assert s.final["retry_after_ms"] == RETRY_AFTER_MAX_MS       # at the limit: kept
    run(fine())


def test_a_garbage_retry_after_on_a_begun_answer_is_not_passed_on():
    async def main():
        f = Fleet(warm=1)
        replica = f.replicas[0]
        s = f.submit()
        rid, flight = next(iter(replica.in_flight.items()))
        f.path.on_answer(replica, flight, {"id": rid, "type": "tokens", "tokens": [1]})
        f.path.on_answer(replica, flight, {"id": rid, "type": "error", "code": 503,
                                           "reason": "draining", "retry_after_ms": -5})
        assert s.code == 503 and s.final["retry_after_ms"] is None
    run(main())


def test_stats_count_every_known_model_from_zero():
    """A reader (the predictor's CounterRate, its cold baseline) takes its first reading as a
    baseline: a model's counters must be there at 0 before its first request, or that request
    and its cold arrival are never counted."""
    f = Fleet(warm=0)
    stats = f.path.info("stats")
    assert stats["arrivals"] == {"m": 0}
    assert stats["cold"] == {"m": {"arrivals": 0, "misses": 0}}
    f.submit()
    stats = f.path.info("stats")
    assert stats["arrivals"] == {"m": 1} and stats["cold"]["m"]["arrivals"] == 1


def test_a_413_at_zero_replicas_is_no_cold_arrival():
    """A request no replica can hold is answered 413 whatever is warm: it says nothing about
    keep-alive, so it must not count as a cold arrival that met its SLO (a client sending
    oversized requests at zero replicas would dilute the measured cold miss fraction)."""
    async def main():
        f = Fleet(max_seqs=2, restore_s=1.0, measured_restores_s=(1.0,))
        largest = f.replicas[0].load.kv_capacity_tokens
        f.path.router.remove("r0")
        for _ in range(3):
            assert f.submit(prompt_tokens=largest, max_tokens=16).code == 413
        assert f.path.info("stats")["cold"]["m"] == {"arrivals": 0, "misses": 0}
        assert f.path.info("stats")["arrivals"]["m"] == 3      # still arrivals of the model
    run(main())


def test_a_replicas_client_error_on_a_cold_request_is_no_slo_miss():
    """A cold request the restored replica refuses as malformed (400: prompt + max_tokens over
    its max_seq_len) failed no SLO; a 500 or a late first token did."""
    async def main():
        for code, misses in ((400, 0), (422, 0), (500, 1), (429, 1)):
            f = Fleet(warm=1)
            replica = f.replicas[0]
            f.submit()
            rid, flight = next(iter(replica.in_flight.items()))
            flight.cold = True                 # as if it had found no warm replica
            f.path.models.of("m").cold_arrivals, f.path.models.of("m").cold_misses = 1, 0
            f.path.on_answer(replica, flight, {"id": rid, "type": "tokens", "tokens": [1]}) \
                if code == 500 else None
            f.path.on_answer(replica, flight, {"id": rid, "type": "error", "code": code,
                                               "reason": "prompt 600 + max_tokens 8 exceeds"})
            assert (f.path.models.of("m").cold_arrivals,
                    f.path.models.of("m").cold_misses) == (1, misses), code
    run(main())


def test_a_final_answer_for_a_request_already_answered_is_dropped_and_counts_no_miss():
    """A cold request answered once (here failed 504 at its deadline) then answered again by
    the replica: the client gets one answer, and the cold counters keep misses <= arrivals
    (the predictor refuses a reading where they do not, and its keep-alive goes blind)."""
    async def main():
        f = Fleet(warm=1)
        replica = f.replicas[0]
        sent = f.submit()
        rid, flight = next(iter(replica.in_flight.items()))
        flight.cold = True
        state = f.path.models.of("m")
        state.cold_arrivals, state.cold_misses = 1, 0
        f.path.fail(flight, 504, "deadline passed")
        assert sent.code == 504 and state.cold_misses == 1
        answers_before = dict(f.path.counts)
        f.path.on_answer(replica, flight, {"id": rid, "type": "done", "tokens": [1]})
        assert sent.code == 504                   # still the one answer the client got
        assert (state.cold_arrivals, state.cold_misses) == (1, 1)
        assert f.path.counts["done"] == answers_before["done"]
    run(main())


def test_a_cold_models_first_request_is_held_for_its_start_up_to_its_default_deadline():
    async def main():
        # Nothing warm, nothing measured: the first start is a cold boot of unknown length
        # (here 70 s, past the model's 60 s default deadline).  The request is held for it
        # until that deadline, never refused earlier (not "(37 ms left)" at the restore
        # path's budget), then answered 429 with a retry_after_ms: never held on to the
        # capacity requester's own timeout (minutes).  The start goes on and serves the next.
        f = Fleet(warm=0, restore_s=70.0)
        t0 = f.clock.now()
        first = f.submit()
        assert first.final is None
        await f.timeline.run_until(t0 + 59.99)
        assert first.final is None, first.final
        await f.timeline.run_until(t0 + 60.01)
        assert first.code == 429 and first.final["retry_after_ms"] >= 1000, first.final
        assert "default deadline of 60000 ms" in first.final["reason"]
        assert f.path.counts["expired_504"] == 0
        assert f.path.info("stats")["cold"] == {"m": {"arrivals": 1, "misses": 1}}
        await f.timeline.run_until(t0 + 71)
        after = f.submit()                               # the start came up: warm now
        await f.timeline.run_until(t0 + 72)
        assert after.code == 200 and after.final["replica"] == "restored-1"
        # a second request arriving while the start is under way is held and served too
        g = Fleet(warm=0, restore_s=30.0)
        t1 = g.clock.now()
        a = g.submit()
        await g.timeline.run_until(t1 + 10)
        b = g.submit(deadline_ms=45_000)
        await g.timeline.run_until(t1 + 31)
        assert a.code == b.code == 200 and 30.0 <= b.first_s - t1 <= 30.1
    run(main())


def test_a_cold_request_its_start_cannot_make_is_refused_at_once_with_the_etas_retry_after():
    async def main():
        # The start's ETA is known (10 s, measured): a 5 s client deadline cannot be met.
        f = Fleet(warm=0, restore_s=10.0, measured_restores_s=(10.0,))
        t0 = f.clock.now()
        late = f.submit(deadline_ms=5000)
        assert late.code == 429 and late.at_s == t0
        assert 9000 <= late.final["retry_after_ms"] <= 11000
        assert "cannot start within 5000 ms (the request's deadline_ms)" in late.final["reason"]
    run(main())


def test_a_refusal_with_no_new_capacity_in_sight_names_the_warm_deadline_it_missed():
    async def main():
        # A warm replica too slow for the 2 s warm-path deadline and no restore to ask for:
        # the deadline that applied is the warm path's, not the model's 60 s default.
        f = Fleet(speed=SLOW)
        late = f.submit(prompt_tokens=1000)
        assert late.code == 429
        reason = late.final["reason"]
        assert "cannot start within 2000 ms (the warm-hit SLO x deadline_factor 1)" in reason, \
            reason
        assert "60000" not in reason and "TTFT SLO from arrival" not in reason
    run(main())


def test_restores_failing_at_once_are_asked_again_with_backoff_not_on_every_recheck():
    """A capacity requester that refuses at once (Nomad's scale endpoint at the scaling
    policy's maximum answers in milliseconds) while requests arrive faster than the one warm
    replica serves: asked again after 0.25 s, then doubling, not on every re-check (786
    asks in 10 s before; a loaded cluster run asked every ~20 ms); every request is
    answered, and once restores succeed again the count of failures resets."""
    async def main():
        f = Fleet(max_seqs=1, warm=1, restore_s=0.02, measured_restores_s=(1.0,))
        f.capacity.fail = True
        t0 = f.clock.now()
        for i in range(200):                       # 20 rps for 10 s
            f.arrive(t0 + i * 0.05, max_tokens=64)
        await f.timeline.run_until(t0 + 10.0)
        # failures at ~0, 0.27, 0.79, 1.81, 3.83, 7.85 s (+ the requester's 20 ms each)
        assert 5 <= f.capacity.calls <= 8, f.capacity.calls
        state = f.path.models.of("m")
        assert state.restore_failures == f.capacity.calls
        f.capacity.fail = False
        await f.timeline.run_until(t0 + 30.0)
        assert all(s.final is not None for s in f.sinks)      # nothing left unanswered
        asked = f.capacity.calls
        for i in range(100):                       # the next burst: restores work again
            f.arrive(t0 + 30.0 + i * 0.05, max_tokens=64)
        await f.timeline.run_until(t0 + 60.0)
        assert f.capacity.calls > asked and len(f.replicas) > 1
        assert state.restore_failures == 0
        assert all(s.final is not None for s in f.sinks)
    run(main())
