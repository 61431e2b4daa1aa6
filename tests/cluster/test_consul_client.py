"""The Consul client against the stand-in on the edge cases of real servers: index 0, an index
going backwards, 401/403, Retry-After, bad names, the TLS environment variables."""

import pytest

from agent.clock import ManualClock
from agent.cluster.base import ServiceInstance
from agent.cluster.consul_http import consul_client, next_index
from agent.cluster.consul_registry import ConsulRegistry
from agent.errors import AclDenied, ClusterError, ConfigError


def registry(standin, **kw):
    clock = ManualClock(100.0)
    slept = []

    def sleep(s):
        slept.append(s)
        clock.advance(s)
    reg = ConsulRegistry(consul_client(f"127.0.0.1:{standin.port}"), clock=clock, sleep=sleep,
                         **kw)
    return reg, clock, slept


@pytest.mark.parametrize("sent,got,want", [(None, 0, 1), (None, "0", 1), (5, 0, 1), (5, 3, 0),
                                           (5, 5, 5), (5, 9, 9), (None, None, 1), (0, 0, 1),
                                           (None, "garbage", 1)])
def test_next_index_rules(sent, got, want):
    assert next_index(sent, got) == want


def test_index_zero_is_read_at_most_twice_a_second(consul_standin):
    reg, clock, slept = registry(consul_standin)
    consul_standin.index_zero = True
    index = None
    for _ in range(6):
        index, _ = reg.watch("rewarm-replica", index=index, wait_s=5)
        assert index == 1
    # five blocking reads after the first, each paced to 0.5 s after the previous one
    assert slept == [0.5] * 5
    assert (6 - 1) / (clock.now() - 100.0) <= 2.0 + 1e-9   # reads per second, paced


def test_an_index_going_backwards_resets_the_watch(consul_standin, monkeypatch):
    reg, _, _ = registry(consul_standin)
    index, _ = reg.watch("rewarm-replica")
    consul_standin.index = 3                       # the server's index dropped (a restore)
    assert reg.watch("rewarm-replica", index=index + 10, wait_s=1)[0] == 0


def test_acl_denial_is_surfaced_once_and_not_retried_in_the_backoff(consul_standin, caplog):
    reg, clock, _ = registry(consul_standin, acl_backoff_s=60.0)
    consul_standin.fail_next(403, "/v1/health/", body="Permission denied")
    with pytest.raises(AclDenied) as err:
        reg.watch("rewarm-replica")
    assert err.value.status == 403 and "CONSUL_HTTP_TOKEN" in str(err.value)
    n = len(consul_standin.requests)
    for _ in range(10):
        clock.advance(1.0)
        with pytest.raises(AclDenied):
            reg.healthy("rewarm-replica")
    assert len(consul_standin.requests) == n
    assert sum(r.levelname == "ERROR" for r in caplog.records) == 1
    assert reg.acl.error is not None
    clock.advance(60.0)
    assert reg.healthy("rewarm-replica") == []       # asked again, accepted: cleared
    assert reg.acl.error is None


def test_401_is_an_acl_denial(consul_standin):
    reg, _, _ = registry(consul_standin)
    consul_standin.fail_next(401, "/v1/health/", body="ACL support disabled")
    with pytest.raises(AclDenied) as err:
        reg.healthy("rewarm-replica")
    assert err.value.status == 401


def test_retry_after_is_read_and_bounded(consul_standin):
    reg, _, _ = registry(consul_standin)
    consul_standin.fail_next(429, "/v1/health/", headers={"Retry-After": "7"})
    with pytest.raises(ClusterError) as err:
        reg.healthy("rewarm-replica")
    assert err.value.status == 429 and err.value.retryable and err.value.retry_after_s == 7.0
    consul_standin.fail_next(503, "/v1/health/", headers={"Retry-After": "99999"})
    with pytest.raises(ClusterError) as err:
        reg.healthy("rewarm-replica")
    assert err.value.retry_after_s == 60.0


def test_a_timeout_keeps_its_cause(consul_standin, monkeypatch):
    import agent.cluster.consul_http as ch

    monkeypatch.setattr(ch, "TIMEOUT_S", 0.2)
    consul_standin.delay_s = 1.0
    reg = ConsulRegistry(consul_client(f"127.0.0.1:{consul_standin.port}"))
    with pytest.raises(ClusterError) as err:
        reg.healthy("rewarm-replica")
    assert "Timeout" in str(err.value) and err.value.retryable


@pytest.mark.parametrize("bad", [None, "", "a/../../acl/bootstrap", "m#frag", "x?y", "..",
                                 "x" * 129, 3])
def test_names_and_ids_are_checked_before_a_url_is_built(consul_standin, bad):
    reg, _, _ = registry(consul_standin)
    with pytest.raises(ConfigError):
        reg.watch(bad)
    with pytest.raises(ConfigError):
        reg.pass_ttl(bad)
    with pytest.raises(ConfigError):
        reg.deregister(bad)
    with pytest.raises(ConfigError):
        reg.register(ServiceInstance("rewarm-replica", bad, "127.0.0.1", 1), ttl_s=5)
    assert consul_standin.requests == []


def test_tls_environment_is_honoured(monkeypatch, tmp_path):
    for k in ("CONSUL_HTTP_ADDR", "CONSUL_HTTP_SSL", "CONSUL_HTTP_SSL_VERIFY", "CONSUL_CACERT",
              "CONSUL_CAPATH", "CONSUL_CLIENT_CERT", "CONSUL_CLIENT_KEY", "CONSUL_HTTP_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CONSUL_HTTP_ADDR", "consul.example:8501")
    monkeypatch.setenv("CONSUL_HTTP_SSL", "true")
    monkeypatch.setenv("CONSUL_CACERT", str(tmp_path / "ca.pem"))
    monkeypatch.setenv("CONSUL_CLIENT_CERT", str(tmp_path / "c.pem"))
    monkeypatch.setenv("CONSUL_CLIENT_KEY", str(tmp_path / "k.pem"))
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", "t0k")
    c = consul_client()
    assert c.http.base_uri == "https://consul.example:8501"
    assert c.http.verify == str(tmp_path / "ca.pem")
    assert c.http.cert == (str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))
    assert c.token == "t0k"
    monkeypatch.setenv("CONSUL_HTTP_SSL_VERIFY", "false")
    assert consul_client().http.verify is False
    monkeypatch.setenv("CONSUL_HTTP_ADDR", "http://plain:8500")   # an explicit scheme wins
    assert consul_client().http.base_uri == "http://plain:8500"
    monkeypatch.delenv("CONSUL_HTTP_SSL")
    assert consul_client("h:1").http.base_uri == "http://h:1"


@pytest.mark.parametrize("header,expected", [
    ("nan", None), ("-nan", None), ("soon", None),
    ("Fri, 01 Jan 2100 00:00:00 GMT", 60.0),     # an HTTP-date (RFC 9110 10.2.3), bounded
    ("Thu, 01 Jan 1970 00:00:00 GMT", 0.0),      # in the past: now
])
def test_retry_after_garbage_nan_and_http_dates(consul_standin, header, expected):
    reg, _, _ = registry(consul_standin)
    consul_standin.fail_next(503, "/v1/health/", headers={"Retry-After": header})
    with pytest.raises(ClusterError) as err:
        reg.healthy("rewarm-replica")
    assert err.value.retry_after_s == expected
