"""The cold path at the front door: a 429's ``retry_after_ms`` comes from measured figures
(while a model's start has never been timed: its measured cold boot from the start in
flight, or the documented floor, never the ~1 ms an unmeasured ETA of "now" gives); a cold
model's first request is answered by its default deadline; a start measured only as a cold
boot raises no deadline from a p99 that is None.  Virtual time; nothing sleeps."""

import asyncio
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from virtual_fleet import Fleet  # noqa: E402

from agent.wire import refusals  # noqa: E402

FLOOR_MS = 1000   # agent/frontdoor/queues.py RETRY_AFTER_UNKNOWN_MS, written out


def cold_refusals(f: Fleet, n: int = 40, **kw) -> list:
    sinks = [f.submit(**kw) for _ in range(n)]
    return [s for s in sinks if s.code == 429]


def test_a_cold_refusal_with_no_start_measured_says_retry_after_the_floor_not_1_ms():
    async def main():
        f = Fleet(warm=0, restore_s=5.0, restores_per_model=1)
        refused = cold_refusals(f, deadline_ms=1000)
        assert refused                                        # one restore cannot take 40
        for sink in refused:
            assert sink.final["refusal"] == refusals.DEADLINE_UNREACHABLE
            assert sink.final["retry_after_ms"] >= FLOOR_MS
        await f.timeline.run_until(f.clock.now() + 6.0)
    asyncio.run(main())


def test_a_cold_refusal_uses_the_measured_cold_boot_from_the_start_in_flight():
    async def main():
        f = Fleet(warm=0, restore_s=20.0, restores_per_model=1)
        f.path.restore_times.record("m", 8000.0, "cold_boot")   # a cold boot took 8 s
        f.submit()                                              # starts the restore
        t0 = f.clock.now()
        await f.timeline.run_until(t0 + 2.0)
        refused = cold_refusals(f, deadline_ms=1000)
        assert refused
        for sink in refused:   # the start began 2 s ago; a cold boot takes 8: ~6 s more
            assert 5900 <= sink.final["retry_after_ms"] <= 6100
    asyncio.run(main())


def test_a_cold_models_first_request_is_answered_by_its_default_deadline_when_the_start_hangs():
    async def main():
        f = Fleet(warm=0, restore_s=5.0, models={"m": 10_000.0})
        f.capacity.hang = True                   # the start never ends (its requester's own
        t0 = f.clock.now()                       # timeout is minutes away)
        first = f.submit()                       # no deadline of its own
        await f.timeline.run_until(t0 + 9.9)
        assert first.final is None               # held for the start, within the default
        await f.timeline.run_until(t0 + 10.1)
        assert first.code == 429 and first.at_s <= t0 + 10.0 + f.path.config.tick_s
        assert first.final["refusal"] == refusals.DEADLINE_UNREACHABLE
        assert first.final["retry_after_ms"] >= FLOOR_MS
        assert "default deadline of 10000 ms" in first.final["reason"]
    asyncio.run(main())


def test_a_cold_models_first_request_is_served_when_its_start_comes_up_in_time():
    async def main():
        f = Fleet(warm=0, restore_s=5.0, models={"m": 10_000.0})
        t0 = f.clock.now()
        first = f.submit()
        await f.timeline.run_until(t0 + 6.0)
        assert first.code == 200 and first.first_s <= t0 + 5.1
    asyncio.run(main())


def test_a_model_whose_only_measured_start_is_a_cold_boot_is_restored_without_error(caplog):
    """A model the front door learned of from the registry (no configured deadline) whose
    first start was a cold boot: the restore p99 of its default tier is None then (cold boots
    predict nothing of the next start), and the deadline raised from it must not multiply
    None (the front door once logged "restore of tiny failed: unsupported operand type(s)
    for *: 'float' and 'NoneType'" and dropped the replica the cold boot made)."""
    from agent.frontdoor.capacity import RestoreResult

    class ColdBoot:
        def __init__(self, fleet):
            self.fleet = fleet

        async def request_restore(self, model):
            return RestoreResult(self.fleet.add("booted").load, "cold_boot", 8000.0)

    async def main():
        f = Fleet(warm=0, models={})
        f.path.known_models.add("m")                  # seen in the registry, not configured
        f.path.capacity = ColdBoot(f)
        sink = f.submit()
        for _ in range(4):
            await asyncio.sleep(0)                    # the restore task ends
        await f.timeline.run_until(f.clock.now() + 1.0)
        assert sink.code == 200 and sink.final["replica"] == "booted"
        assert f.path.restore_times.p99_ms("m") is None          # no default tier yet
        assert f.path.restore_times.p99_ms("m", "cold_boot") == 8000.0
        state = f.path.models.of("m")
        assert state.deadline_ms == f.path.config.default_deadline_ms
    with caplog.at_level("WARNING", logger="agent.frontdoor.request_path"):
        asyncio.run(main())
    assert not [r for r in caplog.records if "restore of m failed" in r.message]
