"""The Nomad stand-in's client agent: runs and stops the allocations placed on its nodes.

Written from Nomad's client (``client/allocrunner``) and its documentation:

- the task environment ("Runtime Environment", ``client/taskenv``): ``NOMAD_*`` variables,
  the client's own environment less ``env.denylist`` (``nomad_runner.ENV_DENYLIST``),
  ``NVIDIA_VISIBLE_DEVICES`` from the device plugin, ``NOMAD_TOKEN`` when the task's
  ``identity`` has ``env = true``;
- templates render before the task starts; one the task may not read fails the allocation
  ("Template Failure");
- ``client/allocrunner/taskrunner/volume_hook.go``: a ``volume_mount`` on a driver without
  mount support fails the task in prestart ("does not support host volumes");
- stop: the group's services are deregistered, the group's ``shutdown_delay`` (or the
  task's, whichever is longer) is waited out, then ``kill_signal`` and SIGKILL after
  ``min(kill_timeout, max_kill_timeout)`` (``driver_handle.go``, ``NewDriverHandle``; the
  client's ``max_kill_timeout`` is 30 s by default);
- a failed allocation is rescheduled after its policy's delay (exponential: doubled per
  attempt, capped at ``max_delay``; ``structs.ReschedulePolicy``).
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

from tests.cluster.nomad_jobspec import SCHEMA
from tests.cluster.nomad_runner import ENV_DENYLIST, TaskRunner, env_lines, render_template

NS = 1e-9


class ClientHalf:
    """Runs allocations for ``server`` (a NomadStandIn): its lock, allocations, nodes,
    runners, variables and ACL identities."""

    def __init__(self, server) -> None:
        self.s = server

    def task_env(self, alloc: dict, task: dict, node, task_dir: Path) -> dict[str, str]:
        job, group = alloc["_job"], alloc["_group"]
        env = {k: v for k, v in self.s.base_env.items() if k not in ENV_DENYLIST}
        alloc_dir = self.s.data_dir / alloc["ID"] / "alloc"
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
            self.s.acl.identities[token] = (alloc["ID"], task["Name"])
            env["NOMAD_TOKEN"] = token
        return env

    def start(self, alloc_id: str) -> None:
        s = self.s
        with s.lock:
            alloc = s.allocs[alloc_id]
            node = s.nodes[alloc["NodeID"]]
            group = alloc["_group"]
            runners = []
            for task in group["Tasks"]:
                task_dir = s.data_dir / alloc_id / task["Name"]
                (task_dir / "local").mkdir(parents=True, exist_ok=True)
                (task_dir / "secrets").mkdir(parents=True, exist_ok=True)
                (s.data_dir / alloc_id / "alloc").mkdir(parents=True, exist_ok=True)
                env = self.task_env(alloc, task, node, task_dir)
                delay_s = max(group.get("ShutdownDelay") or 0, task.get("ShutdownDelay") or 0) * NS
                runner = TaskRunner(alloc=alloc, task=task, node=node, env=env,
                                    netns=node.netns, task_dir=task_dir,
                                    restart=group.get("RestartPolicy") or {},
                                    on_exit=self.task_dead, shutdown_delay_s=delay_s,
                                    max_kill_timeout_s=node.max_kill_timeout_s)
                try:
                    self._prestart(alloc, task, runner, task_dir)
                except RuntimeError as exc:
                    kind = "Template Failure" if "nomadVar" in str(exc) else "Setup Failure"
                    runner._event(kind, DisplayMessage=str(exc))
                    alloc["ClientStatus"] = "failed"
                    self.schedule_reschedule(alloc)
                    s.runners[alloc_id] = [runner]
                    return
                runner.env.update({k: runner.interpolate(str(v))
                                   for k, v in (task.get("Env") or {}).items()})
                runners.append(runner)
            s.runners[alloc_id] = runners
            alloc["ClientStatus"] = "running"
            alloc["_running_since_s"] = time.monotonic()
        for r in runners:
            r.start()

    def _prestart(self, alloc, task, runner, task_dir) -> None:
        mounts = (SCHEMA["drivers"].get(task["Driver"]) or {}).get("mount_configs")
        if task.get("VolumeMounts") and mounts == "drivers.MountConfigSupportNone":
            raise RuntimeError(f'task driver "{task["Driver"]}" for "{task["Name"]}" does not '
                               "support host volumes")
        job_id, group = alloc["JobID"], alloc["_group"]["Name"]
        prefixes = {"nomad/jobs", f"nomad/jobs/{job_id}", f"nomad/jobs/{job_id}/{group}",
                    f"nomad/jobs/{job_id}/{group}/{task['Name']}"}

        def read(path):
            var = self.s.variables.get((alloc["Namespace"], path))
            return None if var is None else var["Items"]
        for tmpl in task.get("Templates") or []:
            text = render_template(tmpl.get("EmbeddedTmpl", ""), read, lambda p: p in prefixes)
            dest = task_dir / tmpl["DestPath"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
            if tmpl.get("Envvars"):
                runner.env.update(env_lines(text))

    def task_dead(self, runner: TaskRunner, failed: bool) -> None:
        s = self.s
        with s.lock:
            alloc = s.allocs.get(runner.alloc["ID"])
            if alloc is None or alloc.get("_stopping"):
                return
            alloc["ClientStatus"] = "failed" if failed else "complete"
            if failed:
                self.schedule_reschedule(alloc)
        for other in s.runners.get(runner.alloc["ID"], []):
            if other is not runner:
                threading.Thread(target=other.kill, daemon=True).start()

    @staticmethod
    def schedule_reschedule(alloc: dict) -> None:
        policy = alloc["_group"].get("ReschedulePolicy") or {}
        delay = (policy.get("Delay") or 30e9) * NS
        attempt = alloc.get("_attempt", 0)
        if policy.get("DelayFunction", "exponential") == "exponential":
            delay *= 2 ** attempt
        max_delay = (policy.get("MaxDelay") or 3600e9) * NS
        alloc["_reschedule_at"] = time.monotonic() + min(delay, max_delay)

    def stop(self, alloc_id: str) -> None:
        s = self.s
        with s.lock:
            runners = list(s.runners.get(alloc_id, []))
        threads = [threading.Thread(target=r.kill) for r in runners]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with s.lock:
            alloc = s.allocs[alloc_id]
            if alloc["ClientStatus"] in ("running", "pending"):
                alloc["ClientStatus"] = "complete"
            for token, (owner, _task) in list(s.acl.identities.items()):
                if owner == alloc_id:
                    del s.acl.identities[token]
