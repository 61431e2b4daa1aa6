"""The Nomad stand-in's ACL: a workload identity may do what the policies attached to its job
allow and nothing else (nomad_acl.py cites the source)."""

import pytest
import requests

from tests.cluster.nomad_acl import NomadAcl, PolicyError

ALLOC = {"ID": "a1", "Namespace": "default", "JobID": "rewarm-frontdoor", "TaskGroup": "g"}


def test_policy_words_expand_and_deny_wins():
    acl = NomadAcl("mgmt")
    acl.apply("p", 'namespace "default" {\n  policy = "read"\n  capabilities = ["scale-job"]\n}\n'
                   'node {\n  policy = "write"\n}\n', {"JobID": "rewarm-frontdoor"})
    acl.identities["wi"] = ("a1", "t")
    grant = acl.grant("wi", {"a1": ALLOC})
    assert grant.ns_allows("default", "read-job") and grant.ns_allows("default", "scale-job")
    assert not grant.ns_allows("default", "submit-job")
    assert not grant.ns_allows("other", "read-job")
    assert grant.node_allows(write=True)
    acl.apply("d", 'namespace "default" {\n  capabilities = ["deny"]\n}\n',
              {"JobID": "rewarm-frontdoor"})
    assert not acl.grant("wi", {"a1": ALLOC}).ns_allows("default", "read-job")
    with pytest.raises(PolicyError):
        acl.apply("bad", 'namespace "default" {', None)


def test_a_policy_applies_only_to_its_job_group_and_task():
    acl = NomadAcl("mgmt")
    acl.apply("other", 'namespace "default" {\n  policy = "write"\n}\n', {"JobID": "other"})
    acl.apply("task", 'namespace "default" {\n  policy = "write"\n}\n',
              {"JobID": "rewarm-frontdoor", "Group": "g", "Task": "not-t"})
    acl.identities["wi"] = ("a1", "t")
    assert acl.grant("wi", {"a1": ALLOC}).policies == []
    assert acl.grant("forged", {"a1": ALLOC}) is None        # not a token this server issued
    assert acl.grant("mgmt", {}).management


def test_endpoints_check_their_capability(nomad_standin):
    nomad_standin.acl_token = "mgmt"
    base, mgmt = nomad_standin.url, {"X-Nomad-Token": "mgmt"}
    job = {"ID": "j", "TaskGroups": [{"Name": "g", "Count": 0, "Scaling": {"Min": 0, "Max": 3},
                                      "Tasks": [{"Name": "t", "Driver": "exec"}]}],
           "Update": {"MaxParallel": 0}}
    assert requests.post(f"{base}/v1/jobs", json={"Job": job}, headers=mgmt,
                         timeout=5).status_code == 200
    with nomad_standin.lock:
        nomad_standin.allocs["a1"] = dict(ALLOC, JobID="caller", _job={}, _group={})
        nomad_standin.acl.identities["wi"] = ("a1", "t")
    wi = {"X-Nomad-Token": "wi"}
    scale = {"Count": 1, "Target": {"Group": "g"}}
    assert requests.post(f"{base}/v1/job/j/scale", json=scale, headers=wi,
                         timeout=5).status_code == 403               # no policy yet
    r = requests.put(f"{base}/v1/acl/policy/caller", headers=mgmt, timeout=5, json={
        "Rules": 'namespace "default" {\n  capabilities = ["scale-job", "read-job"]\n}\n',
        "JobACL": {"Namespace": "default", "JobID": "caller"}})
    assert r.status_code == 200
    assert requests.post(f"{base}/v1/job/j/scale", json=scale, headers=wi,
                         timeout=5).status_code == 200
    assert requests.get(f"{base}/v1/job/j", headers=wi, timeout=5).status_code == 200
    assert requests.post(f"{base}/v1/jobs", json={"Job": job}, headers=wi,
                         timeout=5).status_code == 403                # no submit-job
    assert requests.post(f"{base}/v1/jobs/parse", json={"JobHCL": "job \"x\" {}"}, headers=wi,
                         timeout=5).status_code == 403                # no parse-job
    assert requests.post(f"{base}/v1/client/metadata", json={"Meta": {}}, headers=wi,
                         timeout=5).status_code == 403                # no node write
    assert requests.put(f"{base}/v1/acl/policy/x", json={"Rules": ""}, headers=wi,
                        timeout=5).status_code == 403                 # management only
