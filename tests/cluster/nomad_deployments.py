"""Deployments as Nomad starts, watches and ends them (the Nomad stand-in; tests only).

Read from Nomad's source at the commit in ``nomad_schema.json``:

- **When one starts** (``scheduler/reconciler/reconcile_cluster.go``, ``createDeployment``):
  for a group whose update strategy is not empty (``structs.UpdateStrategy.IsEmpty``:
  ``MaxParallel == 0``) and whose desired total is not 0, unless a deployment for this job
  version exists already, or an allocation of this very job version runs and nothing is
  updated.  Every register and every ``Job.Scale`` writes a new job version
  (``nomad/state/state_store.go``, ``upsertJobImpl``: ``Version = existing.Version + 1``),
  so every count change to a non-zero count of a group with an update strategy starts one.
  A service job without an ``update`` block has ``api.DefaultUpdateStrategy`` (max_parallel
  1): it deploys too.  A newer version cancels the running deployment ("Cancelled due to
  newer version of job").
- **While it runs** ``Job.Scale`` answers 400 "job scaling blocked due to active deployment"
  (``nomad/job_endpoint.go``), checked in the stand-in's scale handler.
- **Health** (``client/allocrunner/health_hook.go``, ``health_check``): ``task_states`` is
  healthy once every task has run for ``min_healthy_time``; ``checks`` additionally needs the
  group's service checks passing, which this stand-in does not see (Nomad registers those
  services in Consul; the stand-in does not), so ``checks`` is judged as ``task_states`` -
  a kinder reading, written down here and in docs/cluster.md.  ``manual`` never becomes
  healthy.  An allocation not healthy by ``healthy_deadline``, or failed, is unhealthy.
- **How it ends** (``nomad/deploymentwatcher/deployment_watcher.go``): every group with
  ``HealthyAllocs >= DesiredTotal``: "successful", and the job version is marked stable; an
  unhealthy allocation: "failed" ("Failed due to unhealthy allocations"), and when the
  group has ``auto_revert`` the job is rolled back to its latest stable version (registered
  again as a new version: "rolling back to job version N"); with no stable version there is
  nothing to roll back to.
"""

from __future__ import annotations

import uuid

NS = 1e-9
ACTIVE = ("running", "pending", "paused", "blocked", "unblocking", "initializing")


def strategy_empty(update: dict | None) -> bool:
    """``structs.UpdateStrategy.IsEmpty``."""
    return update is None or int(update.get("MaxParallel") or 0) == 0


class Deployments:
    """Deployments of one stand-in; callers hold the stand-in's lock."""

    def __init__(self) -> None:
        self.by_id: dict[str, dict] = {}
        self.latest: dict[tuple[str, str], str] = {}      # (namespace, job id) -> id

    def latest_for(self, ns: str, job_id: str) -> dict | None:
        dep_id = self.latest.get((ns, job_id))
        return None if dep_id is None else self.by_id[dep_id]

    def active(self, job: dict) -> bool:
        """``deployment.Active() && deployment.JobCreateIndex == job.CreateIndex``."""
        dep = self.latest_for(job["Namespace"], job["ID"])
        return bool(dep and dep["Status"] in ACTIVE
                    and dep["JobCreateIndex"] == job["CreateIndex"])

    def new_version(self, job: dict, now_s: float) -> dict | None:
        """A new job version was written: cancel the running deployment, maybe start one."""
        old = self.latest_for(job["Namespace"], job["ID"])
        if old is not None and old["Status"] in ACTIVE:
            old["Status"] = "cancelled"
            old["StatusDescription"] = "Cancelled due to newer version of job"
        if job["Type"] != "service":
            return None     # the system scheduler's reconciler (reconcile_node.go) is not modelled
        groups = {}
        for tg in job["TaskGroups"]:
            update = tg.get("Update")
            if strategy_empty(update) or int(tg.get("Count", 0)) == 0:
                continue
            groups[tg["Name"]] = {
                "DesiredTotal": int(tg["Count"]), "PlacedAllocs": 0, "HealthyAllocs": 0,
                "UnhealthyAllocs": 0, "AutoRevert": bool(update.get("AutoRevert")),
                "_min_healthy_s": (update.get("MinHealthyTime") or 0) * NS,
                "_deadline_s": (update.get("HealthyDeadline") or 300e9) * NS,
                "_health_check": update.get("HealthCheck") or "checks"}
        if not groups:
            return None
        dep = {"ID": str(uuid.uuid4()), "Namespace": job["Namespace"], "JobID": job["ID"],
               "JobVersion": job["Version"], "JobCreateIndex": job["CreateIndex"],
               "JobModifyIndex": job["ModifyIndex"], "Status": "running",
               "StatusDescription": "Deployment is running", "TaskGroups": groups,
               "_started_s": now_s}
        self.by_id[dep["ID"]] = dep
        self.latest[(job["Namespace"], job["ID"])] = dep["ID"]
        return dep

    def watch(self, job: dict, allocs: list[dict], now_s: float) -> str | None:
        """Advance the job's running deployment; returns "successful", "failed" (and the
        caller rolls back when a failed group has AutoRevert) or None (still running)."""
        dep = self.latest_for(job["Namespace"], job["ID"])
        if dep is None or dep["Status"] != "running":
            return None
        failed = False
        for name, state in dep["TaskGroups"].items():
            mine = [a for a in allocs if a["TaskGroup"] == name
                    and a["_job"].get("Version") == dep["JobVersion"]]
            state["PlacedAllocs"] = len(mine)
            healthy = unhealthy = 0
            for a in mine:
                verdict = self._health(a, state, now_s)
                healthy += verdict == "healthy"
                unhealthy += verdict == "unhealthy"
            state["HealthyAllocs"], state["UnhealthyAllocs"] = healthy, unhealthy
            failed = failed or unhealthy > 0
        if failed:
            dep["Status"] = "failed"
            dep["StatusDescription"] = "Failed due to unhealthy allocations"
            return "failed"
        if all(s["HealthyAllocs"] >= s["DesiredTotal"] for s in dep["TaskGroups"].values()):
            dep["Status"] = "successful"
            dep["StatusDescription"] = "Deployment completed successfully"
            return "successful"
        return None

    @staticmethod
    def _health(alloc: dict, state: dict, now_s: float) -> str | None:
        if alloc["ClientStatus"] == "failed":
            return "unhealthy"
        started = alloc.get("_running_since_s")
        if state["_health_check"] != "manual" and alloc["ClientStatus"] == "running" \
                and started is not None and now_s - started >= state["_min_healthy_s"]:
            return "healthy"
        created = alloc.get("_created_s", now_s)
        if now_s - created > state["_deadline_s"]:
            return "unhealthy"
        return None

    def view(self, dep: dict) -> dict:
        return {k: v for k, v in dep.items() if not k.startswith("_")} | {
            "TaskGroups": {g: {k: v for k, v in s.items() if not k.startswith("_")}
                           for g, s in dep["TaskGroups"].items()}}
