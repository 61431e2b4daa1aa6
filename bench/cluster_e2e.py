"""The cluster path end to end on three hosts: Nomad job submission, scale from zero, Consul
discovery, served, scale in after a durable snapshot, restore on the caching node, a burst
needing a second replica, a node agent killed, the leader predictor killed; with the jobs
checked by HashiCorp's HCL2 parser and Nomad's validation, an invalid job's registration,
and ACLs enforced on both servers.

    python bench/cluster_e2e.py --json bench/results/cluster_e2e.json      # stand-ins
    CONSUL_HTTP_ADDR=... NOMAD_ADDR=... python bench/cluster_e2e.py --real  # real servers

Stand-in mode: three hosts are network namespaces joined by veth pairs to a bridge
(tests/cluster/hosts.py; distinct 127.0.0.x addresses where namespaces are unavailable; the
output says which ran).  The Consul and Nomad stand-ins of tests/cluster listen on the
bridge and behave as the servers do where rewarm depends on it (each cites the source it
follows): HCL2 parsing and validation, deployments, 2 x TTL sessions tied to checks, ACL
policies for every token.  Nomad's places allocations on the three nodes (one fake GPU
each; raw_exec enabled, as the clients must) and runs their tasks in the nodes'
namespaces.  Every rewarm process is what an operator runs: the four jobs in jobs/ are
parsed by Nomad (``POST /v1/jobs/parse``) and registered; the node agents (system job),
the front door and two predictors are allocations, each with its workload identity bound to
the policy in jobs/acl/ and its Consul token rendered from Nomad Variables; replicas are
allocations of ``rewarm-replica-tiny`` (the synthetic ``tiny`` preset, so the scenario fits
two loaded cores).  Each step is asserted; the run prints a timeline and writes JSON:
``steps`` ([{name, ok, at_s, detail}]), ``first_token_via_nomad_s`` (request to first token
for the restore from zero through Nomad), ``restore_s`` (that restore as the node agent
timed it, from the allocation's ``rewarm hold`` line), ``first_token_cold_s``, ``requests``,
``lost``, ``leader_failover_s`` (kill -9 of the leader to a new session holding the lock),
``watch_requests_per_s_at_index_0``, ``hosts``, ``jobspec_check`` ({file: {parsed,
unknown_arguments, validation_errors}}), ``second_scale_during_deployment_s``,
``burst_second_replica_s``, ``invalid_job_registration``, ``acl_enforced``, ``meta``.

Targets: every job parses with 0 unknown arguments and 0 validation errors;
first_token_via_nomad_s <= restore_s + 1.5; the burst's second scale accepted within 5 s of
the first and its replica serving <= restore_s + 3 s after it was asked for; 0 lost across
the node kill; leader_failover_s <= 12 s (Consul would keep a dead leader's session for
2 x TTL = 20 s without the check the lock is tied to); the invalid job answered once;
watch_requests_per_s_at_index_0 <= 2; ACLs enforced; the whole scenario within 5 minutes.

``--real`` runs the same steps against the servers named by ``CONSUL_HTTP_ADDR`` and
``NOMAD_ADDR`` (and their tokens, management or the union of the jobs' policies) with the
four jobs submitted (the predictor with ``-var gpu_cost_per_hour=1000000`` or the idle step
waits out a long keep-alive) and ``REWARM_TENANT_TOKEN`` a front-door token; it skips what
needs this machine's control of the hosts (killing a node agent, killing the leader's
process, the index-0 fault) and says so in ``notes``.  It has not been run against real
servers here (none are installable).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import requests  # noqa: E402

from agent.errors import RewarmError  # noqa: E402
from bench.cluster_e2e_cast import real_cast, standin_cast  # noqa: E402
from bench.cluster_e2e_io import (MODEL, Cluster, Run, StepFailed, Traffic,  # noqa: E402
                                  hold_lines, timed_request, wait_for)
from bench.cluster_e2e_steps import (burst_step, invalid_registration_step,  # noqa: E402
                                     jobspec_step)

REPLICA_JOB = f"rewarm-replica-{MODEL}"
LOCK_TTL_S = 10.0          # agent/cluster/leader.py's default session TTL (Consul's minimum)
CHECK_TTL_S = 3.0          # ... and the TTL of the check the session is tied to
SESSION_TTL_MULTIPLIER = 2  # Consul: agent/consul/session_ttl.go
FAILOVER_LIMIT_S = 12.0
TICK_S = 1.0
SCENARIO_LIMIT_S = 300.0


def measure_index_zero(consul_standin, seconds: float = 4.0) -> tuple[float, dict]:
    """Blocking reads of rewarm-replica per second per front door (client address) while
    Consul answers ``X-Consul-Index: 0``: (the highest rate, every front door's rate)."""
    path = "/v1/health/service/rewarm-replica"
    start = len(consul_standin.peers)
    consul_standin.index_zero = True
    time.sleep(seconds)
    consul_standin.index_zero = False
    counts: dict[str, int] = {}
    for peer, p in list(consul_standin.peers)[start:]:
        if p == path:
            counts[peer] = counts.get(peer, 0) + 1
    rates = {peer: n / seconds for peer, n in counts.items()}
    return max(rates.values(), default=0.0), rates


def scenario(run: Run, cluster: Cluster, fd_address, token: str, *, standin=None,
             consul_standin=None) -> None:
    """The steps after the cast is up (both modes)."""
    jobspec_step(run, run.results.get("job_variables"))
    invalid_registration_step(run, cluster, standin)
    # 1. the replica job at count 0
    job = cluster.nomad("GET", f"/v1/job/{REPLICA_JOB}")
    count = job["TaskGroups"][0]["Count"]
    run.step("job submitted at count 0", count == 0 and not cluster.running(REPLICA_JOB),
             f"{REPLICA_JOB} count={count}, running allocations 0")

    # 2-4. first request -> scale from zero through Nomad -> served (a cold boot: no snapshot)
    cold = timed_request(fd_address, token)
    run.results["first_token_cold_s"] = round(cold["first_token_s"], 3)
    scaled = [e for e in (standin.events if standin else []) if e["Job"] == REPLICA_JOB]
    count_now = cluster.nomad("GET", f"/v1/job/{REPLICA_JOB}")["TaskGroups"][0]["Count"]
    run.step("first request scales from zero through Nomad",
             (standin is None and count_now >= 1) or any(
                 e["Count"] == 1 and "front door" in e["Message"] for e in scaled),
             f"scale events {[(e['Count'], e['Message'][:30]) for e in scaled]}")
    allocs = cluster.running(REPLICA_JOB)
    run.step("served by a Nomad allocation", cold["first_token_s"] is not None and
             len(allocs) == 1, f"first token {cold['first_token_s']:.2f}s, path "
             f"{cold['done'].get('path')}, allocation on {allocs[0]['NodeName'] if allocs else '-'}")
    first_node = allocs[0]["NodeName"]

    # 5-7. idle -> durable snapshot -> scale in by the predictor
    summary = wait_for("snapshot durable", lambda: (lambda v: v if v and v["Value"] and json.loads(
        v["Value"]).get("durable") else None)(cluster.kv(f"rewarm/snapshots/{MODEL}")), 120)
    snap = json.loads(summary["Value"])
    run.step("snapshot durable", snap["status"] == "ready" and snap["durable"],
             f"{snap['snapshot_id']} on {snap['node']}")
    if standin is not None:
        meta = wait_for("node metadata", lambda: [n.name for n in standin.nodes.values()
                                                  if MODEL in (n.merged_meta().get(
                                                      "rewarm_snapshots") or "").split(",")], 30)
        run.step("caching node publishes the snapshot in Nomad node metadata", meta == [first_node],
                 f"rewarm_snapshots={MODEL} on {meta}")
    # scaled in: count 0 and the allocation stopped (its device is free only then)
    wait_for("scale in", lambda: cluster.nomad("GET", f"/v1/job/{REPLICA_JOB}")[
        "TaskGroups"][0]["Count"] == 0 and not [a for a in cluster.allocs(REPLICA_JOB)
                                                if a["ClientStatus"] in ("pending", "running")],
             150, poll_s=0.5)
    reasons = [e["Message"] for e in (standin.events if standin else []) if e["Count"] == 0]
    run.step("idle: the predictor scales in after the snapshot is durable", True,
             f"count 0 ({reasons[-1][:40] if reasons else 'real Nomad'})")
    wait_for("replica deregistered", lambda: not cluster.passing("rewarm-replica"), 30)

    # 8. the next request restores on the caching node; the burst asks for a second replica
    warm = burst_step(run, cluster, fd_address, token, standin)
    # the first of the running allocations is the one the front door's scale-up placed
    allocs = sorted(cluster.running(REPLICA_JOB), key=lambda a: a["CreateIndex"])
    node = allocs[0]["NodeName"] if allocs else "-"
    restore_s = None
    if standin is not None and allocs:
        # `rewarm hold` prints its line once the node agent's restore op has answered, which
        # may be after the replica registered and served this request: wait for it
        def hold_line():
            return [h for h in hold_lines(standin, REPLICA_JOB)
                    if h["alloc_id"] == allocs[0]["ID"]]
        try:
            lines = wait_for("the restored allocation's hold line", hold_line, 20.0)
        except StepFailed:
            lines = []
        restore_s = lines[0]["restore_s"] if lines else None
        path = lines[0]["path"] if lines else None
    elif standin is not None:
        path = None
    else:
        path = warm["done"].get("path")
    run.results["first_token_via_nomad_s"] = round(warm["first_token_s"], 3)
    run.results["restore_s"] = None if restore_s is None else round(restore_s, 3)
    run.step("next request restores on the caching node",
             node == first_node and path in ("restore", "snapshot_restore"),
             f"on {node} (cached on {first_node}), path {path}, first token "
             f"{warm['first_token_s']:.2f}s, agent restore {restore_s}")

    if standin is None:
        run.notes.append("skipped against real servers: kill -9 of a node agent, kill of the "
                         "leader predictor's process, the index-0 fault (this machine does not "
                         "control the real hosts)")
        return

    # 9. kill -9 the node agent under the replica while traffic runs
    traffic = Traffic(fd_address, token).start()
    time.sleep(2.0)
    victim = allocs[0]
    agent_alloc = next(a for a in cluster.running("rewarm-agent") if a["NodeID"] == victim["NodeID"])
    pid = standin.runner(agent_alloc["ID"]).proc.pid
    # Every replica allocation on the killed node: when the predictor scales in while the
    # node is down, Nomad's reconciler reschedules only the lost allocations the new count
    # keeps and stops the rest, so the one rescheduled need not be the victim itself.
    on_node = {a["ID"] for a in cluster.running(REPLICA_JOB) if a["NodeID"] == victim["NodeID"]}
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    def replacement():   # a running allocation whose reschedule chain starts on that node
        return [a for a in cluster.running(REPLICA_JOB)
                if ((a.get("RescheduleTracker") or {}).get("Events") or [{}])[0].get(
                    "PrevAllocID") in on_node]
    def moved_or_scaled_in():
        # the node's work rescheduled, or none of it wanted any more: every allocation that
        # was there is stopped and the job runs its (lower) count elsewhere
        found = replacement()
        if found:
            return found
        allocs_now = {a["ID"]: a for a in cluster.allocs(REPLICA_JOB)}
        count = cluster.count(REPLICA_JOB)
        running = cluster.running(REPLICA_JOB)
        if all(allocs_now.get(i, {}).get("DesiredStatus") == "stop" for i in on_node) \
                and count is not None and len(running) == count:
            return running or [{"NodeName": f"none (scaled in to count {count})"}]
        return None
    try:
        moved = wait_for("allocation rescheduled", moved_or_scaled_in, 120, poll_s=0.25)
    except StepFailed as exc:   # say what Nomad held: the step is otherwise opaque
        raise StepFailed(f"{exc}; on the node at the kill: {sorted(on_node)}; count "
                         f"{cluster.count(REPLICA_JOB)}; allocations: "
                         f"{_alloc_summary(cluster.allocs(REPLICA_JOB))}") from None
    served_before = traffic.served
    wait_for("traffic served elsewhere", lambda: traffic.served > served_before + 2, 90)
    traffic.stop()
    burst = run.results.get("burst") or {}
    run.results["requests"] = (traffic.served + traffic.refused + traffic.lost
                               + burst.get("served", 0) + burst.get("refused_cleanly", 0)
                               + burst.get("lost", 0))
    run.results["lost"] = traffic.lost + burst.get("lost", 0)
    run.results["refused_cleanly"] = traffic.refused
    run.step("node agent killed: allocation rescheduled, traffic moves", traffic.lost == 0,
             f"agent pid {pid} on {victim['NodeName']} killed; replacement on "
             f"{moved[0]['NodeName']} after {time.monotonic() - killed_at:.1f}s; "
             f"{traffic.served} served, {traffic.refused} clean errors, {traffic.lost} lost"
             + (f" ({traffic.errors[:2]})" if traffic.errors else ""))

    # 10. kill -9 the leader predictor: its check goes critical CHECK_TTL_S after its last
    # pass, Consul invalidates the session with it, a standby takes the lock on its next tick
    held = cluster.kv("rewarm/predictor/leader")
    leader_alloc = held["Value"].decode()
    session = held.get("Session")
    runner = standin.runner(leader_alloc)
    os.kill(runner.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    new = wait_for("new leader", lambda: (lambda v: v if v and v.get("Session") and
                                          v["Session"] != session else None)(
        cluster.kv("rewarm/predictor/leader")), LOCK_TTL_S * 4, poll_s=0.05)
    failover = time.monotonic() - killed_at
    run.results["leader_failover_s"] = round(failover, 3)
    holder = new["Value"].decode()
    # Nomad restarts the killed task (restart policy, 2 s), so the lock may go to the standby
    # or to the restarted instance, whichever ticks first: a new session either way.
    who = "the restarted instance" if holder == leader_alloc else "the standby"
    run.results["new_leader"] = who
    run.results["leader_lock"] = {
        "session_ttl_s": LOCK_TTL_S, "check_ttl_s": CHECK_TTL_S,
        "consul_expiry_without_check_s": SESSION_TTL_MULTIPLIER * LOCK_TTL_S,
        "limit_s": FAILOVER_LIMIT_S}
    run.step("leader predictor killed: a new leader within 12 s (Consul's 2 x TTL is 20 s)",
             failover <= FAILOVER_LIMIT_S,
             f"{failover:.2f}s (limit {FAILOVER_LIMIT_S:.0f}s; the session's own timer would "
             f"fire at {SESSION_TTL_MULTIPLIER * LOCK_TTL_S:.0f}s, its {CHECK_TTL_S:.0f}s check "
             f"freed it); new session held by {who} ({leader_alloc[:8]} -> {holder[:8]})")

    # watch rate while Consul answers X-Consul-Index: 0
    rate, rates = measure_index_zero(consul_standin)
    doors = len(cluster.running("rewarm-frontdoor"))
    if run.results["hosts"]["kind"] == "loopback" and doors:
        # one source address for every host: the total shared by the front doors
        rate = sum(rates.values()) / doors
        rates = {f"mean of {doors} front doors": rate}
    run.results["watch_requests_per_s_at_index_0"] = round(rate, 2)
    run.step("watch at index 0 stays slow", rate <= 2.0 and bool(rates),
             f"{rate:.2f} requests/s at most, per front door {rates}")


SUMMARY_KEYS = ("first_token_cold_s", "first_token_via_nomad_s", "restore_s",
                "second_scale_during_deployment_s", "burst_second_replica_s", "requests", "lost",
                "leader_failover_s", "watch_requests_per_s_at_index_0", "acl_enforced")


def table(run: Run) -> str:
    lines = [f"{'at_s':>8}  {'ok':<4}  step", "-" * 72]
    for s in run.steps:
        lines.append(f"{s['at_s']:8.2f}  {'ok' if s['ok'] else 'FAIL':<4}  {s['name']}")
    lines.append("-" * 72)
    for key in SUMMARY_KEYS:
        lines.append(f"{key:>34}: {run.results.get(key)}")
    return "\n".join(lines)


def targets(r: dict) -> dict:
    restore = r.get("restore_s")
    checks = r.get("jobspec_check") or {}
    invalid = r.get("invalid_job_registration") or {}
    return {
        "every job: parsed, 0 unknown arguments, 0 validation errors": bool(checks) and all(
            c["parsed"] and not c["unknown_arguments"] and not c["validation_errors"]
            for c in checks.values()),
        "first_token_via_nomad_s <= restore_s + 1.5": _le(
            r.get("first_token_via_nomad_s"), None if restore is None else restore + 1.5),
        "second_scale_during_deployment_s <= 5": _le(
            r.get("second_scale_during_deployment_s"), 5.0),
        "burst_second_replica_s <= restore_s + 3": _le(
            r.get("burst_second_replica_s"), None if restore is None else restore + 3.0),
        "lost == 0": r.get("lost") == 0 if r.get("lost") is not None else None,
        "leader_failover_s <= 12 (Consul 2 x TTL = 20)": _le(r.get("leader_failover_s"),
                                                             FAILOVER_LIMIT_S),
        "invalid job answered once": (invalid.get("register_requests") in (1, None)
                                      and invalid.get("retryable") is False) if invalid else None,
        "watch_requests_per_s_at_index_0 <= 2": _le(
            r.get("watch_requests_per_s_at_index_0"), 2.0),
        "acl_enforced": r.get("acl_enforced")}


def run_scenario(*, real: bool = False, prefer_netns: bool = True,
                 work: Path | None = None, command: str = "") -> dict:
    """The whole scenario; returns the JSON document (``ok``: every step passed)."""
    run = Run()
    own = work is None
    work = Path(work or tempfile.mkdtemp(prefix="rewarm-e2e-"))
    closers = []
    error = None
    loadavg_start = os.getloadavg()
    try:
        if real:
            cluster, door, token = real_cast(run)
            scenario(run, cluster, door, token)
        else:
            cluster, door, token, closers, nomad, consul = standin_cast(run, work, prefer_netns,
                                                                        TICK_S)
            scenario(run, cluster, door, token, standin=nomad, consul_standin=consul)
    except (StepFailed, RewarmError, requests.RequestException, OSError) as exc:
        # RewarmError: a request refused (429, 503, 504) fails the step it was in, with the
        # timeline and the JSON still written, instead of a traceback
        error = f"{type(exc).__name__}: {exc}"
        if not run.steps or run.steps[-1]["ok"]:
            run.steps.append({"name": "scenario", "ok": False, "at_s": run.at(), "detail": error})
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # cleanup must go on
                run.notes.append(f"cleanup: {exc}")
        if own:
            shutil.rmtree(work, ignore_errors=True)
    total = run.at()
    ok = error is None and all(s["ok"] for s in run.steps) and total <= SCENARIO_LIMIT_S
    results = {k: v for k, v in run.results.items() if k != "job_variables"}
    results["acl_enforced"] = (results.get("acl") or {}).get("enforced")
    doc = {"ok": ok, "error": error, "total_s": total, "limit_s": SCENARIO_LIMIT_S,
           "steps": run.steps, "notes": run.notes, **results,
           "requests": results.get("requests"), "lost": results.get("lost"),
           "load_average": os.getloadavg()}
    doc["targets"] = targets(doc)
    doc["loadavg_start"] = " ".join(f"{x:.2f}" for x in loadavg_start)
    from bench.run_meta import run_meta

    doc["meta"] = run_meta()
    if command:
        doc["meta"]["command"] = command
    return decorate(doc)


def decorate(doc: dict) -> dict:
    """``title``, ``headline`` and ``tables`` for bench/render_docs.py, from the figures."""
    doc["title"] = ("The cluster path end to end on three hosts, against Consul and Nomad "
                    "stand-ins no kinder than the servers")
    doc["headline"] = [[k, doc.get(k)] for k in (
        "leader_failover_s", "second_scale_during_deployment_s", "first_token_via_nomad_s",
        "lost")]
    doc["tables"] = [
        {"title": "Figures", "columns": ["figure", "value"],
         "rows": [[k, doc.get(k)] for k in SUMMARY_KEYS]},
        {"title": "Targets", "columns": ["target", "met"],
         "rows": [[k, v] for k, v in doc["targets"].items()]},
        {"title": "Steps", "columns": ["at_s", "ok", "step"],
         "rows": [[s["at_s"], "ok" if s["ok"] else "FAIL", s["name"]] for s in doc["steps"]]},
        {"title": "Jobspec check (pygohcl + Nomad's schema and validation)",
         "columns": ["file", "parsed", "unknown_arguments", "validation_errors"],
         "rows": [[f, c["parsed"], len(c["unknown_arguments"]), len(c["validation_errors"])]
                  for f, c in (doc.get("jobspec_check") or {}).items()]}]
    return doc


def _le(a, b):
    return None if a is None or b is None else a <= b


def _alloc_summary(allocs: list[dict]) -> list[str]:
    """One short line per allocation: id prefix, node, client/desired status, the id its
    reschedule chain starts at."""
    out = []
    for a in allocs:
        prev = ((a.get("RescheduleTracker") or {}).get("Events") or [{}])[0].get("PrevAllocID")
        out.append(f"{a['ID'][:8]} {a.get('NodeName')} {a.get('ClientStatus')}/"
                   f"{a.get('DesiredStatus')}" + (f" from {prev[:8]}" if prev else ""))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--real", action="store_true",
                   help="against CONSUL_HTTP_ADDR / NOMAD_ADDR instead of the stand-ins")
    p.add_argument("--loopback", action="store_true",
                   help="distinct 127.0.0.x addresses instead of network namespaces")
    p.add_argument("--work", type=Path, help="keep state and task logs here (default: a "
                                             "temporary directory, removed)")
    args = p.parse_args(argv)
    command = "python bench/cluster_e2e.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("/"))
    out = run_scenario(real=args.real, prefer_netns=not args.loopback, work=args.work,
                       command=command.strip())
    print()
    run = Run(steps=out["steps"], results=out)
    print(table(run))
    for note in out["notes"]:
        print("note:", note)
    print(f"targets: {out['targets']}")
    print(f"hosts: {out.get('hosts')}; load average {out['load_average']}; total {out['total_s']}s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
