"""An in-process Nomad HTTP API stand-in, written from Nomad's documented HTTP API.

Covers what rewarm uses: ``GET/POST /v1/job/:job_id`` and ``POST /v1/jobs`` (register,
body ``{"Job": {...}}``), ``GET/POST /v1/job/:job_id/scale`` (body ``Count``,
``Target: {"Group"}``, ``Message``, ``Meta``; reply ``EvalID``, ``EvalCreateIndex``,
``Index``, ``JobModifyIndex``, ``Warnings``), and dynamic node metadata
``GET/POST /v1/client/metadata`` (``Meta`` with null to unset; reply ``Meta``,
``Dynamic``, ``Static``).

Failure behaviour as documented: 400 while a deployment is active ("job scaling blocked
due to active deployment"), 400 for a count outside the group's ``Scaling`` Min/Max or an
unknown group, 403 "Permission denied" when ``acl_token`` is set and the
``X-Nomad-Token`` header differs, 404 "job not found"; ``fail_next(429 | 5xx)`` injects
rate limiting and server errors. ``queries`` keeps the query strings (namespace, region).
"""

from __future__ import annotations

import copy
import uuid

from tests.cluster.standin_http import Reply, StandIn


class NomadStandIn(StandIn):
    def __init__(self, acl_token: str | None = None) -> None:
        super().__init__()
        self.acl_token = acl_token
        self.index = 10
        self.jobs: dict[tuple[str, str], dict] = {}     # (namespace, id) -> job
        self.events: list[dict] = []                    # scaling requests accepted
        self.active_deployments: set[str] = set()       # job ids
        self.node_meta: dict[str, dict] = {"standin-node": {"Static": {"gpu": "none"},
                                                            "Dynamic": {}}}

    def job(self, job_id: str, namespace: str = "default") -> dict | None:
        with self.lock:
            return copy.deepcopy(self.jobs.get((namespace, job_id)))

    def _eval(self) -> dict:
        self.index += 1
        return {"EvalID": str(uuid.uuid4()), "EvalCreateIndex": self.index,
                "JobModifyIndex": self.index, "Index": self.index, "Warnings": ""}

    def route(self, method, path, query, body, headers):
        if self.acl_token is not None and headers.get("X-Nomad-Token") != self.acl_token:
            raise Reply(403, "Permission denied")
        ns = query.get("namespace", "default")
        with self.lock:
            if path == "/v1/jobs" and method in ("POST", "PUT"):
                return self._register(ns, None, body)
            if path == "/v1/client/metadata":
                return self._metadata(method, query, body)
            if path.startswith("/v1/job/"):
                job_id, _, sub = path[len("/v1/job/"):].partition("/")
                if sub == "" and method == "GET":
                    job = self.jobs.get((ns, job_id))
                    if job is None:
                        raise Reply(404, "job not found")
                    return copy.deepcopy(job)
                if sub == "" and method in ("POST", "PUT"):
                    return self._register(ns, job_id, body)
                if sub == "scale":
                    return self._scale(method, ns, job_id, body)
        raise Reply(404, f"no route for {method} {path}")

    def _register(self, ns, job_id, body):
        job = (body or {}).get("Job")
        if not isinstance(job, dict) or not job.get("ID"):
            raise Reply(400, "Job must be specified")
        if job_id is not None and job["ID"] != job_id:
            raise Reply(400, "Job ID does not match name")
        if not job.get("TaskGroups"):
            raise Reply(400, "Job must have at least one task group")
        job = copy.deepcopy(job)
        job.setdefault("Namespace", ns)
        out = self._eval()
        job["ModifyIndex"] = out["JobModifyIndex"]
        self.jobs[(ns, job["ID"])] = job
        return out

    def _scale(self, method, ns, job_id, body):
        job = self.jobs.get((ns, job_id))
        if job is None:
            raise Reply(404, "job not found")
        if method == "GET":
            return {"JobID": job_id, "Namespace": ns, "JobStopped": bool(job.get("Stop")),
                    "JobCreateIndex": job["ModifyIndex"], "JobModifyIndex": job["ModifyIndex"],
                    "TaskGroups": {g["Name"]: {"Desired": g.get("Count", 0), "Placed": 0,
                                               "Running": g.get("Count", 0), "Healthy": 0,
                                               "Unhealthy": 0, "Events": []}
                                   for g in job["TaskGroups"]}}
        if method not in ("POST", "PUT"):
            raise Reply(405, "method not allowed")
        group = ((body or {}).get("Target") or {}).get("Group")
        if not group:
            raise Reply(400, "missing task group name")
        tg = next((g for g in job["TaskGroups"] if g["Name"] == group), None)
        if tg is None:
            raise Reply(400, f"task group {group!r} specified for scaling does not exist in job")
        count = body.get("Count")
        if job_id in self.active_deployments and count is not None:
            raise Reply(400, "job scaling blocked due to active deployment")
        if count is not None:
            if not isinstance(count, int) or count < 0:
                raise Reply(400, "scaling action count can't be negative")
            scaling = tg.get("Scaling") or {}
            if scaling.get("Max") is not None and count > scaling["Max"]:
                raise Reply(400, "group count was greater than scaling policy maximum: "
                                 f"{count} > {scaling['Max']}")
            if scaling.get("Min") is not None and count < scaling["Min"]:
                raise Reply(400, "group count was less than scaling policy minimum: "
                                 f"{count} < {scaling['Min']}")
            tg["Count"] = count
        self.events.append({"Job": job_id, "Group": group, "Count": count,
                            "Message": body.get("Message", ""), "Meta": body.get("Meta")})
        out = self._eval()
        job["ModifyIndex"] = out["JobModifyIndex"]
        return out

    def _metadata(self, method, query, body):
        node = query.get("node_id") or "standin-node"
        meta = self.node_meta.get(node)
        if meta is None:
            raise Reply(404, f"Unknown node {node}")
        if method in ("POST", "PUT"):
            for k, v in ((body or {}).get("Meta") or {}).items():
                meta["Dynamic"][k] = v
        merged = dict(meta["Static"])
        for k, v in meta["Dynamic"].items():
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = v
        return {"Meta": merged, "Dynamic": dict(meta["Dynamic"]), "Static": dict(meta["Static"])}
