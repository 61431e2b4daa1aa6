"""Where the agent's replicas run: two small protocols and the in-process implementation.

The agent only needs a :class:`Backend` that makes zygotes and cold-boots replicas, a
:class:`Zygote` that turns into a replica by restoring a snapshot (pins, checksums and the
golden check verified inside; any failure raises and the zygote is spent), and a
:class:`Replica` it can ask for stats, a capture, its in-flight count and a shutdown.

:class:`InProcessBackend` runs them inside the agent with agent/replica/zygote.py (the
embedded default for one machine, and what the agent's tests use: real snapshots, real
restores, real golden checks on tiny models).  Replicas in their own processes (``rewarm
replica``, needed for suspend/resume and for kill-9 isolation) implement the same protocols.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

from agent.snapshot.format import ModelIdentity


@dataclass(frozen=True)
class ModelSpec:
    """A model this node may serve: ``model_dir`` is the HF-layout checkpoint (config.json +
    safetensors); ``release`` an optional AOT package directory for this target."""

    model_dir: Path
    release: Path | None = None
    name_override: str | None = None

    @cached_property
    def identity(self) -> ModelIdentity:
        from agent.replica.zygote import source_identity

        return source_identity(Path(self.model_dir))

    @property
    def name(self) -> str:
        return self.name_override or self.identity.name

    @property
    def version(self) -> str:
        return self.identity.version

    @property
    def key(self) -> str:
        """``name@version``: the unit the snapshot store counts reuse by."""
        return f"{self.name}@{self.version}"


class Replica(Protocol):
    replica_id: str
    address: str

    @property
    def pid(self) -> int | None:
        """The process the CUDA checkpoint API acts on; None when in-process."""
        ...

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 seed: int | None = None) -> list[list[int]]: ...
    def stats(self, timeout_s: float | None = None) -> dict[str, Any]: ...
    def in_flight(self) -> int: ...
    def capture(self, dest: Path) -> None: ...
    def shutdown(self) -> None: ...


class Zygote(Protocol):
    device: str
    warm: Path | None     # the snapshot it was asked to warm for (None: not warmed)

    @property
    def pid(self) -> int | None:
        """Its process; None when in-process."""
        ...

    def restore(self, snapshot: Path, replica_id: str) -> Replica: ...
    def kill(self) -> None: ...
    def alive(self) -> bool:
        """Whether it can still restore (its process runs; not used or killed)."""
        ...


class Backend(Protocol):
    def zygote(self, device: str, *, warm: Path | None = None,
               background: bool = True) -> Zygote:
        """A zygote on ``device``, warmed for the snapshot ``warm`` when given; started
        ``background`` (ahead of need: at background priority where the backend has one) or
        for a restore waiting on it."""
        ...
    def cold_boot(self, spec: ModelSpec, device: str, replica_id: str) -> Replica: ...


# --- in-process ---------------------------------------------------------------------------

class InProcessReplica:
    """A Loaded model (agent/replica/zygote.py) served from inside the agent, one batch at a time."""

    pid = None

    def __init__(self, replica_id: str, loaded: Any) -> None:
        self.replica_id = replica_id
        self.address = f"inproc:{replica_id}"
        self.loaded = loaded
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 seed: int | None = None) -> list[list[int]]:
        """Token ids [P][<= max_tokens] for prompts [P][S_p]. Raises RuntimeError after shutdown."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"replica {self.replica_id} is shut down")
            self._in_flight += 1
        try:
            return self.loaded.engine.generate(prompts, max_tokens, seed=seed)
        finally:
            with self._lock:
                self._in_flight -= 1

    @property
    def restore_io(self) -> str | None:
        """gds | compat | host for a restore (agent/snapshot/gpu.py), None for a boot."""
        return getattr(self.loaded, "restore_io", None)

    @property
    def fallback(self) -> str | None:
        """Why a device restore read through host memory instead, or None."""
        return getattr(self.loaded, "fallback", None)

    def stats(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The replica's stats (in-process: answered at once; ``timeout_s`` has nothing to
        bound)."""
        cap = self.loaded.engine.capacity()
        return {"model": self.loaded.identity.name, "version": self.loaded.identity.version,
                "path": self.loaded.path, **cap, **self.loaded.engine.speed_report(),
                "in_flight": self._in_flight, "phases_s": dict(self.loaded.phases_s)}

    def in_flight(self) -> int:
        return self._in_flight

    def capture(self, dest: Path) -> None:
        from agent.replica import zygote

        zygote.capture(self.loaded, Path(dest))

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
        self.loaded = _Closed(self.loaded)


class _Closed:
    """What a shut-down replica keeps: its identity, no weights."""

    def __init__(self, loaded: Any) -> None:
        self.identity, self.path = loaded.identity, loaded.path


class InProcessZygote:
    """A restore buffer allocated ahead of need (``buffer_bytes``): page-aligned host memory
    on the CPU, a :class:`~agent.snapshot.gpu.DeviceBuffer` on a GPU (``kvikio``: the module
    it reads with, default the real one)."""

    pid = None
    warm: Path | None = None

    def __init__(self, device: str, buffer_bytes: int, kvikio: Any = None) -> None:
        from agent.snapshot.reader import HostBuffer

        self.device = device
        self.buffer: Any = None
        if buffer_bytes > 0 and device != "cpu":
            from agent.snapshot.gpu import DeviceBuffer

            self.buffer = DeviceBuffer.allocate(buffer_bytes, device, kvikio=kvikio)
        elif buffer_bytes > 0:
            self.buffer = HostBuffer.allocate(buffer_bytes)
        self.spent = False

    def restore(self, snapshot: Path, replica_id: str) -> InProcessReplica:
        """Restore + golden check. Raises SnapshotError, GoldenMismatch, RuntimeError (spent)."""
        from agent.replica import zygote
        from agent.snapshot.reader import read_manifest

        if self.spent:
            raise RuntimeError("zygote already used")
        self.spent = True
        buffer = self.buffer
        if (buffer is not None and self.device == "cpu"
                and read_manifest(snapshot).total_bytes > buffer.capacity_bytes):
            buffer = None  # too small for this model: the reader allocates its own
                           # (a DeviceBuffer is kept: it carries the kvikio to read with)
        loaded = zygote.restore(Path(snapshot), buffer=buffer, path="zygote_restore",
                                device=self.device)
        return InProcessReplica(replica_id, loaded)

    def kill(self) -> None:
        self.spent = True
        self.buffer = None

    def alive(self) -> bool:
        return not self.spent


@dataclass
class InProcessBackend:
    """Zygotes and cold boots inside the agent's process; ``buffer_bytes`` per zygote;
    ``kvikio``: the module GPU zygotes read with (default the real one; tests pass a fake)."""

    buffer_bytes: int = 64 << 20
    cold_boots: list[str] = field(default_factory=list)
    kvikio: Any = None

    def zygote(self, device: str, *, warm: Path | None = None,
               background: bool = True) -> InProcessZygote:
        """In the agent's process: no priority of its own, and no warm-up (a restore here
        builds its engine anew)."""
        zygote = InProcessZygote(device, self.buffer_bytes, self.kvikio)
        zygote.warm = warm
        return zygote

    def cold_boot(self, spec: ModelSpec, device: str, replica_id: str) -> InProcessReplica:
        """Full boot from the checkpoint (+ AOT package). Raises InvalidCheckpoint, TargetMismatch."""
        from agent.replica import zygote

        self.cold_boots.append(spec.key)
        return InProcessReplica(replica_id, zygote.boot(Path(spec.model_dir), release=spec.release,
                                                        device=device))


_ids = itertools.count(1)


def new_replica_id(node_id: str) -> str:
    """Unique within this agent's life: ``<node>-r<pid>-<n>``."""
    return f"{node_id}-r{os.getpid()}-{next(_ids)}"
