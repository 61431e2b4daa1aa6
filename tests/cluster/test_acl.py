"""AclGate: a denial is replayed without a request during its back-off, logged once per
change, and shown in the rewarm_cluster_acl_denied gauge until a success clears it."""

import pytest
from prometheus_client import REGISTRY

from agent.clock import ManualClock
from agent.cluster.acl import AclGate
from agent.errors import AclDenied


def gauge(service):
    return REGISTRY.get_sample_value("rewarm_cluster_acl_denied", {"service": service})


def test_gate_replays_logs_once_and_clears(caplog):
    clock = ManualClock()
    gate = AclGate("testsvc", clock=clock, backoff_s=10.0)
    gate.check()                                          # nothing stored: no error
    err = AclDenied("consul: denied /v1/x", service="consul", status=403, endpoint="/v1/x")
    gate.denied(err)
    gate.denied(err)                                      # the same text: not logged again
    assert gauge("testsvc") == 1.0
    with pytest.raises(AclDenied) as replay:
        gate.check()
    assert replay.value.retry_after_s == 10.0 and "not asking again" in str(replay.value)
    clock.advance(10.0)
    gate.check()                                          # back-off over: the caller asks
    gate.denied(AclDenied("consul: denied /v1/y", service="consul", status=403,
                          endpoint="/v1/y"))             # a new text: logged
    assert sum(r.levelname == "ERROR" for r in caplog.records) == 2
    gate.ok()
    assert gauge("testsvc") == 0.0 and gate.error is None
