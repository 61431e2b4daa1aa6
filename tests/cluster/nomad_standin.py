"""A Nomad HTTP API stand-in that validates, places, deploys and runs allocations (tests only).

Written from Nomad's HTTP API documentation (developer.hashicorp.com/nomad/api-docs) and
its source at the commit recorded in ``nomad_schema.json``:

- "Jobs": ``POST /v1/jobs/parse`` (``JobHCL``, ``Variables``, ``Canonicalize``; HashiCorp's
  HCL2 through pygohcl and the api structs' schema, ``nomad_jobspec.py``; 400 "Failed to
  parse job: ..."), ``POST /v1/jobs`` and ``POST /v1/job/:id`` (the job canonicalized as
  ``ApiJobToStructJob`` does, then ``Job.Validate``: an invalid job is answered 500 with
  Nomad's multierror text, ``nomad_validate.py``), ``GET/DELETE /v1/job/:id``,
  ``GET /v1/job/:id/allocations``, ``GET /v1/job/:id/deployments``,
  ``GET /v1/job/:id/deployment``, ``GET /v1/deployment/:id``;
- ``GET/POST /v1/job/:id/scale`` (``nomad/job_endpoint.go``, ``Job.Scale``: 404 for an
  unknown job, 400 for an unknown group, a negative count or one outside the group's
  ``Scaling`` Min/Max, 400 "job scaling blocked due to active deployment" while the latest
  deployment of this job is active; each accepted scale writes a new job version);
- "Allocations" ``GET /v1/allocation/:id``; "Nodes" ``GET /v1/nodes``, ``GET /v1/node/:id``;
  "Client" ``GET/POST /v1/client/metadata``; "Variables" ``PUT/GET/DELETE /v1/var/:path``;
- ACL (``nomad_acl.py``): with ``acl_token`` (the management token) set, every endpoint checks
  its capability; a workload identity holds only the policies attached to its job through
  ``PUT /v1/acl/policy/:name`` (``Rules``, ``JobACL``); others get 403 "Permission denied".

Jobs carry ``Version`` (+1 per register and per scale, ``upsertJobImpl``) and ``Stable``;
deployments start, succeed, fail and auto-revert as ``nomad_deployments.py`` describes.
The scheduler (``nomad_scheduler.py``) and the client half (``nomad_client.py``) run the
allocations.  Nodes are added by the test (``add_node``; a real client registers over
Nomad's RPC, which has no HTTP API); each fingerprints the drivers it is given (raw_exec only
when the test enables it, as a client's plugin config must).

Not modelled (docs/cluster.md lists them): regions, evaluations and their API, canaries and
promotion, the progress deadline, system-job deployments, Nomad registering services in Consul
(rewarm's services register themselves), ``checks`` health judged from Consul.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

from tests.cluster.nomad_acl import NomadAcl, PolicyError
from tests.cluster.nomad_client import ClientHalf
from tests.cluster.nomad_deployments import Deployments
from tests.cluster.nomad_jobspec import ParseError, canonicalize, parse_job
from tests.cluster.nomad_placement import Node
from tests.cluster.nomad_runner import TaskRunner
from tests.cluster.nomad_scheduler import Scheduler
from tests.cluster.nomad_validate import multierror, validate
from tests.cluster.standin_http import Reply, StandIn

DENIED = "Permission denied"


class NomadStandIn(StandIn):
    def __init__(self, acl_token: str | None = None, host: str = "127.0.0.1",
                 data_dir: Path | None = None, tick_s: float = 0.1,
                 base_env: dict[str, str] | None = None) -> None:
        super().__init__(host=host)
        self.acl = NomadAcl(acl_token)
        self.index = 10
        self.jobs: dict[tuple[str, str], dict] = {}     # (namespace, id) -> job
        self.versions: dict[tuple[str, str], list[dict]] = {}
        self.deployments = Deployments()
        self.events: list[dict] = []                    # scaling requests accepted
        self.register_requests: list[tuple[int, str]] = []   # (status, job id) per register
        self.nodes: dict[str, Node] = {}
        self.allocs: dict[str, dict] = {}
        self.runners: dict[str, list[TaskRunner]] = {}
        self.variables: dict[tuple[str, str], dict] = {}
        self.parse_requests: list[dict] = []
        self.base_env = dict(os.environ if base_env is None else base_env)
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="nomad-standin-"))
        self._tick_s = tick_s
        self._halt = threading.Event()
        self.client = ClientHalf(self)
        self.scheduler = Scheduler(self)
        self._thread_s = threading.Thread(target=self.scheduler.run, daemon=True,
                                          name="nomad-standin-scheduler")

    @property
    def acl_token(self) -> str | None:
        return self.acl.management_token

    @acl_token.setter
    def acl_token(self, token: str | None) -> None:
        self.acl.management_token = token

    # -- test-side controls ----------------------------------------------------------------
    def start(self):
        super().start()
        self._thread_s.start()
        return self

    def stop(self) -> None:
        """Stop the API and every task (kill signal, then SIGKILL after kill_timeout)."""
        self._halt.set()
        super().stop()
        with self.lock:
            runners = [r for rs in self.runners.values() for r in rs]
            self.runners.clear()
        threads = [threading.Thread(target=r.kill) for r in runners]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def add_node(self, name: str, address: str, *, netns: str | None = None,
                 node_class: str = "", gpus: int = 0, meta: dict[str, str] | None = None,
                 attributes: dict[str, str] | None = None,
                 drivers: tuple[str, ...] = ("exec",), max_kill_timeout_s: float = 30.0) -> Node:
        """A client node fingerprinting ``drivers`` (raw_exec only when listed: a client
        enables it with ``plugin "raw_exec" { config { enabled = true } }``)."""
        node = Node(id=str(uuid.uuid5(uuid.NAMESPACE_DNS, name)), name=name, address=address,
                    node_class=node_class, netns=netns, meta=dict(meta or {}),
                    attributes={"unique.network.ip-address": address,
                                "unique.hostname": name, "kernel.name": "linux",
                                **{f"driver.{d}": "1" for d in drivers}, **(attributes or {})},
                    devices={"nvidia/gpu": [f"GPU-{name}-{i}" for i in range(gpus)]},
                    max_kill_timeout_s=max_kill_timeout_s)
        with self.lock:
            self.nodes[node.id] = node
        return node

    def apply_policy(self, name: str, rules: str, job_id: str | None = None,
                     namespace: str = "default") -> None:
        """``nomad acl policy apply [-job J] NAME rules.hcl``."""
        with self.lock:
            self.acl.apply(name, rules, {"Namespace": namespace, "JobID": job_id}
                           if job_id else None)

    def job(self, job_id: str, namespace: str = "default") -> dict | None:
        with self.lock:
            return copy.deepcopy(self.jobs.get((namespace, job_id)))

    def job_allocs(self, job_id: str) -> list[dict]:
        with self.lock:
            return [self._alloc_view(a) for a in self.allocs.values() if a["JobID"] == job_id]

    def runner(self, alloc_id: str, task: str | None = None) -> TaskRunner | None:
        with self.lock:
            for r in self.runners.get(alloc_id, []):
                if task is None or r.task["Name"] == task:
                    return r
        return None

    # -- job versions (called under the lock) ----------------------------------------------
    def write_version(self, job: dict) -> dict:
        """``upsertJobImpl``: a new version of ``job`` (Version + 1, not stable), a new
        evaluation's index, and the deployment the reconciler would start for it."""
        key = (job["Namespace"], job["ID"])
        old = self.jobs.get(key)
        out = self._eval()
        job["Version"] = 0 if old is None else old["Version"] + 1
        job["CreateIndex"] = out["JobModifyIndex"] if old is None else old["CreateIndex"]
        job["ModifyIndex"] = job["JobModifyIndex"] = out["JobModifyIndex"]
        job["Stable"] = False
        self.jobs[key] = job
        self.versions.setdefault(key, []).append(copy.deepcopy(job))
        # A count change is not destructive (scheduler/util.go tasksUpdated): allocations keep
        # running and take the new version in place, their health judged afresh.  A changed
        # task is: those allocations are stopped and replaced (all at once here; Nomad
        # replaces max_parallel at a time).
        now = time.monotonic()
        groups = {g["Name"]: g for g in job["TaskGroups"]}
        for a in self.allocs.values():
            if (a["JobID"], a["Namespace"]) == (job["ID"], job["Namespace"]) and \
                    a["DesiredStatus"] == "run" and a["ClientStatus"] in ("pending", "running"):
                group = groups.get(a["TaskGroup"])
                if group is None or group["Tasks"] != a["_group"]["Tasks"]:
                    a["DesiredStatus"] = "stop"
                    continue
                a["_job"] = copy.deepcopy(job)
                if a["ClientStatus"] == "running":
                    a["_running_since_s"] = now
        self.deployments.new_version(job, now)
        return out

    def mark_stable(self, job: dict) -> None:
        job["Stable"] = True
        for v in self.versions.get((job["Namespace"], job["ID"]), []):
            if v["Version"] == job["Version"]:
                v["Stable"] = True

    def latest_stable(self, job: dict) -> dict | None:
        stable = [v for v in self.versions.get((job["Namespace"], job["ID"]), [])
                  if v["Stable"] and v["Version"] != job["Version"]]
        return stable[-1] if stable else None

    # -- HTTP --------------------------------------------------------------------------------
    def _eval(self) -> dict:
        self.index += 1
        return {"EvalID": str(uuid.uuid4()), "EvalCreateIndex": self.index,
                "JobModifyIndex": self.index, "Index": self.index, "Warnings": ""}

    def route(self, method, path, query, body, headers):
        ns = query.get("namespace", "default")
        with self.lock:
            grant = self.acl.grant(headers.get("X-Nomad-Token"), self.allocs)
            if grant is None:
                raise Reply(403, DENIED)

            def need(*caps: str) -> None:
                if not grant.ns_allows(ns, *caps):
                    raise Reply(403, DENIED)

            def need_node(write: bool) -> None:
                if not grant.node_allows(write):
                    raise Reply(403, DENIED)
            if path.startswith("/v1/acl/policy/") and method in ("POST", "PUT"):
                if not grant.management:
                    raise Reply(403, DENIED)
                try:
                    self.acl.apply(path[len("/v1/acl/policy/"):], (body or {}).get("Rules", ""),
                                   (body or {}).get("JobACL"))
                except PolicyError as exc:
                    raise Reply(400, str(exc)) from exc
                return ""
            if path == "/v1/jobs/parse" and method in ("POST", "PUT"):
                need("parse-job", "submit-job")
                return self._parse(body)
            if path == "/v1/jobs" and method in ("POST", "PUT"):
                need("submit-job")
                return self._register(query.get("namespace"), None, body)
            if path == "/v1/client/metadata":
                need_node(write=method in ("POST", "PUT"))
                return self._metadata(method, query, body)
            if path == "/v1/nodes" and method == "GET":
                need_node(write=False)
                return [self._node_view(n) for n in self.nodes.values()]
            if path.startswith("/v1/node/") and method == "GET":
                need_node(write=False)
                node = self.nodes.get(path[len("/v1/node/"):])
                if node is None:
                    raise Reply(404, "node not found")
                return self._node_view(node)
            if path.startswith("/v1/allocation/") and method == "GET":
                need("read-job")
                alloc = self.allocs.get(path[len("/v1/allocation/"):])
                if alloc is None:
                    raise Reply(404, "alloc not found")
                return self._alloc_view(alloc)
            if path.startswith("/v1/deployment/") and method == "GET":
                need("read-job")
                dep = self.deployments.by_id.get(path[len("/v1/deployment/"):])
                if dep is None:
                    raise Reply(404, "deployment not found")
                return self.deployments.view(dep)
            if path.startswith("/v1/var/"):
                if not grant.management:
                    raise Reply(403, DENIED)
                return self._variable(method, ns, path[len("/v1/var/"):], body)
            if path.startswith("/v1/job/"):
                return self._job_route(method, ns, path[len("/v1/job/"):], body, need,
                                       query.get("namespace"))
        raise Reply(404, f"no route for {method} {path}")

    def _job_route(self, method, ns, rest, body, need, query_ns):
        job_id, _, sub = rest.partition("/")
        if sub == "" and method == "GET":
            need("read-job")
            job = self.jobs.get((ns, job_id))
            if job is None:
                raise Reply(404, "job not found")
            return copy.deepcopy(job)
        if sub == "" and method in ("POST", "PUT"):
            need("submit-job")
            return self._register(query_ns, job_id, body)
        if sub == "" and method == "DELETE":
            need("submit-job")
            if self.jobs.pop((ns, job_id), None) is None:
                raise Reply(404, "job not found")
            for a in self.allocs.values():
                if a["JobID"] == job_id:
                    a["DesiredStatus"] = "stop"
            return self._eval()
        if sub == "allocations" and method == "GET":
            need("read-job")
            return [self._alloc_view(a) for a in self.allocs.values()
                    if a["JobID"] == job_id and a["Namespace"] == ns]
        if sub in ("deployments", "deployment") and method == "GET":
            need("read-job")
            deps = [self.deployments.view(d) for d in self.deployments.by_id.values()
                    if d["JobID"] == job_id and d["Namespace"] == ns]
            if sub == "deployments":
                return deps
            return deps[-1] if deps else None
        if sub == "scale":
            if method == "GET":
                need("read-job", "read-job-scaling")
            else:
                need("scale-job", "submit-job")
            return self._scale(method, ns, job_id, body)
        raise Reply(404, f"no route for {method} /v1/job/{rest}")

    def _parse(self, body):
        body = body or {}
        self.parse_requests.append(copy.deepcopy(body))
        if not isinstance(body.get("JobHCL"), str) or not body["JobHCL"]:
            raise Reply(400, "Job spec is empty")
        try:
            return parse_job(body["JobHCL"], body.get("Variables") or "")
        except ParseError as exc:
            raise Reply(400, str(exc)) from exc

    def _register(self, ns: str | None, job_id, body):
        """Register (``Job.Register``); the namespace is the query's, else the job's
        (``command/agent/job_endpoint.go``, ``namespaceForJob``)."""
        job = (body or {}).get("Job")
        if not isinstance(job, dict) or not job.get("ID"):
            raise Reply(400, "Job ID does not match name" if job_id else "Job must be specified")
        if job_id is not None and job["ID"] != job_id:
            raise Reply(400, "Job ID does not match name")
        job = canonicalize({**job, "Namespace": ns or job.get("Namespace") or "default"})
        errors = validate(job)
        if errors:
            # Job.Register -> jobValidate (job_endpoint_hooks.go); an uncoded RPC error:
            # 500 with its text (command/agent/http.go, errCodeFromHandler)
            self.register_requests.append((500, job["ID"]))
            raise Reply(500, multierror(errors))
        self.register_requests.append((200, job["ID"]))
        return self.write_version(job)

    def _scale(self, method, ns, job_id, body):
        job = self.jobs.get((ns, job_id))
        if job is None:
            raise Reply(404, f'job "{job_id}" not found')
        if method == "GET":
            groups = {}
            for g in job["TaskGroups"]:
                mine = [a for a in self.allocs.values() if a["JobID"] == job_id
                        and a["TaskGroup"] == g["Name"] and a["DesiredStatus"] == "run"]
                running = sum(1 for a in mine if a["ClientStatus"] == "running")
                groups[g["Name"]] = {"Desired": g.get("Count", 0), "Placed": len(mine),
                                     "Running": running, "Healthy": running,
                                     "Unhealthy": 0, "Events": []}
            return {"JobID": job_id, "Namespace": ns, "JobStopped": bool(job.get("Stop")),
                    "JobCreateIndex": job["CreateIndex"], "JobModifyIndex": job["ModifyIndex"],
                    "TaskGroups": groups}
        if method not in ("POST", "PUT"):
            raise Reply(405, "Invalid method")
        group = ((body or {}).get("Target") or {}).get("Group")
        if not group:
            raise Reply(400, "missing task group name")
        tg = next((g for g in job["TaskGroups"] if g["Name"] == group), None)
        if tg is None:
            raise Reply(400, f'task group "{group}" specified for scaling does not exist in job')
        count = body.get("Count")
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
            if self.deployments.active(job):
                raise Reply(400, "job scaling blocked due to active deployment")
        self.events.append({"Job": job_id, "Group": group, "Count": count,
                            "Message": body.get("Message", ""), "Meta": body.get("Meta")})
        if count is None:
            return self._eval()
        new = copy.deepcopy(job)
        next(g for g in new["TaskGroups"] if g["Name"] == group)["Count"] = count
        return self.write_version(new)

    def _metadata(self, method, query, body):
        node = self.nodes.get(query.get("node_id", ""))
        if node is None:
            if query.get("node_id") or len(self.nodes) != 1:
                raise Reply(404, f"Unknown node {query.get('node_id')}")
            node = next(iter(self.nodes.values()))
        if method in ("POST", "PUT"):
            for k, v in ((body or {}).get("Meta") or {}).items():
                node.dynamic_meta[k] = v
        return {"Meta": node.merged_meta(), "Dynamic": dict(node.dynamic_meta),
                "Static": dict(node.meta)}

    def _variable(self, method, ns, path, body):
        key = (ns, path)
        if method == "GET":
            var = self.variables.get(key)
            if var is None:
                raise Reply(404, "variable not found")
            return copy.deepcopy(var)
        if method in ("PUT", "POST"):
            items = (body or {}).get("Items")
            if not isinstance(items, dict) or not items:
                raise Reply(400, "variable missing required Items object")
            self.index += 1
            self.variables[key] = {"Namespace": ns, "Path": path, "Items": dict(items),
                                   "ModifyIndex": self.index}
            return copy.deepcopy(self.variables[key])
        if method == "DELETE":
            self.variables.pop(key, None)
            return ""
        raise Reply(405, "method not allowed")

    # -- views -------------------------------------------------------------------------------
    def _node_view(self, node: Node) -> dict:
        return {"ID": node.id, "Name": node.name, "NodeClass": node.node_class,
                "Datacenter": node.datacenter, "Status": "ready",
                "HTTPAddr": f"{node.address}:4646", "Attributes": dict(node.attributes),
                "Meta": node.merged_meta(),
                "NodeResources": {"Devices": [{"Vendor": "nvidia", "Type": "gpu",
                                               "Instances": [{"ID": d} for d in ids]}
                                              for name, ids in node.devices.items() if ids]}}

    def _alloc_view(self, alloc: dict) -> dict:
        out = copy.deepcopy({k: v for k, v in alloc.items() if not k.startswith("_")})
        states = {}
        for r in self.runners.get(alloc["ID"], []):
            states[r.task["Name"]] = {"State": r.state, "Restarts": r.restarts,
                                      "Failed": alloc["ClientStatus"] == "failed",
                                      "Events": list(r.events)}
        out["TaskStates"] = states
        out["JobVersion"] = alloc["_job"].get("Version")
        return out
