"""The simulated replica's capacity measured backlogged, and the speed that matches a live
measurement (agent/sim/calibrate.py)."""

import pytest

from agent.errors import ConfigError
from agent.sim.calibrate import matched_speed, sim_sustained_rps
from agent.sim.contention import at_speed
from agent.speed import SpeedProfile
from agent.throughput import BacklogCapacity

SPEED = SpeedProfile(prefill_tokens_per_s=300.0, prefill_overhead_s=0.02, decode_base_s=0.012,
                     decode_per_seq_s=0.002, decode_per_ctx_token_s=0.0, itl_target_s=0.2)


def test_whole_prompts_one_by_one_sustain_one_prefill_each():
    whole = SpeedProfile(**{**SPEED.to_dict(), "itl_target_s": 0.0})
    rps = sim_sustained_rps(whole, [(30, 1)], max_seqs=8, max_seq_len=512, concurrency=16,
                            itl_target_s=0.0)
    # one-token answers end at their prefill: one call of 30 tokens each, nothing decodes
    assert rps == pytest.approx(1.0 / whole.prefill_s(30), rel=1e-6)


def test_short_prompts_sharing_calls_sustain_more_than_one_call_each():
    alone = 1.0 / SPEED.prefill_s(8)
    shared = sim_sustained_rps(SPEED, [(8, 1)], max_seqs=8, max_seq_len=512, concurrency=16)
    assert shared > 1.5 * alone       # the call overhead is paid once for several prompts


def test_the_matched_speed_reproduces_the_measured_capacity():
    lengths = [(12, 3), (40, 1), (8, 6)]
    sim = sim_sustained_rps(SPEED, lengths, max_seqs=8, max_seq_len=512, concurrency=16)
    live = BacklogCapacity(rps=0.8 * sim, seconds=8.0, batch=16.0, prompt_tokens=20.0,
                           gen_tokens=3.3)
    speed, factor = matched_speed(SPEED, live, lengths, max_seqs=8, max_seq_len=512)
    assert factor == pytest.approx(0.8)
    again = sim_sustained_rps(speed, lengths, max_seqs=8, max_seq_len=512, concurrency=16,
                              reported=SPEED)
    assert again == pytest.approx(live.rps, rel=0.02)
    assert at_speed(SPEED, 2.0).prefill_tokens_per_s == 600.0
    assert at_speed(SPEED, 2.0).decode_base_s == pytest.approx(0.006)


@pytest.mark.parametrize("kw", [dict(lengths=[]), dict(concurrency=0), dict(departures=0)])
def test_arguments_out_of_range(kw):
    args = dict(lengths=[(1, 1)], max_seqs=2, max_seq_len=64, concurrency=2)
    args.update(kw)
    lengths = args.pop("lengths")
    with pytest.raises(ConfigError):
        sim_sustained_rps(SPEED, lengths, **args)
    with pytest.raises(ConfigError):
        at_speed(SPEED, 0.0)


def test_a_replica_of_no_slots_is_refused_not_run_for_ever():
    """A replica stats' max_seqs of 0 (or a negative one) never completes a request: the
    closed loop used to step it for ever; it is a ConfigError naming the slots and the
    limit, for matched_speed too."""
    for bad in (0, -1):
        with pytest.raises(ConfigError) as err:
            sim_sustained_rps(SPEED, [(8, 1)], max_seqs=bad, max_seq_len=512, concurrency=4)
        assert (err.value.name, err.value.value, err.value.limit) == ("max_seqs", bad, 1)
    live = BacklogCapacity(rps=5.0, seconds=10.0, batch=4.0, prompt_tokens=8.0, gen_tokens=1.0)
    with pytest.raises(ConfigError, match="max_seqs=0"):
        matched_speed(SPEED, live, [(8, 1)], max_seqs=0, max_seq_len=512)
