"""The Nomad stand-in's client half: runs an allocation's ``raw_exec`` tasks (tests only).

Written from Nomad's documentation:

- "raw_exec task driver" (docs/drivers/raw_exec): ``command`` and ``args`` run as a process of
  the client with no isolation; here in the node's network namespace (``ip netns exec``) when
  the node has one, its own process group, cwd the task directory;
- "task block": ``kill_signal`` (default SIGINT) is sent to stop the task, SIGKILL after
  ``kill_timeout`` (default 5 s) capped at the client's ``max_kill_timeout`` (30 s by
  default; ``client/allocrunner/taskrunner/driver_handle.go``: ``min(task.KillTimeout,
  maxKillTimeout)``); the group's or task's ``shutdown_delay`` waits between the services'
  deregistration and the kill signal;
- "Runtime Environment" (docs/runtime/environment): ``NOMAD_ALLOC_ID``, ``NOMAD_ALLOC_NAME``,
  ``NOMAD_ALLOC_INDEX``, ``NOMAD_JOB_ID``, ``NOMAD_JOB_NAME``, ``NOMAD_GROUP_NAME``,
  ``NOMAD_TASK_NAME``, ``NOMAD_NAMESPACE``, ``NOMAD_REGION``, ``NOMAD_DC``, ``NOMAD_ALLOC_DIR``,
  ``NOMAD_TASK_DIR``, ``NOMAD_SECRETS_DIR``, ``NOMAD_CPU_LIMIT``, ``NOMAD_MEMORY_LIMIT``,
  ``NOMAD_IP_<label>``, ``NOMAD_PORT_<label>``, ``NOMAD_ADDR_<label>``,
  ``NOMAD_HOST_PORT_<label>``, ``NOMAD_META_<key>``; the client's own environment is passed
  through less the client's ``env.denylist`` (default: CONSUL_TOKEN, CONSUL_HTTP_TOKEN,
  VAULT_TOKEN, NOMAD_TOKEN, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...); ``${...}`` in
  ``config``/``env`` is interpolated from these and the node's attributes;
- "identity block": ``env = true`` sets ``NOMAD_TOKEN`` to the task's workload identity;
- "template block" with ``nomadVar`` (docs/job-specification/template, "Nomad Variables"):
  ``{{ with nomadVar "PATH" }}...{{ .KEY }}...{{ end }}`` reads a variable the task may read
  (``nomad/jobs``, ``nomad/jobs/<job>``, ``nomad/jobs/<job>/<group>``,
  ``nomad/jobs/<job>/<group>/<task>``: "Task Access to Variables"); ``env = true`` adds the
  rendered ``KEY=VALUE`` lines to the task's environment; a template that cannot render
  fails the task;
- "restart block": a task that exits (service and system jobs: whatever its exit code) is
  restarted after ``delay``, at most ``attempts`` times per ``interval``; then ``mode``
  ``fail`` fails the allocation, ``delay`` waits for the next interval.
- "device block" / NVIDIA device plugin: ``NVIDIA_VISIBLE_DEVICES`` lists the instances given.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

ENV_DENYLIST = ("CONSUL_TOKEN", "CONSUL_HTTP_TOKEN", "VAULT_TOKEN", "NOMAD_TOKEN",
                "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                "GOOGLE_APPLICATION_CREDENTIALS")
_INTERP = re.compile(r"\$\{([^}]+)\}")
_WITH_VAR = re.compile(r'\{\{-?\s*with\s+nomadVar\s+"([^"]+)"\s*-?\}\}(.*?)\{\{-?\s*end\s*-?\}\}',
                       re.S)
_FIELD = re.compile(r"\{\{-?\s*\.([A-Za-z_][A-Za-z0-9_]*)\s*-?\}\}")
NS = 1e-9


class TemplateError(RuntimeError):
    pass


def render_template(text: str, read_var, allowed) -> str:
    """The subset of consul-template the jobs use: ``with nomadVar "P"`` and ``.KEY``."""
    def block(m: re.Match) -> str:
        path = m.group(1)
        if not allowed(path):
            raise TemplateError(f"nomadVar {path!r}: Permission denied")
        items = read_var(path)
        if items is None:
            return ""          # `with` on a missing variable renders nothing
        return _FIELD.sub(lambda f: str(items.get(f.group(1), "")), m.group(2))
    return _WITH_VAR.sub(block, text)


def env_lines(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


class TaskRunner:
    """Runs one task of one allocation until stopped or its restart policy gives up.

    ``on_exit(runner, failed)`` is called once when the task is dead for good."""

    def __init__(self, *, alloc: dict, task: dict, node, env: dict[str, str], netns: str | None,
                 task_dir: Path, restart: dict, on_exit, shutdown_delay_s: float = 0.0,
                 max_kill_timeout_s: float = 30.0) -> None:
        self.alloc, self.task, self.node, self.netns = alloc, task, node, netns
        self.env, self.task_dir, self.restart = env, task_dir, restart
        self.on_exit, self.shutdown_delay_s = on_exit, shutdown_delay_s
        self.kill_timeout_s = min((task.get("KillTimeout") or 5e9) * NS, max_kill_timeout_s)
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.events: list[dict] = []
        self.state = "pending"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"task-{alloc['ID'][:8]}-{task['Name']}")

    def interpolate(self, text: str) -> str:
        def one(m: re.Match) -> str:
            key = m.group(1)
            if key in self.env:
                return self.env[key]
            value = self.node.lookup(key)
            return value if value is not None else m.group(0)
        return _INTERP.sub(one, text)

    def start(self) -> TaskRunner:
        self._thread.start()
        return self

    def _event(self, kind: str, **extra) -> None:
        self.events.append({"Type": kind, "Time": int(time.time() * 1e9), **extra})

    def _spawn(self) -> subprocess.Popen:
        config = self.task.get("Config") or {}
        argv = [self.interpolate(str(config["command"]))]
        argv += [self.interpolate(str(a)) for a in config.get("args") or []]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self.task_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.task_dir / "stdout.log", "ab")
        err = open(self.task_dir / "stderr.log", "ab")
        try:
            return subprocess.Popen(argv, cwd=self.task_dir, env=self.env, stdout=out,
                                    stderr=err, start_new_session=True)
        finally:
            out.close()
            err.close()

    def _run(self) -> None:
        attempts = int(self.restart.get("Attempts", 2))
        interval_s = (self.restart.get("Interval") or 30 * 60e9) * NS
        delay_s = (self.restart.get("Delay") or 15e9) * NS
        mode = self.restart.get("Mode", "fail")
        window: list[float] = []
        while not self._stop.is_set():
            try:
                self.proc = self._spawn()
            except OSError as exc:
                self._event("Driver Failure", DisplayMessage=str(exc))
                self.state = "dead"
                self.on_exit(self, True)
                return
            self.state = "running"
            self._event("Started")
            code = self.proc.wait()
            if self._stop.is_set():
                break
            self._event("Terminated", ExitCode=code)
            now = time.monotonic()
            window = [t for t in window if now - t < interval_s]
            if len(window) >= attempts:
                if mode == "fail":
                    self._event("Not Restarting", DisplayMessage="Exceeded allowed attempts")
                    self.state = "dead"
                    self.on_exit(self, True)
                    return
                wait_s = interval_s - (now - window[0])      # mode "delay"
            else:
                wait_s = delay_s
            window.append(now)
            self.restarts += 1
            self._event("Restarting", DisplayMessage=f"restarting in {wait_s:.1f}s")
            if self._stop.wait(wait_s):
                break
        self.state = "dead"

    def kill(self) -> None:
        """Stop for good: shutdown_delay, kill_signal, SIGKILL after kill_timeout."""
        self._stop.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            if self.shutdown_delay_s:
                time.sleep(self.shutdown_delay_s)
            sig = getattr(signal, self.task.get("KillSignal") or "SIGINT", signal.SIGINT)
            self._event("Killing", Signal=int(sig))
            _signal_group(proc, sig)
            try:
                proc.wait(timeout=self.kill_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        if proc is not None:
            _signal_group(proc, signal.SIGKILL)   # anything the task left in its group
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.state = "dead"
        self._event("Killed")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
