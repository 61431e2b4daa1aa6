"""Steps of bench/cluster_e2e.py that probe what the real servers refuse: every job through
HashiCorp's HCL2 parser and Nomad's validation, an invalid job's registration, and a burst
that needs a second replica while the first is still being placed.

The burst: Nomad refuses a scale while a deployment is active (``Job.Scale``), and a service
job with an update strategy starts one on every count change (see
tests/cluster/nomad_deployments.py).  jobs/rewarm-replica.nomad.hcl opts out (``update {
max_parallel = 0 }``), so the second scale-up of a burst is accepted at once; this step
measures that (``second_scale_during_deployment_s``: from the front door's first scale-up
to Nomad accepting the count of 2, asked for 1 s after the first) and how soon the second
replica serves after it was asked for (``burst_second_replica_s``).
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from bench.cluster_e2e_io import (MODEL, REPO, Cluster, Run, StepFailed, Traffic, timed_request,
                                  wait_for)

REPLICA_JOB = f"rewarm-replica-{MODEL}"
SECOND_ASK_AFTER_S = 1.0        # the burst's second replica is asked for 1 s after the first
BURST_SCALE_LIMIT_S = 5.0       # target: the second scale accepted within 5 s of the first


def jobspec_step(run: Run, variables: dict[str, dict] | None) -> None:
    """Every file of jobs/ with pygohcl + Nomad's schema + validation (tests/cluster)."""
    from tests.cluster.nomad_validate import jobspec_check

    out = {}
    for path in sorted((REPO / "jobs").glob("*.nomad.hcl")):
        given = (variables or {}).get(path.name) or (
            {"model": MODEL} if path.name == "rewarm-replica.nomad.hcl" else {})
        out[path.name] = jobspec_check(path, given)
    run.results["jobspec_check"] = out
    bad = {f: r for f, r in out.items() if not r["parsed"] or r["unknown_arguments"]
           or r["validation_errors"]}
    run.step("every job parses with HashiCorp's HCL2, 0 unknown arguments, 0 validation errors",
             not bad and len(out) == 4, f"{len(out)} files; problems: {bad or 'none'}")


def invalid_registration_step(run: Run, cluster: Cluster, standin=None) -> None:
    """A job Nomad's validator refuses (reschedule delay 2 s), registered through rewarm's own
    scaler five ticks in a row: one registration request, one clear error."""
    from agent.clock import SystemClock
    from agent.cluster.jobs import replica_job
    from agent.cluster.nomad_http import nomad_client
    from agent.cluster.nomad_scaler import NomadScaler
    from agent.errors import ClusterError

    text = (REPO / "jobs" / "rewarm-replica.nomad.hcl").read_text()
    bad = text.replace('delay          = "5s"', 'delay          = "2s"', 1)
    assert bad != text
    model = "invalid-job"
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "rewarm-replica.nomad.hcl"
        template.write_text(bad)
        client = nomad_client(address=cluster.nomad_url, token=cluster.nh.get("X-Nomad-Token"))
        scaler = NomadScaler(client, clock=SystemClock(),
                             register_job=lambda m: replica_job(client, m, 2, template=template))
        before = len(standin.register_requests) if standin is not None else 0
        errors = []
        for _ in range(5):                         # five predictor ticks
            try:
                scaler.set_target(model, 1, reason="bench: invalid job")
            except ClusterError as exc:
                errors.append(exc)
            time.sleep(0.2)
    posts = None if standin is None else [
        r for r in standin.register_requests[before:] if r[1] == f"rewarm-replica-{model}"]
    first = errors[0] if errors else None
    run.results["invalid_job_registration"] = {
        "errors": len(errors), "same_error_each_tick": len({id(e) for e in errors}) == 1,
        "register_requests": None if posts is None else len(posts),
        "status": getattr(first, "status", None), "retryable": getattr(first, "retryable", None),
        "message": str(first)[:400] if first else None}
    ok = (len(errors) == 5 and first is not None and first.retryable is False
          and "registering job" in str(first) and "Delay cannot be less than 5s" in str(first)
          and (posts is None or posts == [(500, f"rewarm-replica-{model}")]))
    run.step("an invalid job's registration is answered once, clearly, no retry loop", ok,
             f"{len(errors)} ticks, {posts and len(posts)} registration request(s), "
             f"status {getattr(first, 'status', None)}: {str(first)[:160]}")


def burst_step(run: Run, cluster: Cluster, fd_address, token: str, standin=None) -> dict:
    """The next request restores from zero (the front door's scale-up to 1); 1 s later the
    burst arrives (three clients sending) and needs a second replica: rewarm's NomadScaler
    asks for 2, retrying each 0.25 s (a predictor tick) while Nomad refuses (the predictor,
    seeing the same demand, may ask first: either way the count of 2 is what is timed).
    Returns the timed request of the first."""
    from agent.clock import SystemClock
    from agent.cluster.nomad_http import nomad_client
    from agent.cluster.nomad_scaler import NomadScaler
    from agent.errors import ClusterError

    result: dict = {}
    first = threading.Thread(target=lambda: result.update(timed_request(fd_address, token)))
    first.start()

    def count() -> int:
        return int(cluster.nomad("GET", f"/v1/job/{REPLICA_JOB}")["TaskGroups"][0]["Count"])
    wait_for("the front door's scale-up", lambda: count() >= 1, 60, poll_s=0.02)
    first_at = time.monotonic()
    time.sleep(SECOND_ASK_AFTER_S)
    traffic = Traffic(fd_address, token, clients=3).start()
    client = nomad_client(address=cluster.nomad_url, token=cluster.nh.get("X-Nomad-Token"))
    scaler = NomadScaler(client, clock=SystemClock(), register_job=lambda m: {})
    refused = []
    while True:
        try:
            scaler.set_target(MODEL, 2, reason="bench: burst needs a second replica")
            break
        except ClusterError as exc:
            if not exc.retryable or time.monotonic() - first_at > 60:
                traffic.stop()
                raise StepFailed(f"second scale-up: {exc}") from exc
            refused.append(str(exc)[:120])
            time.sleep(0.25)
    asked_at = time.monotonic()
    second_scale_s = asked_at - first_at
    try:
        wait_for("two replicas serving", lambda: len(cluster.passing("rewarm-replica")) >= 2,
                 120, poll_s=0.05)
    finally:
        traffic.stop()
    second_s = time.monotonic() - asked_at
    first.join(timeout=120)
    deployments = cluster.nomad("GET", f"/v1/job/{REPLICA_JOB}/deployments") or []
    run.results["second_scale_during_deployment_s"] = round(second_scale_s, 3)
    run.results["burst_second_replica_s"] = round(second_s, 3)
    run.results["burst"] = {"asked_after_s": SECOND_ASK_AFTER_S, "refused": refused,
                            "deployments": len(deployments), "served": traffic.served,
                            "refused_cleanly": traffic.refused, "lost": traffic.lost}
    run.step("burst: a second replica within 5 s of the first scale-up",
             second_scale_s <= BURST_SCALE_LIMIT_S,
             f"count 2 accepted {second_scale_s:.2f}s after the first scale-up "
             f"({len(refused)} refusals, {len(deployments)} deployments); second replica "
             f"serving {second_s:.2f}s after it was asked for; burst traffic "
             f"{traffic.served} served, {traffic.refused} clean errors, {traffic.lost} lost")
    return result
