"""The node agent's zygote pool: processes started ahead of need, one set per replica slot.

A restore takes a ready zygote (:meth:`ZygotePool.take`) instead of starting a process on the
request's path, and the pool is refilled in the background (:meth:`ZygotePool.refill`, on the
agent's executor) to ``target(device)`` zygotes per device (the agent's ``pool_target``).
Each refill starts zygotes at background CPU priority where the backend has one
(agent/node/priority.py: a refill beside serving replicas took their cores), warmed for the
snapshot ``warm_for(device)`` names (agent/replica/zygote.py ``warm_zygote``: the package
loaded and the golden check's calls run once before it is ready; nothing of it is trusted by
the restore), and replaces, the new one first, zygotes warmed for another snapshot (started
before the first capture, or for an older version).  A zygote started with no snapshot to warm
for still warms its device (agent/replica/warmup.py ``warm_device``).  A restore takes a zygote
warmed for the snapshot it restores before an older one that is not.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from collections.abc import Callable

from agent.node.backend import Backend, Zygote

log = logging.getLogger(__name__)


class ZygotePool:
    """Ready zygotes per device (``ready``: device -> zygotes, oldest first)."""

    def __init__(self, backend: Backend, devices: list[str], *, target: Callable[[str], int],
                 warm_for: Callable[[str], Path | None]) -> None:
        self.backend, self.target, self.warm_for = backend, target, warm_for
        self.ready: dict[str, list[Zygote]] = {d: [] for d in devices}
        self.last_model: dict[str, str] = {}   # device -> model of its last restore
        self._lock = threading.Lock()
        self._refilling = threading.Lock()      # one refill at a time: two would overshoot
        self.closed = False                     # after close(): nothing more is started

    def refill(self) -> int:
        """Start zygotes until each device has ``target(device)``, warmed for
        ``warm_for(device)``; returns how many started.  A device whose zygote cannot be
        started (the backend raised) is logged and left short until the next refill: the
        other devices are still refilled."""
        started = 0
        with self._refilling:
            for device in self.ready:
                try:
                    started += self._refill_device(device)
                except Exception as exc:   # whatever the backend raised: the next device
                    log.warning("zygote pool: refill of %s stopped at %d of %s ready: "
                                "%s: %s", device, len(self.ready[device]),
                                self.target(device), type(exc).__name__, exc)
        return started

    def _refill_device(self, device: str) -> int:
        zygotes = self.ready[device]
        want, snap = self.target(device), self.warm_for(device)
        self._drop_dead(device)
        started = self._rewarm(device, snap)
        while True:
            with self._lock:
                if self.closed or len(zygotes) >= want:
                    break
            zygote = self.backend.zygote(device, warm=snap)
            if not self._keep(zygotes, zygote):
                break
            started += 1
        return started

    def _keep(self, zygotes: list[Zygote], zygote: Zygote) -> bool:
        """Add a zygote just started to ``zygotes``; after close() (it ran while the zygote
        started) kill it instead, since nothing would later.  Returns whether it was kept."""
        with self._lock:
            if not self.closed:
                zygotes.append(zygote)
                return True
        zygote.kill()
        return False

    def _rewarm(self, device: str, snap: Path | None) -> int:
        """Replace, one at a time and the new one first, the zygotes of ``device`` warmed for
        another snapshot than ``snap``; returns how many started."""
        started, zygotes = 0, self.ready[device]
        while snap is not None:
            with self._lock:
                stale = None if self.closed else next((z for z in zygotes if z.warm != snap),
                                                      None)
            if stale is None:
                break
            fresh = self.backend.zygote(device, warm=snap)
            with self._lock:
                mine = stale in zygotes      # not taken by a restore (nor close) meanwhile
                if mine:
                    zygotes.remove(stale)
            kept = self._keep(zygotes, fresh)
            if mine:
                stale.kill()
            if not kept:
                break
            started += 1
        return started

    def take(self, device: str, model: str) -> Zygote:
        """A ready zygote of ``device`` for a restore of ``model``: the oldest one warmed for
        ``warm_for(device)`` (now that ``model`` is the device's last: the newest ready local
        snapshot of it, the one the restore ladder reads first), else the oldest ready (its
        restore builds the engine its warm-up did not); when none is ready, one started now,
        on the request's path (slower; at normal priority)."""
        with self._lock:
            self.last_model[device] = model
        self._drop_dead(device)
        snapshot = self.warm_for(device)
        with self._lock:
            zygotes = self.ready.get(device)
            if zygotes:
                warm = next((z for z in zygotes if snapshot is not None and z.warm == snapshot),
                            zygotes[0])
                zygotes.remove(warm)
                return warm
        return self.backend.zygote(device, background=False)

    def _drop_dead(self, device: str) -> None:
        """Take out (and reap) the zygotes of ``device`` that died while they waited: a
        restore from one fails, and the failure would be blamed on the snapshot."""
        with self._lock:
            zygotes = self.ready.get(device, [])
            dead = [z for z in zygotes if not _alive(z)]
            zygotes[:] = [z for z in zygotes if z not in dead]
        for z in dead:
            z.kill()

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {d: len(z) for d, z in self.ready.items()}

    def close(self) -> None:
        """Kill every ready zygote (after the refills have stopped)."""
        with self._lock:
            self.closed = True
            for zygotes in self.ready.values():
                for z in zygotes:
                    z.kill()
                zygotes.clear()


def _alive(zygote: Zygote) -> bool:
    """``zygote.alive()``; a backend's zygote without it counts as alive."""
    alive = getattr(zygote, "alive", None)
    return True if alive is None else bool(alive())
