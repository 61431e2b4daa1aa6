"""The Nomad stand-in's scheduler: reconciles every group to its count (tests only).

Follows Nomad's generic and system schedulers (``scheduler/generic_sched.go``,
``scheduler/scheduler_system.go``, ``scheduler/reconciler/reconcile_cluster.go``): new
allocations are placed (``nomad_placement.choose``: drivers, constraints, devices, static
ports, affinities) or stay pending; failed ones are replaced after their reschedule delay,
away from the nodes they failed on; surplus ones are stopped newest first; a system job
runs one allocation per feasible node.  Each tick also advances the deployments
(``nomad_deployments``) and rolls a failed one back when its group has ``auto_revert``.
"""

from __future__ import annotations

import copy
import threading
import time
import uuid

from tests.cluster.nomad_placement import Node, choose


class Scheduler:
    """Runs on its own thread over ``server``'s state (a NomadStandIn, under its lock)."""

    def __init__(self, server) -> None:
        self.s = server

    def run(self) -> None:
        while not self.s._halt.wait(self.s._tick_s):
            stops, starts = [], []
            with self.s.lock:
                for job in list(self.s.jobs.values()):
                    for group in job["TaskGroups"]:
                        self._reconcile(job, group, starts)
                    self._watch_deployment(job)
                for alloc in self.s.allocs.values():
                    if (alloc["DesiredStatus"] == "stop" and alloc["ClientStatus"] in
                            ("running", "pending") and not alloc.get("_stopping")):
                        alloc["_stopping"] = True
                        stops.append(alloc["ID"])
            for alloc_id in stops:
                threading.Thread(target=self.s.client.stop, args=(alloc_id,), daemon=True).start()
            for alloc_id in starts:
                self.s.client.start(alloc_id)

    def _watch_deployment(self, job: dict) -> None:
        """The deployment watcher's verdict; a failed deployment of a group with auto_revert
        rolls the job back to its latest stable version (a new version of the old spec)."""
        mine = [a for a in self.s.allocs.values() if a["JobID"] == job["ID"]
                and a["Namespace"] == job["Namespace"] and a["DesiredStatus"] == "run"]
        verdict = self.s.deployments.watch(job, mine, time.monotonic())
        if verdict == "successful":
            self.s.mark_stable(job)
        elif verdict == "failed":
            dep = self.s.deployments.latest_for(job["Namespace"], job["ID"])
            if any(g["AutoRevert"] for g in dep["TaskGroups"].values()):
                stable = self.s.latest_stable(job)
                if stable is not None:
                    dep["StatusDescription"] += f" - rolling back to job version {stable['Version']}"
                    self.s.write_version(copy.deepcopy(stable))

    def _live(self, job_id: str, group: str) -> list[dict]:
        return [a for a in self.s.allocs.values() if a["JobID"] == job_id
                and a["TaskGroup"] == group and a["DesiredStatus"] == "run"
                and a["ClientStatus"] in ("pending", "running")]

    def _reconcile(self, job: dict, group: dict, starts: list[str]) -> None:
        live = self._live(job["ID"], group["Name"])
        now = time.monotonic()
        # failed allocations due for rescheduling become replacements (service jobs)
        replacing = []
        if job["Type"] != "system":
            for a in self.s.allocs.values():
                if (a["JobID"] == job["ID"] and a["TaskGroup"] == group["Name"]
                        and a["ClientStatus"] == "failed" and a["DesiredStatus"] == "run"
                        and not a.get("NextAllocation") and now >= a.get("_reschedule_at", 0)):
                    replacing.append(a)
        if job["Type"] == "system":
            have = {a["NodeID"] for a in live}
            failed = {a["NodeID"] for a in self.s.allocs.values() if a["JobID"] == job["ID"]
                      and a["DesiredStatus"] == "run" and a["ClientStatus"] == "failed"}
            for node in self.s.nodes.values():
                if node.id not in have and node.id not in failed:
                    self._place(job, group, [node], None, starts)
            return
        want = int(group.get("Count", 0))
        # A failed allocation waiting out its reschedule delay keeps its slot: the reconciler
        # replaces it when the delay ends, it does not place an extra one meanwhile.
        delayed = [a for a in self.s.allocs.values() if a["JobID"] == job["ID"]
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
            self._place(job, group, list(self.s.nodes.values()), prev, starts)
        for _ in range(want - waiting - len(self._live(job["ID"], group["Name"]))):
            if self._place(job, group, list(self.s.nodes.values()), None, starts) is None:
                break

    def _used_devices(self) -> dict[str, set[str]]:
        """Device instances held by allocations not yet complete or failed (one being
        stopped holds its device until its tasks are dead)."""
        used: dict[str, set[str]] = {}
        for a in self.s.allocs.values():
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
        drivers = {t["Driver"] for t in group["Tasks"]}
        # A static port taken on a node makes the node infeasible (docs: "network block",
        # static ports are reserved on the host).
        static = {int(p["Value"]) for n in group.get("Networks") or []
                  for p in n.get("ReservedPorts") or []}
        if static:
            nodes = [n for n in nodes if not static & {
                q["Value"] for a in self.s.allocs.values() if a["NodeID"] == n.id
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
                      job_allocs={n: sum(1 for a in live if a["NodeID"] == n) for n in self.s.nodes},
                      penalty_nodes=penalty, drivers=drivers)
        if node is None:
            return None
        used = self._used_devices().get(node.id, set())
        devices = []
        for name, count in need.items():
            devices += [d for d in node.devices.get(name, []) if d not in used][:count]
        self.s.index += 1
        index = len([a for a in self.s.allocs.values() if a["JobID"] == job["ID"]])
        alloc = {"ID": str(uuid.uuid4()), "Namespace": job["Namespace"], "JobID": job["ID"],
                 "Name": f"{job['ID']}.{group['Name']}[{index}]", "TaskGroup": group["Name"],
                 "NodeID": node.id, "NodeName": node.name, "ClientStatus": "pending",
                 "DesiredStatus": "run", "CreateIndex": self.s.index,
                 "AllocatedResources": {"Shared": {"Ports": self._ports(group, node)}},
                 "RescheduleTracker": None, "PreviousAllocation": None, "NextAllocation": None,
                 "_devices": devices, "_job": copy.deepcopy(job), "_group": copy.deepcopy(group),
                 "_index": index, "_failed_nodes": sorted(penalty),
                 "_created_s": time.monotonic()}
        if prev is not None:
            prev["NextAllocation"] = alloc["ID"]
            alloc["PreviousAllocation"] = prev["ID"]
            events = list((prev.get("RescheduleTracker") or {}).get("Events") or [])
            events.append({"PrevAllocID": prev["ID"], "PrevNodeID": prev["NodeID"],
                           "RescheduleTime": int(time.time() * 1e9)})
            alloc["RescheduleTracker"] = {"Events": events}
            alloc["_attempt"] = prev.get("_attempt", 0) + 1
        self.s.allocs[alloc["ID"]] = alloc
        starts.append(alloc["ID"])
        return alloc

    def _ports(self, group: dict, node: Node) -> list[dict]:
        taken = {p["Value"] for a in self.s.allocs.values() if a["NodeID"] == node.id
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


def _free_port(address: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
