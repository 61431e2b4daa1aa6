"""The stand-ins follow the documented API where rewarm's correctness depends on it."""

import base64

import requests

from tests.cluster.standin_http import MAX_BODY_BYTES


def test_request_body_limit_at_and_over(consul_standin):
    url = f"{consul_standin.url}/v1/kv/big"
    assert requests.put(url, data=b"x" * MAX_BODY_BYTES, timeout=5).status_code == 200
    assert requests.put(url, data=b"x" * (MAX_BODY_BYTES + 1), timeout=5).status_code == 413


def test_kv_cas_zero_only_creates(consul_standin):
    url = f"{consul_standin.url}/v1/kv/k"
    assert requests.put(url + "?cas=0", data=b"a", timeout=5).json() is True
    assert requests.put(url + "?cas=0", data=b"b", timeout=5).json() is False
    entry = requests.get(url, timeout=5).json()[0]
    assert base64.b64decode(entry["Value"]) == b"a"
    r = requests.get(f"{consul_standin.url}/v1/kv/missing", timeout=5)
    assert r.status_code == 404 and "X-Consul-Index" in r.headers


def test_session_ttl_range_and_default_lock_delay(consul_standin, consul_clock):
    base = consul_standin.url
    assert requests.put(f"{base}/v1/session/create", json={"TTL": "9s"},
                        timeout=5).status_code == 400
    sid = requests.put(f"{base}/v1/session/create", json={"TTL": "10s"}, timeout=5).json()["ID"]
    other = requests.put(f"{base}/v1/session/create", json={"TTL": "60s"},
                         timeout=5).json()["ID"]
    assert requests.put(f"{base}/v1/kv/lock?acquire={sid}", timeout=5).json() is True
    assert requests.put(f"{base}/v1/kv/lock?acquire={other}", timeout=5).json() is False
    consul_clock.advance(10.5)                # past its TTL, Consul still holds it...
    assert "Session" in requests.get(f"{base}/v1/kv/lock", timeout=5).json()[0]
    consul_clock.advance(9.5)                 # ...until 2 x TTL (session_ttl.go): released
    assert "Session" not in requests.get(f"{base}/v1/kv/lock", timeout=5).json()[0]
    # ...but the default 15 s lock-delay keeps it from being taken at once
    assert requests.put(f"{base}/v1/kv/lock?acquire={other}", timeout=5).json() is False
    consul_clock.advance(15.0)
    assert requests.put(f"{base}/v1/kv/lock?acquire={other}", timeout=5).json() is True
    assert requests.put(f"{base}/v1/session/renew/{sid}", timeout=5).status_code == 404


def test_nomad_scale_needs_a_group_and_a_known_job(nomad_standin):
    base = nomad_standin.url
    job = {"ID": "j", "TaskGroups": [{"Name": "g", "Count": 0}]}
    # no task: Job.Validate refuses it, an uncoded RPC error, so 500 (errCodeFromHandler)
    r = requests.post(f"{base}/v1/jobs", json={"Job": job}, timeout=5)
    assert r.status_code == 500 and "Missing tasks for task group" in r.text
    job["TaskGroups"][0]["Tasks"] = [{"Name": "t", "Driver": "exec"}]
    assert requests.post(f"{base}/v1/jobs", json={"Job": job}, timeout=5).status_code == 200
    assert requests.post(f"{base}/v1/job/j/scale", json={"Count": 1},
                         timeout=5).status_code == 400
    assert requests.post(f"{base}/v1/job/nope/scale", json={"Count": 1, "Target": {"Group": "g"}},
                         timeout=5).status_code == 404
    ok = requests.post(f"{base}/v1/job/j/scale", json={"Count": 2, "Target": {"Group": "g"}},
                       timeout=5).json()
    assert set(ok) == {"EvalID", "EvalCreateIndex", "Index", "JobModifyIndex", "Warnings"}
    status = requests.get(f"{base}/v1/job/j/scale", timeout=5).json()
    assert status["TaskGroups"]["g"]["Desired"] == 2
