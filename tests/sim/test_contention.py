"""The replicas' speed on cores the stack's own process shares (agent/sim/contention.py)."""

import pytest

from agent.errors import ConfigError
from agent.sim.contention import shared_core_speed, slowed
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
