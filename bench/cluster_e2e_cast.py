"""The cast of bench/cluster_e2e.py: three hosts, the Consul and Nomad stand-ins with ACLs
enforced, the jobs of jobs/ registered through Nomad's parser (stand-in mode), or the real
servers named by the environment (``--real``)."""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

from bench.cluster_e2e_io import MODEL, REPO, Cluster, Run, wait_for

import requests

ACL_DIR = REPO / "jobs" / "acl"
TASK_JOBS = ("rewarm-agent", "rewarm-frontdoor", "rewarm-predictor")


def jobs_and_variables(work: Path, model: Path, consul_addr: str, nomad_url: str,
                       tokens: Path, tick_s: float) -> dict[str, dict]:
    """Each file of jobs/ with the variables the cast registers it with."""
    return {
        "rewarm-agent.nomad.hcl": {
            "consul_addr": consul_addr, "nomad_addr": nomad_url, "models_dir": str(model),
            # interpolated by Nomad on each node: one state directory per host
            "state_dir": str(work / "state") + "/${node.unique.name}",
            "remote_dir": str(work / "remote"), "threads": 1, "buffer_mib": 16},
        "rewarm-frontdoor.nomad.hcl": {
            "consul_addr": consul_addr, "nomad_addr": nomad_url, "tokens_file": str(tokens)},
        "rewarm-replica.nomad.hcl": {"model": MODEL, "max_replicas": 2},
        "rewarm-predictor.nomad.hcl": {
            "models": f"{MODEL}:0:2", "consul_addr": consul_addr, "nomad_addr": nomad_url,
            "tick_s": tick_s, "gpu_cost_per_hour": 1e6}}


def enforce_acls(consul, nomad) -> dict[str, str]:
    """ACLs on both stand-ins as an operator sets them up (docs/cluster.md, "ACL"): a
    management token for this script, each job's Nomad policy attached to its workload
    identity, each job's Consul token stored for its task in Nomad Variables.  Returns the
    management tokens."""
    mgmt = {"consul": secrets.token_hex(16), "nomad": secrets.token_hex(16)}
    consul.acl_token, nomad.acl_token = mgmt["consul"], mgmt["nomad"]
    for job in TASK_JOBS:
        nomad.apply_policy(job, (ACL_DIR / f"nomad-{job}.policy.hcl").read_text(), job_id=job)
        secret = secrets.token_hex(16)
        consul.add_token(secret, (ACL_DIR / f"consul-{job}.policy.hcl").read_text())
        key = ("default", f"nomad/jobs/{job}")
        items = nomad.variables.get(key, {"Items": {}})["Items"]
        nomad.variables[key] = {"Path": key[1], "Items": {**items, "consul_token": secret}}
    return mgmt


def acl_probe(cluster: Cluster) -> dict:
    """Both servers refuse a request without a token (403): ACLs are enforced."""
    consul = requests.get(cluster.consul_url + "/v1/kv/rewarm/models", timeout=5)
    nomad = requests.get(cluster.nomad_url + "/v1/job/rewarm-frontdoor", timeout=5)
    return {"consul_status_without_token": consul.status_code,
            "nomad_status_without_token": nomad.status_code,
            "enforced": consul.status_code == 403 and nomad.status_code == 403}


def standin_cast(run: Run, work: Path, prefer_netns: bool = True, tick_s: float = 1.0):
    """Hosts, stand-ins with ACLs, jobs registered; returns (cluster, fd address, token,
    closers, nomad, consul)."""
    from agent.replica.synthetic import make_synthetic
    from tests.cluster.consul_standin import ConsulStandIn
    from tests.cluster.hosts import make_hosts
    from tests.cluster.nomad_standin import NomadStandIn

    hosts = make_hosts(3, prefer_netns=prefer_netns)
    closers = [hosts.close]
    run.results["hosts"] = {"kind": hosts.kind, "reason": hosts.reason,
                            "addresses": [h.address for h in hosts.hosts]}
    print(f"hosts: {hosts.kind} {[h.address for h in hosts.hosts]} {hosts.reason}", flush=True)
    model = make_synthetic(work / "models" / MODEL, "tiny", seed=3)
    consul = ConsulStandIn(host=hosts.server_address).start()
    closers.append(consul.stop)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    for name in ("REWARM_CONTROL_TOKEN", "CONSUL_HTTP_TOKEN", "NOMAD_TOKEN"):
        env.pop(name, None)
    nomad = NomadStandIn(host=hosts.server_address, data_dir=work / "nomad", base_env=env).start()
    closers.insert(1, nomad.stop)        # tasks stop before the hosts go
    for h in hosts.hosts:
        # each client enables raw_exec (plugin "raw_exec" { config { enabled = true } }) and
        # runs the nvidia device plugin (two fake GPUs each here, so a burst's second replica
        # can restore on the node that caches the snapshot)
        nomad.add_node(h.name, h.address, netns=h.netns, node_class="gpu", gpus=2,
                       drivers=("exec", "raw_exec"))
    control_token, tenant_token = secrets.token_hex(16), secrets.token_hex(16)
    nomad.variables[("default", "nomad/jobs")] = {"Path": "nomad/jobs",
                                                   "Items": {"control_token": control_token}}
    nomad.variables[("default", "nomad/jobs/rewarm-predictor")] = {
        "Path": "nomad/jobs/rewarm-predictor", "Items": {"frontdoor_token": tenant_token}}
    mgmt = enforce_acls(consul, nomad)
    tokens = work / "tokens"
    tokens.write_text(f"bench:{tenant_token}\n")
    cluster = Cluster(consul.url, nomad.url, mgmt["consul"], mgmt["nomad"])
    run.results["acl"] = acl_probe(cluster)
    # an operator's policy for the model, read by the front door from the catalog
    cluster.consul("PUT", f"/v1/kv/rewarm/models/{MODEL}", data=json.dumps({"deadline_ms": 120000}))
    consul_addr = f"{consul.host}:{consul.port}"
    run.step("cast: hosts and stand-ins, ACLs enforced on both", run.results["acl"]["enforced"],
             f"{hosts.kind}; Consul {consul.url}, Nomad {nomad.url}; without a token: "
             f"Consul {run.results['acl']['consul_status_without_token']}, Nomad "
             f"{run.results['acl']['nomad_status_without_token']}")
    jobs = jobs_and_variables(work, model, consul_addr, nomad.url, tokens, tick_s)
    run.results["job_variables"] = jobs
    for file in ("rewarm-agent.nomad.hcl", "rewarm-frontdoor.nomad.hcl",
                 "rewarm-replica.nomad.hcl", "rewarm-predictor.nomad.hcl"):
        cluster.register(file, jobs[file])
    wait_for("three node agents in Consul", lambda: len(cluster.passing("rewarm-agent")) == 3, 180)
    doors = wait_for("a front door in Consul", lambda: cluster.passing("rewarm-frontdoor"), 120)
    wait_for("a predictor leader", lambda: (cluster.kv("rewarm/predictor/leader") or {}).get(
        "Session"), 120)
    wait_for("the front door knows the model", lambda: _knows(doors[0], tenant_token), 60)
    run.step("cast: 3 agents (system job), front door, 2 predictors as allocations", True,
             f"front door {doors[0]['Address']}:{doors[0]['Port']}")
    return cluster, (doors[0]["Address"], doors[0]["Port"]), tenant_token, closers, nomad, consul


def _knows(door: dict, token: str) -> bool:
    from agent.client import Client

    try:
        c = Client(door["Address"], door["Port"], token=token, timeout_s=5)
    except OSError:
        return False
    try:
        return MODEL in c.info("models")
    except OSError:
        return False
    finally:
        c.close()


def real_cast(run: Run):
    consul = os.environ.get("CONSUL_HTTP_ADDR")
    nomad = os.environ.get("NOMAD_ADDR")
    if not consul or not nomad:
        raise SystemExit("--real needs CONSUL_HTTP_ADDR and NOMAD_ADDR")
    scheme = "https" if os.environ.get("CONSUL_HTTP_SSL", "").lower() == "true" else "http"
    consul_url = consul if "://" in consul else f"{scheme}://{consul}"
    cluster = Cluster(consul_url, nomad, os.environ.get("CONSUL_HTTP_TOKEN"),
                      os.environ.get("NOMAD_TOKEN"))
    token = os.environ.get("REWARM_TENANT_TOKEN", "")
    try:
        cluster.nomad("GET", f"/v1/job/rewarm-replica-{MODEL}")
    except requests.HTTPError:
        cluster.register("rewarm-replica.nomad.hcl", {"model": MODEL, "max_replicas": 2})
    doors = wait_for("a front door in Consul", lambda: cluster.passing("rewarm-frontdoor"), 60)
    run.step("cast: real Consul and Nomad", True, f"{consul_url}, {nomad}")
    run.results["hosts"] = {"kind": "real", "reason": "", "addresses": []}
    run.results["acl"] = acl_probe(cluster)
    return cluster, (doors[0]["Address"], doors[0]["Port"]), token
