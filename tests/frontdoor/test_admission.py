import pytest

from agent.clock import ManualClock
from agent.errors import ConfigError, Overloaded
from agent.frontdoor.admission import AdmissionQueue, Pending


def make(depth=3, wait=10.0):
    clock = ManualClock(100.0)
    return clock, AdmissionQueue("m", clock=clock, max_depth=depth, max_wait_s=wait)


def p(rid, deadline, clock, need=1):
    return Pending(rid, "m", clock.now(), deadline, need)


def test_earliest_deadline_first_regardless_of_arrival():
    clock, q = make(depth=5)
    for rid, d in [("a", 105), ("b", 102), ("c", 109), ("d", 102)]:
        q.offer(p(rid, d, clock))
    assert [q.pop_earliest().request_id for _ in range(4)] == ["b", "d", "a", "c"]
    assert q.pop_earliest() is None and len(q) == 0


def test_depth_at_limit_is_refused_with_retry_after():
    clock, q = make(depth=2)
    q.offer(p(1, 101.5, clock))
    q.offer(p(2, 103.0, clock))
    with pytest.raises(Overloaded) as err:
        q.offer(p(3, 104.0, clock))
    assert err.value.code == 429 and err.value.depth == 2 and err.value.limit == 2
    assert err.value.retry_after_ms == 1500  # the head's deadline is 1.5 s away
    assert len(q) == 2


def test_expired_requests_are_handed_back_and_never_popped():
    clock, q = make()
    q.offer(p("soon", 101.0, clock))
    q.offer(p("later", 105.0, clock))
    clock.advance(0.999)
    assert q.expire() == []
    clock.advance(0.001)
    assert [x.request_id for x in q.expire()] == ["soon"]
    assert q.pop_earliest().request_id == "later"


def test_wait_bound_gives_up_before_a_long_deadline():
    clock, q = make(wait=2.0)
    q.offer(p("long", 160.0, clock))
    clock.advance(2.0)
    gone = q.expire()
    assert [x.request_id for x in gone] == ["long"]
    assert gone[0].deadline_s > clock.now()  # the caller answers 429, not 504


def test_expected_wait_past_the_bound_and_spent_deadline_are_refused():
    clock, q = make(wait=2.0)
    q.expected_wait_s = 2.5
    with pytest.raises(Overloaded, match="expected wait") as err:
        q.offer(p(1, 150.0, clock))
    assert err.value.retry_after_ms == 2500
    q.expected_wait_s = 2.0
    q.offer(p(1, 150.0, clock))
    with pytest.raises(Overloaded, match="no time left"):
        q.offer(p(2, 100.0, clock))


def test_bad_configuration_is_refused():
    with pytest.raises(ConfigError):
        AdmissionQueue("m", clock=ManualClock(), max_depth=0, max_wait_s=1)
    with pytest.raises(ConfigError):
        AdmissionQueue("m", clock=ManualClock(), max_depth=1, max_wait_s=0)


def test_cancelled_requests_free_their_place_and_are_never_popped():
    clock, q = make(depth=2)
    a, b = p("a", 101.0, clock), p("b", 102.0, clock)
    q.offer(a)
    q.offer(b)
    q.cancel(a)
    q.cancel(a)  # twice is once
    assert len(q) == 1
    q.offer(p("c", 103.0, clock))  # the freed place is usable
    assert [q.pop_earliest().request_id for _ in range(2)] == ["b", "c"]
    assert q.pop_earliest() is None and len(q) == 0


def test_fluid_starts_follow_the_rates_in_sight():
    import math

    from agent.frontdoor.admission import fluid_starts_s

    # one replica at 10/s from now, 2 waiting there: the queue's first starts at 0.3 s
    assert fluid_starts_s(100.0, 2, [(100.0, 10.0)], 3) == pytest.approx([100.3, 100.4, 100.5])
    # a second replica at 10/s due at 100.2: 20/s from then on
    got = fluid_starts_s(100.0, 2, [(100.0, 10.0), (100.2, 10.0)], 4)
    assert got == pytest.approx([100.25, 100.3, 100.35, 100.4])
    # nothing warm, one restore due in 1 s
    assert fluid_starts_s(5.0, 0, [(6.0, 4.0)], 2) == pytest.approx([6.25, 6.5])
    # no capacity at all: never
    assert fluid_starts_s(5.0, 0, [], 2) == [math.inf, math.inf]
    assert fluid_starts_s(5.0, 0, [(5.0, 1.0)], 0) == []
