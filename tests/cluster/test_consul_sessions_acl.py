"""The Consul stand-in's sessions and ACL as Consul's servers keep them (consul_standin.py and
consul_acl.py cite the source)."""

import consul
import pytest
import requests

from agent.cluster.consul_registry import consul_client


def client(standin, token=None):
    return consul_client(f"{standin.host}:{standin.port}", token=token)


def test_a_session_tied_to_a_check_dies_when_the_check_goes_critical(consul_standin,
                                                                      consul_clock):
    c = client(consul_standin)
    c.agent.service.register("lock", service_id="lock-1", check=consul.Check.ttl("3s"))
    with pytest.raises(consul.ConsulException, match="is in critical state"):
        c.session.create(ttl=10, checks=["service:lock-1"])   # a TTL check starts critical
    with pytest.raises(consul.ConsulException, match="Missing check 'service:nope'"):
        c.session.create(ttl=10, checks=["service:nope"])
    c.agent.check.ttl_pass("service:lock-1")
    sid = c.session.create(ttl=10, lock_delay=0, checks=["serfHealth", "service:lock-1"])
    assert c.kv.put("k", "v", acquire=sid)
    consul_clock.advance(2.9)
    assert c.session.info(sid)[1] is not None
    consul_clock.advance(0.1)                       # the check's TTL passed without an update
    assert c.session.info(sid)[1] is None and "Session" not in consul_standin.kv["k"]


def test_deregistering_the_check_invalidates_the_session(consul_standin):
    c = client(consul_standin)
    c.agent.service.register("lock", service_id="lock-1", check=consul.Check.ttl("3s"))
    c.agent.check.ttl_pass("service:lock-1")
    sid = c.session.create(ttl=10, checks=["service:lock-1"])
    c.agent.service.deregister("lock-1")
    assert c.session.info(sid)[1] is None


def test_a_renew_rearms_the_timer_at_2_x_ttl(consul_standin, consul_clock):
    c = client(consul_standin)
    sid = c.session.create(ttl=10)
    consul_clock.advance(15)
    c.session.renew(sid)
    consul_clock.advance(19.9)
    assert c.session.info(sid)[1] is not None
    consul_clock.advance(0.1)
    assert c.session.info(sid)[1] is None


def test_tokens_get_what_their_rules_allow(consul_standin):
    consul_standin.acl_token = "mgmt"
    consul_standin.add_token("door", 'key_prefix "rewarm/" {\n  policy = "read"\n}\n'
                                     'service_prefix "rewarm-frontdoor" {\n  policy = "write"\n}\n'
                                     'service_prefix "" {\n  policy = "read"\n}\n'
                                     'node_prefix "" {\n  policy = "read"\n}\n')
    consul_standin.add_token("blind", 'service_prefix "" {\n  policy = "read"\n}\n')
    mgmt, door, blind = (client(consul_standin, t) for t in ("mgmt", "door", "blind"))
    mgmt.kv.put("rewarm/models/m", "{}")
    assert door.kv.get("rewarm/models/m")[1]["Value"] == b"{}"
    with pytest.raises(consul.ACLPermissionDenied):
        door.kv.put("rewarm/models/m", "x")                  # read only
    door.agent.service.register("rewarm-frontdoor", service_id="fd-1")
    with pytest.raises(consul.ACLPermissionDenied):
        door.agent.service.register("rewarm-agent", service_id="a-1")
    with pytest.raises(consul.ACLPermissionDenied):
        door.session.create(ttl=10)                           # no session rule
    assert [e["Service"]["ID"] for e in door.health.service("rewarm-frontdoor")[1]] == ["fd-1"]
    assert blind.health.service("rewarm-frontdoor")[1] == []  # filtered: no node:read
    r = requests.get(f"{consul_standin.url}/v1/kv/rewarm/models/m",
                     headers={"X-Consul-Token": "forged"}, timeout=5)
    assert r.status_code == 403 and r.text == "ACL not found"
