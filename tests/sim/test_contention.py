"""The replicas' speed on cores the stack's own process shares (agent/sim/contention.py)."""

import pytest

from agent.errors import ConfigError
from agent.sim.contention import background_cores, shared_core_speed, slowed
from agent.speed import SpeedProfile

P = SpeedProfile(prefill_tokens_per_s=400.0, prefill_overhead_s=0.01, decode_base_s=0.02,
                 decode_per_seq_s=0.005, decode_per_ctx_token_s=1e-6)


def test_a_replica_per_core_loses_what_the_stack_spends_per_request():
    # 2 cores, 2 one-thread replicas at 25 req/s, 5 ms of stack CPU a request: 1 / 1.125
    assert shared_core_speed(2, 2, 1, 25.0, 0.005) == pytest.approx(1 / 1.125)
    # the node's throughput is then what its cores allow: X (1/mu' ... ) = C
    s = shared_core_speed(2, 2, 1, 25.0, 0.005)
    x = 2 * 25.0 * s
    assert x * (1 / 25.0 + 0.005) == pytest.approx(2.0)


def test_spare_cores_absorb_the_stack_and_no_speed_is_gained():
    assert shared_core_speed(4, 2, 1, 25.0, 0.005) == 1.0
    assert shared_core_speed(2, 2, 1, 25.0, 0.0) == 1.0


def test_slowed_stretches_every_duration_and_the_prefill_rate():
    q = slowed(P, 0.5)
    assert q.prefill_s(400) == pytest.approx(2 * P.prefill_s(400))
    assert q.decode_step_s(8, 100) == pytest.approx(2 * P.decode_step_s(8, 100))
    assert slowed(P, 1.0) == P


@pytest.mark.parametrize("kw", [dict(cores=0), dict(replicas=0), dict(service_rps=0.0),
                                dict(cpu_s_per_request=-1.0),
                                dict(cpu_s_per_request=float("nan"))])
def test_bad_inputs_are_named(kw):
    args = dict(cores=2, replicas=2, threads=1, service_rps=25.0, cpu_s_per_request=0.005)
    args.update(kw)
    with pytest.raises(ConfigError) as err:
        shared_core_speed(**args)
    assert err.value.name == next(iter(kw))


@pytest.mark.parametrize("speed", [0.0, 1.5, float("inf")])
def test_a_speed_outside_zero_to_one_is_refused(speed):
    with pytest.raises(ConfigError):
        slowed(P, speed)


def test_background_cpu_comes_off_the_cores_not_off_each_request():
    # 0.2 cores of ticks and polls leave 1.8 of 2 cores: 1.8 / (2 + 2 * 25 * 0.005)
    assert shared_core_speed(2, 2, 1, 25.0, 0.005, 0.2) == pytest.approx(1.8 / 2.25)
    assert shared_core_speed(2, 2, 1, 25.0, 0.005, 0.0) == shared_core_speed(2, 2, 1, 25.0, 0.005)
    with pytest.raises(ConfigError) as err:
        shared_core_speed(2, 2, 1, 25.0, 0.005, 2.0)
    assert err.value.name == "background_cores"


def test_background_cores_is_the_cpu_rate_while_no_request_is_in_flight():
    # 0.05 cores in the background, 0.2 core-seconds more in each busy second
    busy = [(10.0, 12.0), (11.5, 13.0), (40.0, 41.0)]     # overlapping spans merge
    samples, cpu = [], 0.0
    for t in range(0, 61):
        samples.append((float(t), cpu))
        in_busy = any(a <= t < b for a, b in busy)
        cpu += 0.05 + (0.2 if in_busy else 0.0)
    assert background_cores(samples, busy) == pytest.approx(0.05)
    # a scale event between requests (one second at a full core) does not move the median
    samples2 = [(t, c + (1.0 if t > 30 else 0.0)) for t, c in samples]
    assert background_cores(samples2, busy) == pytest.approx(0.05)
    # a window with no quiet time cannot tell the background apart: 0
    assert background_cores(samples, [(0.0, 60.0)]) == 0.0
    assert background_cores([], busy) == 0.0
