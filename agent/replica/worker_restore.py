"""The replica's states and its two snapshot ops, ``restore`` and ``capture``.

:class:`RestoreOps` is the collaborator a :class:`agent.replica.worker.Worker` holds for them:
``restore`` moves a zygote (ZYGOTE) through RESTORING to SERVING, or back to ZYGOTE when it
fails; ``capture`` writes a loaded model's snapshot to a new path.  Both run their torch and
file work on the worker's engine thread (agent/replica/worker.py ``make_engine_thread``).
"""

from __future__ import annotations

import asyncio
import enum
import os
from pathlib import Path
from typing import TYPE_CHECKING

from agent.errors import ConfigError, ProtocolError
from agent.replica.model_text import ModelText

if TYPE_CHECKING:   # for the checker only: the worker imports this module
    from agent.replica.worker import Worker


class State(enum.Enum):
    ZYGOTE = "zygote"
    RESTORING = "restoring"
    SERVING = "serving"
    CLOSED = "closed"


class RestoreOps:
    """The ``restore`` and ``capture`` ops of ``worker`` (a Worker: its ``state``, ``buffer``,
    ``loaded``, ``text``, ``stats()`` and engine thread ``_pool``)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def restore(self, msg: dict) -> dict:
        """Restore ``msg["snapshot"]`` (a path; ``release`` binds its AOT package) into the
        zygote's buffer and serve it; returns the worker's stats.  Raises ProtocolError when
        this is not a zygote or the snapshot is not a path."""
        from agent.replica import zygote

        worker = self.worker
        if worker.state is not State.ZYGOTE:
            raise ProtocolError(f"restore needs a zygote; this replica is {worker.state.value}",
                                field="state", value=worker.state.value, limit=State.ZYGOTE.value)
        if not isinstance(msg.get("snapshot"), str):
            raise ProtocolError("restore needs snapshot: path", field="snapshot",
                                value=msg.get("snapshot"), limit="str")
        worker.state = State.RESTORING
        release = msg.get("release")
        try:
            loaded = await asyncio.get_running_loop().run_in_executor(
                worker._pool, lambda: zygote.restore(Path(msg["snapshot"]), buffer=worker.buffer,
                                                     release=Path(release) if release else None,
                                                     path="zygote_restore"))
        except BaseException:
            worker.state = State.ZYGOTE  # fail closed: still a zygote, never serving
            raise
        worker.loaded, worker.state = loaded, State.SERVING
        worker.apply_step_target()
        worker.text = ModelText(loaded)
        worker.text.preload_in_background()   # at once when the zygote preloaded it (warm)
        return worker.stats()

    async def capture(self, msg: dict) -> dict:
        """Write the loaded model's snapshot to ``msg["dest"]``, a path that must not exist;
        returns ``dest``, ``total_bytes`` and ``golden_prompts``.  Raises ProtocolError with no
        model loaded or no path, ConfigError when ``dest`` exists."""
        from agent.replica import zygote

        worker = self.worker
        if worker.loaded is None:
            raise ProtocolError("capture needs a loaded model", field="state",
                                value=worker.state.value, limit=State.SERVING.value)
        if not isinstance(msg.get("dest"), str):
            raise ProtocolError(f"capture needs dest: path, got {msg.get('dest')!r}",
                                field="dest", value=msg.get("dest"), limit="str")
        if os.path.lexists(msg["dest"]):
            raise ConfigError(f"capture: dest {msg['dest']} already exists; a snapshot is never "
                              "written over another", name="dest", value=msg["dest"],
                              limit="a path that does not exist")
        manifest = await asyncio.get_running_loop().run_in_executor(
            worker._pool, zygote.capture, worker.loaded, Path(msg["dest"]))
        return {"dest": msg["dest"], "total_bytes": manifest.total_bytes,
                "golden_prompts": len(manifest.golden.prompts) if manifest.golden else 0}
