"""The SLO counts, the deadline refuses: a request whose prefill alone is past its deadline is
refused at arrival with that reason; with a deadline a few times the SLO a request predicted
past its SLO is served (and counted late) instead of refused; the SLO counts the prompt's
own prefill when configured.  Virtual time (virtual_fleet)."""

import asyncio
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from virtual_fleet import Fleet  # noqa: E402

import pytest  # noqa: E402

from agent.errors import ConfigError  # noqa: E402
from agent.frontdoor.config import FrontDoorConfig  # noqa: E402
from agent.speed import SpeedProfile  # noqa: E402

# prefill 1,000 tokens/s: a 3,000-token prompt takes 3 s before its first token
SLOW_PREFILL = SpeedProfile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.0,
                            decode_base_s=0.01, decode_per_seq_s=0.001, decode_per_ctx_token_s=0.0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_prompt_whose_prefill_alone_is_past_its_deadline_is_refused_at_arrival():
    async def main():
        f = Fleet(speed=SLOW_PREFILL)
        sink = f.submit(prompt_tokens=3000, deadline_ms=2000.0)
        assert sink.code == 429 and sink.at_s == sink.arrival_s        # at once
        assert sink.final["refusal"] == "deadline_unreachable"
        assert "alone take 3000 ms to prefill" in sink.final["reason"]
        ok = f.submit(prompt_tokens=3000, deadline_ms=5000.0)          # it can make this one
        await f.timeline.run_until(f.clock.now() + 10)
        assert ok.code == 200
    run(main())


def test_the_slo_counts_the_prompts_prefill_and_the_deadline_a_few_times_it():
    async def main():
        f = Fleet(speed=SLOW_PREFILL, deadline_factor=3.0, slo_counts_prefill=True)
        sink = f.submit(prompt_tokens=3000)        # SLO 2 s + 3 s prefill; deadline 15 s
        await f.timeline.run_until(f.clock.now() + 10)
        assert sink.code == 200 and 3.0 <= sink.first_s - sink.arrival_s <= 5.0
        assert f.path.counts["late_first_token"] == 0
        warm_s, _ = f.path.budgets.slos_s("m", 3000)
        assert warm_s == pytest.approx(5.0)
        deadline_s, _ = f.path.budgets.budgets_s("m", None, 3000)
        assert deadline_s == pytest.approx(15.0)
    run(main())


def test_a_late_answer_beats_a_refusal_when_the_deadline_allows_it():
    async def main():
        # one slot, busy for ~4 s: the next request's first token comes past its 2 s SLO
        tight = Fleet(max_seqs=1, speed=SLOW_PREFILL)
        tight.submit(prompt_tokens=10, max_tokens=400)
        refused = tight.submit(prompt_tokens=10)
        assert refused.code == 429                               # deadline = SLO: refused
        loose = Fleet(max_seqs=1, speed=SLOW_PREFILL, deadline_factor=3.0)
        loose.submit(prompt_tokens=10, max_tokens=400)
        served = loose.submit(prompt_tokens=10)
        await loose.timeline.run_until(loose.clock.now() + 30)
        assert served.code == 200 and served.first_s - served.arrival_s > 2.0
    run(main())


def test_the_default_contract_is_a_deadline_equal_to_an_slo_that_counts_the_prefill():
    # answered within the SLO or refused at once: the default never trades misses for
    # fewer refusals (a client that would rather wait says so with its own deadline)
    cfg = FrontDoorConfig()
    assert cfg.deadline_factor == 1.0 and cfg.slo_counts_prefill


def test_a_deadline_factor_below_one_is_refused():
    with pytest.raises(ConfigError) as err:
        FrontDoorConfig(deadline_factor=0.5)
    assert err.value.name == "deadline_factor"


def test_a_request_late_with_nothing_queued_ahead_is_still_served_within_its_deadline():
    async def main():
        # a restore still coming (5 s, past the 4 s restore SLO) makes it late, not a queue
        f = Fleet(warm=0, speed=SLOW_PREFILL, deadline_factor=3.0, restore_s=5.0,
                  measured_restores_s=(5.0,))
        sink = f.submit(prompt_tokens=10)
        await f.timeline.run_until(f.clock.now() + 30)
        assert sink.code == 200 and sink.first_s - sink.arrival_s > 4.0
    run(main())


def test_late_work_is_refused_while_arrivals_outpace_the_replicas():
    async def main():
        # 1.5 s prefills, one replica (~0.66 requests/s); arrivals at 1/s for 20 s
        f = Fleet(max_seqs=8, speed=SLOW_PREFILL, deadline_factor=3.0)
        t0 = f.clock.now()
        for i in range(20):
            f.arrive(t0 + i, prompt_tokens=1500, max_tokens=4)
        await f.timeline.run_until(t0 + 60)
        served = [s for s in f.sinks if s.code == 200]
        late = [s for s in served if s.first_s - s.arrival_s > 2.0 + 0.05]
        outpaced = [s for s in f.sinks if s.code == 429 and "outpace" in s.final["reason"]]
        assert len(outpaced) >= 8 and all(s.at_s == s.arrival_s for s in outpaced)
        # late answers only while the rate was still being learnt (the first window)
        assert all(s.arrival_s < t0 + 6.0 for s in late), [s.arrival_s - t0 for s in late]
        assert [s for s in served if s.arrival_s >= t0 + 6.0]   # and on-time ones after
    run(main())


def test_a_one_off_burst_is_served_late_rather_than_refused():
    async def main():
        f = Fleet(max_seqs=8, speed=SLOW_PREFILL, deadline_factor=3.0)
        sinks = [f.submit(prompt_tokens=1500, max_tokens=4) for _ in range(3)]
        await f.timeline.run_until(f.clock.now() + 30)
        assert [s.code for s in sinks] == [200, 200, 200]
        assert sinks[-1].first_s - sinks[-1].arrival_s > 2.0     # late, within 6 s
    run(main())
