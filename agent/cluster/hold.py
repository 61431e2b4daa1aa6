"""``rewarm hold MODEL``: the task of a replica allocation (jobs/rewarm-replica.nomad.hcl).

The allocation holds the GPU; this process turns that lease into a warm replica and back::

    start ──restore(MODEL, device of NVIDIA_VISIBLE_DEVICES)──► holding ──SIGTERM──► drain ──► exit 0
              │ refused / agent unreachable                   │ replica gone, or the agent
              ▼                                               ▼ silent for unreachable_s
            exit 1 (Nomad's restart/reschedule policy)      exit 1

The device: Nomad's nvidia device plugin sets ``NVIDIA_VISIBLE_DEVICES`` to the UUIDs it
gave the allocation; the first one is looked up in the node agent's inventory (``status``'s
``inventory.gpus[].uuid``) and passed as ``cuda:<index>``.  Without GPUs on the node (CPU
nodes, tests) no device is passed.  A drain refused because the replica is the model's last
without a durable snapshot (409) is logged and forced: the allocation is going away, and a
replica outside any allocation would hold a GPU Nomad believes free.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any
from collections.abc import Callable

from agent import logs
from agent.wire.control import control_call
from agent.errors import ConfigError, RewarmError

log = logging.getLogger(__name__)

Call = Callable[..., dict]


def device_for(status: dict[str, Any], visible: str | None) -> str | None:
    """``cuda:N`` for the first UUID in ``visible`` (NVIDIA_VISIBLE_DEVICES); None on a node
    without GPUs.  Raises ConfigError when the node has GPUs and none matches."""
    gpus = (status.get("inventory") or {}).get("gpus") or []
    if not gpus:
        return None
    uuid = (visible or "").split(",")[0].strip()
    for gpu in gpus:
        if gpu.get("uuid") == uuid:
            return f"cuda:{int(gpu['index'])}"
    raise ConfigError(f"NVIDIA_VISIBLE_DEVICES={visible!r}: no GPU of this node has that UUID",
                      name="NVIDIA_VISIBLE_DEVICES", value=visible,
                      limit=[g.get("uuid") for g in gpus])


class Hold:
    """One allocation's replica.  ``call(op, **fields)`` talks to the node agent."""

    def __init__(self, call: Call, model: str, *, poll_s: float = 1.0,
                 unreachable_s: float = 3.0, drain_timeout_s: float = 30.0,
                 out=sys.stdout) -> None:
        self.call, self.model = call, model
        self.poll_s, self.unreachable_s, self.drain_timeout_s = poll_s, unreachable_s, drain_timeout_s
        self.out = out
        self.replica: str | None = None
        self.stop = threading.Event()

    def restore(self) -> dict:
        device = device_for(self.call("status"), os.environ.get("NVIDIA_VISIBLE_DEVICES"))
        started = time.monotonic()
        answer = self.call("restore", model=self.model, **({"device": device} if device else {}))
        self.replica = answer["replica"]
        line = {"replica": self.replica, "model": self.model, "path": answer.get("path"),
                "device": answer.get("device"), "restore_s": time.monotonic() - started,
                "alloc": os.environ.get("NOMAD_ALLOC_ID")}
        print(json.dumps(line), file=self.out, flush=True)
        return line

    def watch(self) -> int:
        """Until ``stop`` is set (0, after the drain) or the replica is gone (1)."""
        silent_since = None
        while not self.stop.wait(self.poll_s):
            try:
                reps = self.call("status").get("replicas", [])
                silent_since = None
            except (RewarmError, OSError) as exc:
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since >= self.unreachable_s:
                    log.error("hold %s: node agent silent for %.0f s (%s); giving the "
                              "allocation up", self.replica, self.unreachable_s, exc)
                    return 1
                continue
            mine = [r for r in reps if r.get("replica") == self.replica]
            if not mine or mine[0].get("state") not in ("warm", "suspended"):
                log.error("hold %s: the replica is %s on its node; giving the allocation up",
                          self.replica, mine[0].get("state") if mine else "gone")
                return 1
        return self.drain()

    def drain(self) -> int:
        try:
            self.call("drain", replica=self.replica, timeout_s=self.drain_timeout_s)
        except RewarmError as exc:
            if getattr(exc, "status", None) != 409:
                log.warning("hold %s: drain failed: %s", self.replica, exc)
                return 0 if getattr(exc, "status", None) == 404 else 1
            log.warning("hold %s: %s; the allocation is stopping, so forcing it", self.replica,
                        exc)
            self.call("drain", replica=self.replica, timeout_s=self.drain_timeout_s, force=True)
        except OSError as exc:
            log.warning("hold %s: drain failed, node agent unreachable: %s", self.replica, exc)
        return 0


def run_hold(args) -> int:
    def call(op: str, **fields: Any) -> dict:
        return control_call(args.agent, op, timeout_s=args.timeout_s, fields=fields)

    hold = Hold(call, args.model, poll_s=args.poll_s, drain_timeout_s=args.drain_timeout_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: hold.stop.set())
    try:
        hold.restore()
    except (RewarmError, OSError, KeyError) as exc:
        logs.error(f"restore of {args.model} on {args.agent} failed: {exc}", model=args.model,
                   exit_code=1)
        return 1
    return hold.watch()
