"""NomadScaler (python-nomad, unmodified) against the Nomad stand-in: every status path."""

import random

import pytest

from agent.clock import ManualClock
from agent.cluster.jobs import render_replica_job
from agent.cluster.nomad_scaler import NomadScaler, nomad_client
from agent.errors import AclDenied, ClusterError


def make(standin, token=None, namespace=None, region=None):
    clock = ManualClock()
    client = nomad_client(address=standin.url, token=token, namespace=namespace, region=region)
    scaler = NomadScaler(client, render_job=lambda m: render_replica_job(m, 4), clock=clock,
                         rng=random.Random(7))
    return scaler, clock


def test_404_registers_the_job_then_scales(nomad_standin):
    scaler, _ = make(nomad_standin)
    assert scaler.target("m") == 0                       # no job yet
    scaler.set_target("m", 2, reason="forecast needs 2")
    job = nomad_standin.job("rewarm-replica-m")
    assert job["TaskGroups"][0]["Count"] == 2
    assert job["TaskGroups"][0]["Scaling"] == {"Enabled": True, "Min": 0, "Max": 4,
                                               "Type": "horizontal"}
    ev = nomad_standin.events[-1]
    assert ev["Group"] == "replica" and ev["Message"] == "forecast needs 2"
    assert ev["Meta"]["rewarm.model"] == "m"
    assert scaler.target("m") == 2


def test_400_while_deployment_active_is_retryable(nomad_standin):
    scaler, _ = make(nomad_standin)
    scaler.set_target("m", 1, reason="up")
    nomad_standin.active_deployments.add("rewarm-replica-m")
    with pytest.raises(ClusterError) as err:
        scaler.set_target("m", 2, reason="up")
    assert err.value.status == 400 and err.value.retryable is True
    assert "deployment" in str(err.value)
    nomad_standin.active_deployments.clear()
    scaler.set_target("m", 2, reason="up")               # next tick succeeds
    assert nomad_standin.job("rewarm-replica-m")["TaskGroups"][0]["Count"] == 2


def test_400_over_scaling_max_is_not_retryable(nomad_standin):
    scaler, _ = make(nomad_standin)
    with pytest.raises(ClusterError) as err:
        scaler.set_target("m", 5, reason="too many")     # template max is 4
    assert err.value.status == 400 and err.value.retryable is False
    scaler.set_target("m", 4, reason="at max")           # at the limit: accepted


def test_403_is_a_clear_acl_error(nomad_standin):
    nomad_standin.acl_token = "right"
    scaler, _ = make(nomad_standin, token="wrong")
    with pytest.raises(AclDenied) as err:
        scaler.set_target("m", 1, reason="up")
    assert err.value.status == 403 and "NOMAD_TOKEN" in str(err.value)
    assert err.value.endpoint == "/v1/job/rewarm-replica-m/scale"
    ok, _ = make(nomad_standin, token="right")
    ok.set_target("m", 1, reason="up")


@pytest.mark.parametrize("status", [429, 500, 502, 503])
def test_429_and_5xx_back_off_with_jitter(nomad_standin, status):
    scaler, clock = make(nomad_standin)
    nomad_standin.fail_next(status, "/v1/job/", times=2)
    with pytest.raises(ClusterError) as first:
        scaler.set_target("m", 1, reason="up")
    assert first.value.retryable and first.value.status == status
    assert 0.5 <= first.value.retry_after_s <= 1.0        # base 1 s, jitter in [0.5, 1]
    with pytest.raises(ClusterError) as held:             # inside the back-off: no request
        scaler.set_target("m", 1, reason="up")
    assert "backing off" in str(held.value)
    n_requests = len(nomad_standin.requests)
    clock.advance(first.value.retry_after_s)
    with pytest.raises(ClusterError) as second:
        scaler.set_target("m", 1, reason="up")
    assert len(nomad_standin.requests) == n_requests + 1
    assert 1.0 <= second.value.retry_after_s <= 2.0       # doubled step
    clock.advance(second.value.retry_after_s)
    scaler.set_target("m", 1, reason="up")
    assert nomad_standin.job("rewarm-replica-m")["TaskGroups"][0]["Count"] == 1


def test_connection_refused_backs_off(nomad_standin):
    nomad_standin.stop()
    scaler, _ = make(nomad_standin)
    with pytest.raises(ClusterError) as err:
        scaler.set_target("m", 1, reason="up")
    assert err.value.retryable and err.value.status is None


def test_namespace_and_region_are_sent(nomad_standin):
    scaler, _ = make(nomad_standin, namespace="serving", region="eu")
    scaler.set_target("m", 1, reason="up")
    scale_posts = [q for m, p, q in nomad_standin.requests if p.endswith("/scale")]
    assert all(q.get("namespace") == "serving" and q.get("region") == "eu"
               for q in scale_posts)
    assert nomad_standin.job("rewarm-replica-m", namespace="serving") is not None


def test_publishes_cached_snapshots_as_node_metadata(nomad_standin):
    scaler, _ = make(nomad_standin)
    out = scaler.publish_cached_snapshots(["b", "a", "a"], node_id="standin-node")
    assert out["Meta"]["rewarm_snapshots"] == "a,b"
    assert out["Static"] == {"gpu": "none"}
    out = scaler.publish_cached_snapshots([], node_id="standin-node")
    assert "rewarm_snapshots" not in out["Meta"]          # null unsets the key
    with pytest.raises(ClusterError):
        scaler.publish_cached_snapshots(["a"], node_id="no-such-node")
