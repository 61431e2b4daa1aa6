"""Leader election against the Consul stand-in, on a manual clock (no sleeping)."""

import pytest

from agent.cluster.consul_registry import consul_client
from agent.cluster.leader import LEADER_KEY, LeaderLock
from agent.errors import ConfigError
from agent.predictor.loop import ModelPolicy, Predictor

TTL_S = 10
CHECK_TTL_S = 3.0
TICK_S = 1.0


class RecordingScaler:
    def __init__(self, name, log):
        self.name, self.log, self.t = name, log, {}

    def set_target(self, model, count, *, reason):
        self.log.append((self.name, count))
        self.t[model] = count

    def target(self, model):
        return self.t.get(model, 0)


def lock(standin, clock, name):
    return LeaderLock(consul_client(f"{standin.host}:{standin.port}"), clock=clock, name=name,
                      ttl_s=TTL_S, check_ttl_s=CHECK_TTL_S)


def test_one_leader_then_takeover_within_the_check_ttl_plus_one_tick(consul_standin,
                                                                      consul_clock):
    a, b = lock(consul_standin, consul_clock, "a"), lock(consul_standin, consul_clock, "b")
    leaders = []
    for _ in range(5):
        consul_clock.advance(TICK_S)
        leaders.append((a.tick(), b.tick()))
    assert leaders == [(True, False)] * 5
    killed_at = consul_clock.now()           # a stops feeding its check (process gone)
    took_over = None
    while took_over is None:
        consul_clock.advance(TICK_S)
        assert not a.is_leader or consul_clock.now() - killed_at < CHECK_TTL_S
        if b.tick():
            took_over = consul_clock.now() - killed_at
        assert not (a.is_leader and b.is_leader)
        assert consul_clock.now() - killed_at <= CHECK_TTL_S + TICK_S
    # the check went critical CHECK_TTL_S after the last pass: the session went with it,
    # long before Consul's 2 x TTL session timer
    assert took_over <= CHECK_TTL_S + TICK_S < 2 * TTL_S
    consul_clock.advance(TICK_S)             # a comes back: its session is gone
    assert a.tick() is False and b.tick() is True


def test_a_leader_restarted_under_its_name_does_not_keep_the_dead_ones_session(consul_standin,
                                                                              consul_clock):
    # kill -9 and an immediate restart in the same allocation (same name): the new process
    # must not feed the check the dead process's session is tied to, or the lock stays with
    # a dead session until Consul's 2 x TTL timer fires
    a, b = lock(consul_standin, consul_clock, "a"), lock(consul_standin, consul_clock, "b")
    consul_clock.advance(TICK_S)
    assert a.tick() and not b.tick()
    dead = a.session
    killed_at = consul_clock.now()
    a2 = lock(consul_standin, consul_clock, "a")     # the restarted process
    took_over = None
    while took_over is None:
        consul_clock.advance(TICK_S)
        a2_leads, b_leads = a2.tick(), b.tick()
        assert not (a2_leads and b_leads)
        if a2_leads or b_leads:
            took_over = consul_clock.now() - killed_at
        assert consul_clock.now() - killed_at <= CHECK_TTL_S + TICK_S
    assert dead not in consul_standin.sessions
    assert consul_standin.kv[LEADER_KEY]["Session"] in (a2.session, b.session)


def test_without_the_check_a_dead_leaders_session_lives_for_2_x_ttl(consul_standin,
                                                                     consul_clock):
    c = consul_client(f"{consul_standin.host}:{consul_standin.port}")
    sid = c.session.create(ttl=TTL_S, lock_delay=0)
    assert c.kv.put(LEADER_KEY, "old", acquire=sid)
    consul_clock.advance(2 * TTL_S - 0.1)    # past the TTL: Consul still holds it
    assert c.session.info(sid)[1] is not None
    consul_clock.advance(0.1)
    assert c.session.info(sid)[1] is None    # invalidated at 2 x TTL (session_ttl.go)
    assert "Session" not in consul_standin.kv[LEADER_KEY]


def test_two_predictors_never_act_in_the_same_tick(consul_standin, consul_clock):
    acted = []
    preds = {}
    for name in ("p1", "p2"):
        scaler = RecordingScaler(name, acted)
        preds[name] = (lock(consul_standin, consul_clock, name),
                       Predictor([ModelPolicy("m")], clock=consul_clock, scaler=scaler,
                                 snapshot_durable=lambda m: True))
    alive = {"p1", "p2"}
    per_tick = []
    for t in range(40):
        consul_clock.advance(TICK_S)
        if t == 10:
            alive.discard("p1")              # kill the leader
        acting = []
        for name in sorted(alive):
            leader, pred = preds[name]
            pred.observe("m", 20 + t)        # rising demand: the actor scales up
            decisions = pred.tick(act=leader.tick())
            if decisions[0].action != "standby":
                acting.append(name)
        per_tick.append(acting)
    assert all(len(a) <= 1 for a in per_tick)
    assert per_tick[0] == ["p1"] and per_tick[-1] == ["p2"]
    gap = [i for i, a in enumerate(per_tick) if not a]
    assert gap and len(gap) <= CHECK_TTL_S   # nobody acts for at most the check's TTL
    assert {n for n, _ in acted} == {"p1", "p2"}


def test_losing_consul_means_losing_the_lock(consul_standin, consul_clock):
    a = lock(consul_standin, consul_clock, "a")
    consul_clock.advance(TICK_S)
    assert a.tick() is True
    consul_standin.down = True
    consul_clock.advance(TICK_S)
    assert a.tick() is False and a.is_leader is False
    consul_standin.down = False
    consul_clock.advance(TICK_S)
    assert a.tick() is True                  # its session still lives: it leads again


def test_leader_cut_off_stops_before_consul_can_let_go(consul_standin, consul_clock):
    a = lock(consul_standin, consul_clock, "a")
    consul_clock.advance(TICK_S)
    assert a.tick()
    consul_clock.advance(CHECK_TTL_S - 0.5)
    assert a.is_leader                        # its check still passes
    consul_clock.advance(0.5)
    assert not a.is_leader                    # Consul may now invalidate the session


def test_release_hands_over_at_once(consul_standin, consul_clock):
    a, b = lock(consul_standin, consul_clock, "a"), lock(consul_standin, consul_clock, "b")
    consul_clock.advance(TICK_S)
    assert a.tick() and not b.tick()
    a.release()
    assert b.tick()
    assert consul_standin.kv[LEADER_KEY]["Session"] == b.session
    assert a.service_id not in consul_standin.services       # its check is gone too
    assert consul_standin.sessions[b.session]["checks"] == ["serfHealth", b.check_id]


@pytest.mark.parametrize("ttl,check_ttl", [(9, 3.0), (86401, 3.0), (10, 0.0), (10, 10.0)])
def test_ttl_limits(consul_standin, consul_clock, ttl, check_ttl):
    with pytest.raises(ConfigError):
        LeaderLock(consul_client(f"{consul_standin.host}:{consul_standin.port}"),
                   clock=consul_clock, name="x", ttl_s=ttl, check_ttl_s=check_ttl)
