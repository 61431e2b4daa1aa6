"""NomadScaler (python-nomad, unmodified) against the Nomad stand-in: every status path."""

import random

import pytest

from agent.clock import ManualClock
from agent.cluster.jobs import replica_job
from agent.cluster.nomad_http import nomad_client
from agent.cluster.nomad_scaler import NomadScaler
from agent.errors import AclDenied, ClusterError, ConfigError


def make(standin, token=None, namespace=None, region=None):
    clock = ManualClock()
    client = nomad_client(address=standin.url, token=token, namespace=namespace, region=region)
    scaler = NomadScaler(client, register_job=lambda m: replica_job(client, m, 4), clock=clock,
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
    # a replica job with an update strategy (the template has none: max_parallel 0): each
    # count change starts a deployment, and Job.Scale refuses while it is active
    client = nomad_client(address=nomad_standin.url)
    job = replica_job(client, "m", 4)
    job["Update"] = job["TaskGroups"][0]["Update"] = {"MaxParallel": 1}
    client.jobs.register_job({"Job": job})
    scaler, _ = make(nomad_standin)
    scaler.set_target("m", 1, reason="up")
    dep = client.job.request("rewarm-replica-m", "deployment", method="get").json()
    assert dep["Status"] == "running" and dep["TaskGroups"]["replica"]["DesiredTotal"] == 1
    with pytest.raises(ClusterError) as err:
        scaler.set_target("m", 2, reason="up")
    assert err.value.status == 400 and err.value.retryable is True
    assert "job scaling blocked due to active deployment" in str(err.value)
    with nomad_standin.lock:                 # the deployment ends (no node: cancel it by hand)
        nomad_standin.deployments.by_id[dep["ID"]]["Status"] = "cancelled"
    scaler.set_target("m", 2, reason="up")               # next tick succeeds
    assert nomad_standin.job("rewarm-replica-m")["TaskGroups"][0]["Count"] == 2


def test_the_replica_template_starts_no_deployment_so_counts_move_freely(nomad_standin):
    scaler, _ = make(nomad_standin)
    for count in (1, 2, 3):
        scaler.set_target("m", count, reason="burst")
    client = nomad_client(address=nomad_standin.url)
    assert client.job.request("rewarm-replica-m", "deployments", method="get").json() == []
    assert nomad_standin.job("rewarm-replica-m")["Version"] == 3    # one version per scale


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


def test_403_is_surfaced_once_and_not_retried_every_tick(nomad_standin, caplog):
    nomad_standin.acl_token = "right"
    scaler, clock = make(nomad_standin, token="wrong")
    with pytest.raises(AclDenied):
        scaler.set_target("m", 1, reason="up")
    n = len(nomad_standin.requests)
    for _ in range(5):                                   # five more ticks inside the back-off
        clock.advance(1.0)
        with pytest.raises(AclDenied) as err:
            scaler.set_target("m", 1, reason="up")
        assert "not asking again" in str(err.value)
    assert len(nomad_standin.requests) == n              # no request made
    assert sum("denied" in r.message for r in caplog.records if r.levelname == "ERROR") == 1
    assert scaler.acl.error is not None
    clock.advance(300.0)
    with pytest.raises(AclDenied):
        scaler.set_target("m", 1, reason="up")           # asked again after the back-off
    assert len(nomad_standin.requests) == n + 1


def test_401_is_an_acl_denial_too(nomad_standin):
    scaler, _ = make(nomad_standin)
    nomad_standin.fail_next(401, "/v1/job/", body="ACL token not found")
    with pytest.raises(AclDenied) as err:
        scaler.set_target("m", 1, reason="up")
    assert err.value.status == 401


def test_retry_after_is_honoured_within_its_bound(nomad_standin):
    scaler, clock = make(nomad_standin)
    nomad_standin.fail_next(429, "/v1/job/", headers={"Retry-After": "20"})
    with pytest.raises(ClusterError) as err:
        scaler.set_target("m", 1, reason="up")
    assert err.value.retry_after_s == 20.0               # more than the 1 s first step
    clock.advance(20.0)
    nomad_standin.fail_next(503, "/v1/job/", headers={"Retry-After": "86400"})
    with pytest.raises(ClusterError) as err:
        scaler.set_target("m", 1, reason="up")
    assert err.value.retry_after_s == 60.0               # bounded


def test_a_timeout_names_its_cause(nomad_standin):
    nomad_standin.delay_s = 1.0
    client = nomad_client(address=nomad_standin.url, timeout_s=0.2)
    scaler = NomadScaler(client, register_job=lambda m: replica_job(client, m, 4),
                         clock=ManualClock())
    with pytest.raises(ClusterError) as err:
        scaler.set_target("m", 1, reason="up")
    assert "ReadTimeout" in str(err.value) and err.value.retryable


@pytest.mark.parametrize("model", [None, "", "a/../../acl/bootstrap", "m#frag", "m?x=1",
                                   "x" * 64, 7])
def test_model_names_are_checked_before_a_url_is_built(nomad_standin, model):
    scaler, _ = make(nomad_standin)
    with pytest.raises(ConfigError):
        scaler.set_target(model, 1, reason="up")
    with pytest.raises(ConfigError):
        scaler.target(model)
    assert nomad_standin.requests == []


def test_an_invalid_job_is_refused_once_naming_the_registration(nomad_standin, caplog):
    client = nomad_client(address=nomad_standin.url)

    def bad_job(model):
        job = replica_job(client, model, 4)
        job["TaskGroups"][0]["ReschedulePolicy"]["Delay"] = 2 * 10**9   # under Nomad's 5 s
        return job
    clock = ManualClock()
    scaler = NomadScaler(client, register_job=bad_job, clock=clock, job_error_backoff_s=300)
    with pytest.raises(ClusterError) as err:
        scaler.set_target("m", 1, reason="up")
    assert err.value.retryable is False and err.value.status == 500
    assert "registering job rewarm-replica-m (POST /v1/jobs) was refused" in str(err.value)
    assert "Delay cannot be less than 5s (got 2s)" in str(err.value)
    n = len(nomad_standin.requests)
    for _ in range(5):                                    # later ticks: answered from memory
        clock.advance(10.0)
        with pytest.raises(ClusterError) as again:
            scaler.set_target("m", 1, reason="up")
        assert again.value is err.value
    assert len(nomad_standin.requests) == n and nomad_standin.register_requests == [
        (500, "rewarm-replica-m")]
    assert sum("not registering" in r.message for r in caplog.records) == 1
    clock.advance(300.0)                                  # after the hold: asked again, once
    with pytest.raises(ClusterError):
        scaler.set_target("m", 1, reason="up")
    assert len(nomad_standin.register_requests) == 2


def test_a_transient_500_on_registration_is_retried_with_back_off(nomad_standin):
    scaler, clock = make(nomad_standin)
    nomad_standin.fail_next(500, "/v1/jobs", body="rpc error: No cluster leader")
    with pytest.raises(ClusterError) as err:
        scaler.set_target("m", 1, reason="up")
    assert err.value.retryable is True and err.value.retry_after_s
    clock.advance(err.value.retry_after_s)
    scaler.set_target("m", 1, reason="up")
    assert nomad_standin.job("rewarm-replica-m")["TaskGroups"][0]["Count"] == 1
