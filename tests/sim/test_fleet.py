"""The simulated fleet: start-up tiers, billing, scale-in, the suspended tier, start caps."""

import json

import numpy as np
import pytest

from agent.clock import ManualClock
from agent.errors import ConfigError
from agent.frontdoor.router import Router
from agent.sim.fleet import (BOOTING, DRAINING, OFF, READY, SUSPENDED, WARM, Fleet,
                             FleetConfig, StartupTimes)


class Harness:
    def __init__(self, **cfg):
        self.clock = ManualClock()
        self.router = Router()
        self.events = []
        self.fleet = Fleet(FleetConfig(model="m", seqs_per_replica=4, kv_capacity_tokens=400,
                                       **cfg), router=self.router, clock=self.clock,
                           schedule=lambda t, kind, i, g: self.events.append((t, kind, i, g)),
                           rng=np.random.default_rng(0))

    def fire_until(self, t):
        self.events.sort()
        while self.events and self.events[0][0] <= t:
            te, kind, i, g = self.events.pop(0)
            self.clock.set(te)
            assert kind == READY
            self.fleet.on_ready(i, g)
        self.clock.set(t)


def test_restore_then_warm_and_billing():
    h = Harness(startup=StartupTimes(restore_s=(3.6, 3.6)))
    h.fleet.set_target("m", 2, reason="test")
    assert h.fleet.count[BOOTING] == 2 and h.router.warm("m") == []
    h.fire_until(3.6)
    assert h.fleet.warm == 2 and len(h.router.warm("m")) == 2
    h.fire_until(10.0)
    h.fleet.finish()
    assert h.fleet.gpu_s == pytest.approx(20.0)      # 2 replicas x 10 s, boot included
    assert h.fleet.starts_by_tier["restore"] == 2
    assert h.fleet.target("m") == 2


def test_scale_in_stops_idle_and_drains_busy():
    h = Harness()
    h.fleet.start_warm(2)
    h.fleet.busy[0] = 1                               # replica 0 serves one request
    h.fleet.set_target("m", 0)
    assert h.fleet.state == [DRAINING, OFF]
    assert h.router.warm("m") == []                   # neither takes new requests
    h.clock.set(5.0)
    h.fleet.on_complete(0)
    assert h.fleet.state == [OFF, OFF]
    h.fleet.finish()
    assert h.fleet.gpu_s == pytest.approx(5.0)        # only the draining one kept billing


def test_suspended_tier_resumes_fast_and_expires():
    h = Harness(keep_suspended=True, suspended_ttl_s=60.0,
                startup=StartupTimes(suspended_s=(2.0, 2.0), restore_s=(3.6, 3.6)))
    h.fleet.start_warm(1)
    h.fleet.set_target("m", 0)
    assert h.fleet.state == [SUSPENDED] and h.fleet.billed == 0
    h.clock.set(10.0)
    h.fleet.set_target("m", 2)                        # one resumes (2.0 s), one restores
    assert h.fleet.starts_by_tier == {"suspended": 1, "restore": 1, "naive": 0}
    assert sorted(e[0] for e in h.events) == [12.0, 13.6]
    h.fire_until(20.0)
    h.fleet.set_target("m", 0)
    h.clock.set(79.0)
    h.fleet.expire_suspended()
    assert h.fleet.count[SUSPENDED] == 2
    h.clock.set(80.0)
    h.fleet.expire_suspended()
    assert h.fleet.count[SUSPENDED] == 0 and h.fleet.count[OFF] == 2
    h.fleet.finish()
    assert h.fleet.suspended_s == pytest.approx(10.0 + 2 * 60.0)


def test_cancelled_start_is_ignored_and_cap_holds():
    h = Harness(max_concurrent_starts=1, startup=StartupTimes(restore_s=(4.0, 4.0)))
    h.fleet.set_target("m", 3)
    assert h.fleet.count[BOOTING] == 1               # the cap: one restore at a time
    h.fire_until(4.0)
    assert h.fleet.warm == 1 and h.fleet.count[BOOTING] == 1
    h.fleet.set_target("m", 1)                        # cancel the one booting and the queued one
    assert h.fleet.count[BOOTING] == 0
    h.fire_until(20.0)                                # its READY arrives and is ignored
    assert h.fleet.warm == 1 and h.fleet.state.count(WARM) == 1


def test_startup_json(tmp_path):
    p = tmp_path / "bench.json"
    p.write_text(json.dumps({"restore_s": 9.0, "zygote_restore_s": 1.5, "naive_s": [40, 50]}))
    st = StartupTimes.from_json(p)
    assert st.restore_s == (1.5, 1.5) and st.naive_s == (40.0, 50.0)
    assert st.suspended_s == StartupTimes().suspended_s
    p.write_text(json.dumps({"naive_s": -1}))
    with pytest.raises(ConfigError) as e:
        StartupTimes.from_json(p)
    assert e.value.name == "naive_s"
    p.write_text(json.dumps({"restore_s": [5, 1]}))
    with pytest.raises(ConfigError):
        StartupTimes.from_json(p)


def test_config_limits():
    FleetConfig(seqs_per_replica=1)
    with pytest.raises(ConfigError) as e:
        FleetConfig(seqs_per_replica=0)
    assert e.value.name == "seqs_per_replica" and e.value.value == 0
