"""A Nomad HTTP API stand-in that places and runs allocations (tests only).

Written from Nomad's documented HTTP API (developer.hashicorp.com/nomad/api-docs):

- "Jobs": ``POST /v1/jobs`` (register, body ``{"Job"}``), ``POST /v1/jobs/parse`` (body
  ``JobHCL``, ``Variables``, ``Canonicalize``; the parse itself in ``nomad_jobspec.py``,
  python-hcl2), ``GET/POST/DELETE /v1/job/:id``, ``GET /v1/job/:id/allocations``,
  ``GET/POST /v1/job/:id/scale`` (``Count``, ``Target {Group}``, ``Message``, ``Meta``; 400
  while a deployment is active ("job scaling blocked due to active deployment"), 400 outside
  the group's ``Scaling`` Min/Max or for an unknown group, 404 for an unknown job);
- "Allocations": ``GET /v1/allocation/:id`` (``ClientStatus``, ``DesiredStatus``, ``NodeID``,
  ``TaskStates``, ``AllocatedResources.Shared.Ports``, ``RescheduleTracker``,
  ``PreviousAllocation``/``NextAllocation``);
- "Nodes": ``GET /v1/nodes``, ``GET /v1/node/:id`` (``Meta`` includes dynamic metadata);
- "Client": ``GET/POST /v1/client/metadata`` (``Meta`` with null to unset; reply ``Meta``,
  ``Dynamic``, ``Static``; ``node_id``);
- "Variables": ``PUT/GET/DELETE /v1/var/:path`` (``Items``);
- ACL: with ``acl_token`` set, a request whose ``X-Nomad-Token`` is neither it nor a workload
  identity the stand-in issued gets 403 "Permission denied".

The scheduler (``nomad_placement.py``) runs on a thread: every group of every job is
reconciled to its count (a system job: one allocation per feasible node), new allocations are
placed or stay pending, failed ones are rescheduled per the group's ``ReschedulePolicy``
(delay, exponential up to ``MaxDelay``) away from the nodes they failed on, surplus ones are
stopped newest first.  Tasks run through ``nomad_runner.py``.  Nodes are added by the test
(``add_node``): a real client registers over Nomad's RPC, which has no HTTP API.

Simplifications: one region, one datacenter per node as given; no deployments (a job
re-registered keeps its allocations and takes the new count); no evaluations API; a service's
Consul registration by Nomad is not done (rewarm's services register themselves).
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

from tests.cluster.nomad_jobspec import ParseError, parse_job
from tests.cluster.nomad_placement import Node, choose
from tests.cluster.nomad_runner import ENV_DENYLIST, TaskRunner, render_template, env_lines
from tests.cluster.standin_http import Reply, StandIn

NS = 1e-9


class NomadStandIn(StandIn):
    def __init__(self, acl_token: str | None = None, host: str = "127.0.0.1",
                 data_dir: Path | None = None, tick_s: float = 0.1,
                 base_env: dict[str, str] | None = None) -> None:
        super().__init__(host=host)
        self.acl_token = acl_token
        self.index = 10
        self.jobs: dict[tuple[str, str], dict] = {}     # (namespace, id) -> job
        self.events: list[dict] = []                    # scaling requests accepted
        self.active_deployments: set[str] = set()       # job ids
        self.nodes: dict[str, Node] = {}
        self.allocs: dict[str, dict] = {}
        self.runners: dict[str, list[TaskRunner]] = {}
        self.variables: dict[tuple[str, str], dict] = {}
        self.identities: dict[str, str] = {}            # workload token -> alloc id
        self.parse_requests: list[dict] = []
        self.base_env = dict(os.environ if base_env is None else base_env)
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="nomad-standin-"))
        self._tick_s = tick_s
        self._halt = threading.Event()
        self._scheduler = threading.Thread(target=self._schedule_loop, daemon=True,
                                           name="nomad-standin-scheduler")

    # -- test-side controls ----------------------------------------------------------------
    def start(self):
        super().start()
        self._scheduler.start()
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
                 attributes: dict[str, str] | None = None) -> Node:
        node = Node(id=str(uuid.uuid5(uuid.NAMESPACE_DNS, name)), name=name, address=address,
                    node_class=node_class, netns=netns, meta=dict(meta or {}),
                    attributes={"unique.network.ip-address": address,
                                "unique.hostname": name, "kernel.name": "linux",
                                "driver.raw_exec": "1", **(attributes or {})},
                    devices={"nvidia/gpu": [f"GPU-{name}-{i}" for i in range(gpus)]})
        with self.lock:
            self.nodes[node.id] = node
        return node

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

    # -- HTTP --------------------------------------------------------------------------------
    def _authorised(self, headers) -> bool:
        given = headers.get("X-Nomad-Token")
        return self.acl_token is None or given == self.acl_token or given in self.identities

    def _eval(self) -> dict:
        self.index += 1
        return {"EvalID": str(uuid.uuid4()), "EvalCreateIndex": self.index,
                "JobModifyIndex": self.index, "Index": self.index, "Warnings": ""}

    def route(self, method, path, query, body, headers):
        if not self._authorised(headers):
            raise Reply(403, "Permission denied")
        ns = query.get("namespace", "default")
        with self.lock:
            if path == "/v1/jobs/parse" and method in ("POST", "PUT"):
                return self._parse(body)
            if path == "/v1/jobs" and method in ("POST", "PUT"):
                return self._register(ns, None, body)
            if path == "/v1/client/metadata":
                return self._metadata(method, query, body)
            if path == "/v1/nodes" and method == "GET":
                return [self._node_view(n) for n in self.nodes.values()]
            if path.startswith("/v1/node/") and method == "GET":
                node = self.nodes.get(path[len("/v1/node/"):])
                if node is None:
                    raise Reply(404, "node not found")
                return self._node_view(node)
            if path.startswith("/v1/allocation/") and method == "GET":
                alloc = self.allocs.get(path[len("/v1/allocation/"):])
                if alloc is None:
                    raise Reply(404, "alloc not found")
                return self._alloc_view(alloc)
            if path.startswith("/v1/var/"):
                return self._variable(method, ns, path[len("/v1/var/"):], body)
            if path.startswith("/v1/job/"):
                job_id, _, sub = path[len("/v1/job/"):].partition("/")
                if sub == "" and method == "GET":
                    job = self.jobs.get((ns, job_id))
                    if job is None:
                        raise Reply(404, "job not found")
                    return copy.deepcopy(job)
                if sub == "" and method in ("POST", "PUT"):
                    return self._register(ns, job_id, body)
                if sub == "" and method == "DELETE":
                    if self.jobs.pop((ns, job_id), None) is None:
                        raise Reply(404, "job not found")
                    for a in self.allocs.values():
                        if a["JobID"] == job_id:
                            a["DesiredStatus"] = "stop"
                    return self._eval()
                if sub == "allocations" and method == "GET":
                    return [self._alloc_view(a) for a in self.allocs.values()
                            if a["JobID"] == job_id and a["Namespace"] == ns]
                if sub == "scale":
                    return self._scale(method, ns, job_id, body)
        raise Reply(404, f"no route for {method} {path}")

    def _parse(self, body):
        body = body or {}
        self.parse_requests.append(copy.deepcopy(body))
        if not isinstance(body.get("JobHCL"), str):
            raise Reply(400, "error parsing: JobHCL is required")
        try:
            return parse_job(body["JobHCL"], body.get("Variables") or "")
        except ParseError as exc:
            raise Reply(400, str(exc)) from exc

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
        job.setdefault("Type", "service")
        out = self._eval()
        job["ModifyIndex"] = out["JobModifyIndex"]
        self.jobs[(ns, job["ID"])] = job
        return out

    def _scale(self, method, ns, job_id, body):
        job = self.jobs.get((ns, job_id))
        if job is None:
            raise Reply(404, "job not found")
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
                    "JobCreateIndex": job["ModifyIndex"], "JobModifyIndex": job["ModifyIndex"],
                    "TaskGroups": groups}
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
        return out

    # -- scheduler ---------------------------------------------------------------------------
    def _schedule_loop(self) -> None:
        while not self._halt.wait(self._tick_s):
            stops, starts = [], []
            with self.lock:
                for job in list(self.jobs.values()):
                    for group in job["TaskGroups"]:
                        self._reconcile(job, group, starts)
                for alloc in self.allocs.values():
                    if (alloc["DesiredStatus"] == "stop" and alloc["ClientStatus"] in
                            ("running", "pending") and not alloc.get("_stopping")):
                        alloc["_stopping"] = True
                        stops.append(alloc["ID"])
            for alloc_id in stops:
                threading.Thread(target=self._stop_alloc, args=(alloc_id,), daemon=True).start()
            for alloc_id in starts:
                self._start_alloc(alloc_id)

    def _live(self, job_id: str, group: str) -> list[dict]:
        return [a for a in self.allocs.values() if a["JobID"] == job_id
                and a["TaskGroup"] == group and a["DesiredStatus"] == "run"
                and a["ClientStatus"] in ("pending", "running")]

    def _reconcile(self, job: dict, group: dict, starts: list[str]) -> None:
        live = self._live(job["ID"], group["Name"])
        now = time.monotonic()
        # failed allocations due for rescheduling become replacements (service jobs)
        replacing = []
        if job["Type"] != "system":
            for a in self.allocs.values():
                if (a["JobID"] == job["ID"] and a["TaskGroup"] == group["Name"]
                        and a["ClientStatus"] == "failed" and a["DesiredStatus"] == "run"
                        and not a.get("NextAllocation") and now >= a.get("_reschedule_at", 0)):
                    replacing.append(a)
        if job["Type"] == "system":
            have = {a["NodeID"] for a in live}
            failed = {a["NodeID"] for a in self.allocs.values() if a["JobID"] == job["ID"]
                      and a["DesiredStatus"] == "run" and a["ClientStatus"] == "failed"}
            for node in self.nodes.values():
                if node.id not in have and node.id not in failed:
                    self._place(job, group, [node], None, starts)
            return
        want = int(group.get("Count", 0))
        # A failed allocation waiting out its reschedule delay keeps its slot: the reconciler
        # replaces it when the delay ends, it does not place an extra one meanwhile.
        delayed = [a for a in self.allocs.values() if a["JobID"] == job["ID"]
                   and a["TaskGroup"] == group["Name"] and a["ClientStatus"] == "failed"
                   and a["DesiredStatus"] == "run" and not a.get("NextAllocation")
                   and now < a.get("_reschedule_at", 0)]
        waiting = len(delayed)
        extra = len(live) + waiting - want
        if extra > 0:      # scaled in: drop replacements not yet made, then the newest
            for a in delayed[:extra]:
                a["DesiredStatus"] = "stop"
            extra -= min(extra, waiting)
            if extra:
                for a in sorted(live, key=lambda a: a["CreateIndex"])[-extra:]:
                    a["DesiredStatus"] = "stop"
            return
        for prev in replacing:
            if len(self._live(job["ID"], group["Name"])) + waiting >= want:
                prev["DesiredStatus"] = "stop"     # scaled in meanwhile: not replaced
                continue
            self._place(job, group, list(self.nodes.values()), prev, starts)
        for _ in range(want - waiting - len(self._live(job["ID"], group["Name"]))):
            if self._place(job, group, list(self.nodes.values()), None, starts) is None:
                break

    def _used_devices(self) -> dict[str, set[str]]:
        """Device instances held by allocations not yet complete or failed (one being
        stopped holds its device until its tasks are dead)."""
        used: dict[str, set[str]] = {}
        for a in self.allocs.values():
            if a["ClientStatus"] in ("pending", "running"):
                used.setdefault(a["NodeID"], set()).update(a["_devices"])
        return used

    def _place(self, job, group, nodes, prev, starts) -> dict | None:
        need: dict[str, int] = {}
        for task in group["Tasks"]:
            for d in (task.get("Resources") or {}).get("Devices") or []:
                if d.get("Count", 1) > 0:
                    need[d["Name"]] = need.get(d["Name"], 0) + d.get("Count", 1)
        live = self._live(job["ID"], group["Name"])
        # A static port taken on a node makes the node infeasible (docs: "network block",
        # static ports are reserved on the host).
        static = {int(p["Value"]) for n in group.get("Networks") or []
                  for p in n.get("ReservedPorts") or []}
        if static:
            nodes = [n for n in nodes if not static & {
                q["Value"] for a in self.allocs.values() if a["NodeID"] == n.id
                and a["ClientStatus"] in ("pending", "running")
                for q in a["AllocatedResources"]["Shared"]["Ports"]}]
        penalty = set(prev.get("_failed_nodes", [])) if prev else set()
        if prev:
            penalty.add(prev["NodeID"])
        node = choose(nodes, constraints=(job.get("Constraints") or [])
                      + (group.get("Constraints") or []),
                      affinities=(job.get("Affinities") or []) + (group.get("Affinities") or []),
                      group_nodes={a["NodeID"] for a in live}, device_need=need,
                      devices_used=self._used_devices(),
                      job_allocs={n: sum(1 for a in live if a["NodeID"] == n) for n in self.nodes},
                      penalty_nodes=penalty)
        if node is None:
            return None
        used = self._used_devices().get(node.id, set())
        devices = []
        for name, count in need.items():
            devices += [d for d in node.devices.get(name, []) if d not in used][:count]
        self.index += 1
        index = len([a for a in self.allocs.values() if a["JobID"] == job["ID"]])
        alloc = {"ID": str(uuid.uuid4()), "Namespace": job["Namespace"], "JobID": job["ID"],
                 "Name": f"{job['ID']}.{group['Name']}[{index}]", "TaskGroup": group["Name"],
                 "NodeID": node.id, "NodeName": node.name, "ClientStatus": "pending",
                 "DesiredStatus": "run", "CreateIndex": self.index,
                 "AllocatedResources": {"Shared": {"Ports": self._ports(group, node)}},
                 "RescheduleTracker": None, "PreviousAllocation": None, "NextAllocation": None,
                 "_devices": devices, "_job": copy.deepcopy(job), "_group": copy.deepcopy(group),
                 "_index": index, "_failed_nodes": sorted(penalty)}
        if prev is not None:
            prev["NextAllocation"] = alloc["ID"]
            alloc["PreviousAllocation"] = prev["ID"]
            events = list((prev.get("RescheduleTracker") or {}).get("Events") or [])
            events.append({"PrevAllocID": prev["ID"], "PrevNodeID": prev["NodeID"],
                           "RescheduleTime": int(time.time() * 1e9)})
            alloc["RescheduleTracker"] = {"Events": events}
            alloc["_attempt"] = prev.get("_attempt", 0) + 1
        self.allocs[alloc["ID"]] = alloc
        starts.append(alloc["ID"])
        return alloc

    def _ports(self, group: dict, node: Node) -> list[dict]:
        taken = {p["Value"] for a in self.allocs.values() if a["NodeID"] == node.id
                 and a["ClientStatus"] in ("pending", "running")
                 for p in a["AllocatedResources"]["Shared"]["Ports"]}
        out, nxt = [], 20000
        for net in group.get("Networks") or []:
            for p in net.get("ReservedPorts") or []:
                out.append({"Label": p["Label"], "Value": int(p["Value"]), "To": 0,
                            "HostIP": node.address})
            for p in net.get("DynamicPorts") or []:
                if node.netns is None:
                    # Nodes without a namespace share this machine's network stack: take a
                    # port the OS says is free (on real, separate hosts Nomad picks from
                    # its own range per node).
                    value = _free_port(node.address)
                else:
                    while nxt in taken:
                        nxt += 1
                    value = nxt
                taken.add(value)
                out.append({"Label": p["Label"], "Value": value, "To": 0,
                            "HostIP": node.address})
        return out

    # -- the client: run and stop allocations -----------------------------------------------
    def _task_env(self, alloc: dict, task: dict, node: Node, task_dir: Path) -> dict[str, str]:
        job, group = alloc["_job"], alloc["_group"]
        env = {k: v for k, v in self.base_env.items() if k not in ENV_DENYLIST}
        alloc_dir = self.data_dir / alloc["ID"] / "alloc"
        env.update({
            "NOMAD_ALLOC_ID": alloc["ID"], "NOMAD_ALLOC_NAME": alloc["Name"],
            "NOMAD_ALLOC_INDEX": str(alloc["_index"]), "NOMAD_JOB_ID": job["ID"],
            "NOMAD_JOB_NAME": job["Name"], "NOMAD_GROUP_NAME": group["Name"],
            "NOMAD_TASK_NAME": task["Name"], "NOMAD_NAMESPACE": job["Namespace"],
            "NOMAD_REGION": "global", "NOMAD_DC": node.datacenter,
            "NOMAD_ALLOC_DIR": str(alloc_dir), "NOMAD_TASK_DIR": str(task_dir / "local"),
            "NOMAD_SECRETS_DIR": str(task_dir / "secrets"),
            "NOMAD_CPU_LIMIT": str((task.get("Resources") or {}).get("CPU", 100)),
            "NOMAD_MEMORY_LIMIT": str((task.get("Resources") or {}).get("MemoryMB", 300))})
        for p in alloc["AllocatedResources"]["Shared"]["Ports"]:
            label = p["Label"]
            env[f"NOMAD_IP_{label}"] = p["HostIP"]
            env[f"NOMAD_PORT_{label}"] = env[f"NOMAD_HOST_PORT_{label}"] = str(p["Value"])
            env[f"NOMAD_ADDR_{label}"] = f"{p['HostIP']}:{p['Value']}"
        for k, v in (job.get("Meta") or {}).items():
            env[f"NOMAD_META_{k}"] = str(v)
            env[f"NOMAD_META_{k.replace('.', '_').replace('-', '_')}"] = str(v)
        if alloc["_devices"]:
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(alloc["_devices"])
        if (task.get("Identity") or {}).get("Env"):
            token = str(uuid.uuid4())
            self.identities[token] = alloc["ID"]
            env["NOMAD_TOKEN"] = token
        return env

    def _start_alloc(self, alloc_id: str) -> None:
        with self.lock:
            alloc = self.allocs[alloc_id]
            node = self.nodes[alloc["NodeID"]]
            group = alloc["_group"]
            shutdown_delay = max([(s.get("ShutdownDelay") or 0) * NS
                                  for s in group.get("Services") or []] or [0.0])
            runners = []
            for task in group["Tasks"]:
                task_dir = self.data_dir / alloc_id / task["Name"]
                (task_dir / "local").mkdir(parents=True, exist_ok=True)
                (task_dir / "secrets").mkdir(parents=True, exist_ok=True)
                (self.data_dir / alloc_id / "alloc").mkdir(parents=True, exist_ok=True)
                env = self._task_env(alloc, task, node, task_dir)
                runner = TaskRunner(alloc=alloc, task=task, node=node, env=env,
                                    netns=node.netns, task_dir=task_dir,
                                    restart=group.get("RestartPolicy") or {},
                                    on_exit=self._task_dead, shutdown_delay_s=shutdown_delay)
                try:
                    self._render_templates(alloc, task, runner, task_dir)
                except RuntimeError as exc:
                    runner._event("Template Failure", DisplayMessage=str(exc))
                    alloc["ClientStatus"] = "failed"
                    self._schedule_reschedule(alloc)
                    self.runners[alloc_id] = [runner]
                    return
                runner.env.update({k: runner.interpolate(str(v))
                                   for k, v in (task.get("Env") or {}).items()})
                runners.append(runner)
            self.runners[alloc_id] = runners
            alloc["ClientStatus"] = "running"
        for r in runners:
            r.start()

    def _render_templates(self, alloc, task, runner, task_dir) -> None:
        job_id, group = alloc["JobID"], alloc["_group"]["Name"]
        prefixes = {"nomad/jobs", f"nomad/jobs/{job_id}", f"nomad/jobs/{job_id}/{group}",
                    f"nomad/jobs/{job_id}/{group}/{task['Name']}"}

        def read(path):
            var = self.variables.get((alloc["Namespace"], path))
            return None if var is None else var["Items"]
        for tmpl in task.get("Templates") or []:
            text = render_template(tmpl.get("EmbeddedTmpl", ""), read, lambda p: p in prefixes)
            dest = task_dir / tmpl["DestPath"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
            if tmpl.get("Envvars"):
                runner.env.update(env_lines(text))

    def _task_dead(self, runner: TaskRunner, failed: bool) -> None:
        with self.lock:
            alloc = self.allocs.get(runner.alloc["ID"])
            if alloc is None or alloc.get("_stopping"):
                return
            alloc["ClientStatus"] = "failed" if failed else "complete"
            if failed:
                self._schedule_reschedule(alloc)
        for other in self.runners.get(runner.alloc["ID"], []):
            if other is not runner:
                threading.Thread(target=other.kill, daemon=True).start()

    def _schedule_reschedule(self, alloc: dict) -> None:
        policy = alloc["_group"].get("ReschedulePolicy") or {}
        delay = (policy.get("Delay") or 30e9) * NS
        attempt = alloc.get("_attempt", 0)
        if policy.get("DelayFunction", "exponential") == "exponential":
            delay *= 2 ** attempt
        max_delay = (policy.get("MaxDelay") or 3600e9) * NS
        alloc["_reschedule_at"] = time.monotonic() + min(delay, max_delay)

    def _stop_alloc(self, alloc_id: str) -> None:
        with self.lock:
            runners = list(self.runners.get(alloc_id, []))
        threads = [threading.Thread(target=r.kill) for r in runners]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self.lock:
            alloc = self.allocs[alloc_id]
            if alloc["ClientStatus"] in ("running", "pending"):
                alloc["ClientStatus"] = "complete"
            for token, owner in list(self.identities.items()):
                if owner == alloc_id:
                    del self.identities[token]


def _free_port(address: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
