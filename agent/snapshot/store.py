"""The local (NVMe) tier of snapshots: a directory with a byte capacity and reuse-aware eviction.

Each snapshot is a directory ``<root>/<snapshot_id>/`` written by ``writer.write_snapshot``
or staged from the remote tier.  The store keeps, per model key (``name@version``), a
*expected reuse* score and evicts the lowest first when room is needed:

    score = Σ over past restores i of 2 ** (-(now - t_i) / half_life_s)

a combined recency/frequency value (the CRF of LRFU: Lee et al., "LRFU: A Spectrum of
Policies that Subsumes the Least Recently Used and Least Frequently Used Policies", IEEE
Trans. Computers 50(12), 2001), kept incrementally: ``score ← score · 2^(−Δt/half_life) + 1``.
A model the predictor expects to need soon is pinned until a time and never evicted before
it; a snapshot being read (``with store.reading(id)``) is never evicted.  This answers the
"NVMe cache eviction of a trending model's snapshot" failure mode of the snapshot design
document (docs/architecture.md, "Failure modes").
"""

from __future__ import annotations

import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Iterator

from agent.clock import Clock, SystemClock
from agent.errors import ConfigError, DiskFull, SnapshotNotFound

DEFAULT_HALF_LIFE_S = 3600.0


@dataclass
class Entry:
    snapshot_id: str
    model_key: str
    size_bytes: int
    readers: int = 0


@dataclass
class Reuse:
    score: float = 0.0
    last_s: float = 0.0
    pinned_until_s: float = float("-inf")


def dir_size_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (symlinks not followed)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


class LocalStore:
    """Snapshots under ``root`` within ``capacity_bytes``; thread-safe.

    Raises ConfigError for a non-positive capacity or half-life.
    """

    def __init__(self, root: Path | str, capacity_bytes: int, *, clock: Clock | None = None,
                 half_life_s: float = DEFAULT_HALF_LIFE_S,
                 on_evict: Callable[[str], None] | None = None) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes={capacity_bytes} must be > 0",
                              name="capacity_bytes", value=capacity_bytes, limit=0)
        if half_life_s <= 0:
            raise ConfigError(f"half_life_s={half_life_s} must be > 0",
                              name="half_life_s", value=half_life_s, limit=0)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = int(capacity_bytes)
        self.half_life_s = float(half_life_s)
        self.clock = clock or SystemClock()
        self.on_evict = on_evict
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._reuse: dict[str, Reuse] = {}

    # -- bookkeeping -----------------------------------------------------------------------
    def path(self, snapshot_id: str) -> Path:
        if "/" in snapshot_id or snapshot_id in ("", ".", ".."):
            raise ConfigError(f"snapshot id {snapshot_id!r} is not a plain name",
                              name="snapshot_id", value=snapshot_id, limit="no '/'")
        return self.root / snapshot_id

    def add(self, snapshot_id: str, model_key: str, size_bytes: int | None = None) -> Entry:
        """Account for a snapshot now present at :meth:`path` (size measured when not given)."""
        path = self.path(snapshot_id)
        if not path.is_dir():
            raise SnapshotNotFound(f"{path}: no snapshot directory to add", path=path)
        size = dir_size_bytes(path) if size_bytes is None else int(size_bytes)
        with self._lock:
            entry = Entry(snapshot_id, model_key, size)
            self._entries[snapshot_id] = entry
            self._reuse.setdefault(model_key, Reuse(last_s=self.clock.now()))
            return entry

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.size_bytes for e in self._entries.values())

    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def has(self, snapshot_id: str) -> bool:
        with self._lock:
            return snapshot_id in self._entries

    def _decayed(self, reuse: Reuse, now: float) -> float:
        return reuse.score * 2.0 ** (-(now - reuse.last_s) / self.half_life_s)

    def score(self, model_key: str) -> float:
        """The model's expected-reuse score now (0 for a model never restored)."""
        with self._lock:
            reuse = self._reuse.get(model_key)
            return 0.0 if reuse is None else self._decayed(reuse, self.clock.now())

    def record_restore(self, model_key: str) -> float:
        """Count one restore of ``model_key``; returns the new score."""
        now = self.clock.now()
        with self._lock:
            reuse = self._reuse.setdefault(model_key, Reuse(last_s=now))
            reuse.score = self._decayed(reuse, now) + 1.0
            reuse.last_s = now
            return reuse.score

    def pin(self, model_key: str, until_s: float) -> None:
        """Keep ``model_key``'s snapshots until clock time ``until_s`` (predictor's hint)."""
        with self._lock:
            reuse = self._reuse.setdefault(model_key, Reuse(last_s=self.clock.now()))
            reuse.pinned_until_s = max(reuse.pinned_until_s, float(until_s))

    def unpin(self, model_key: str) -> None:
        with self._lock:
            if model_key in self._reuse:
                self._reuse[model_key].pinned_until_s = float("-inf")

    @contextmanager
    def reading(self, snapshot_id: str) -> Iterator[Path]:
        """Hold ``snapshot_id`` against eviction while it is read. Raises SnapshotNotFound."""
        with self._lock:
            entry = self._entries.get(snapshot_id)
            if entry is None:
                raise SnapshotNotFound(f"snapshot {snapshot_id!r} is not in the local tier",
                                       path=self.root / snapshot_id)
            entry.readers += 1
        try:
            yield self.root / snapshot_id
        finally:
            with self._lock:
                entry.readers -= 1

    # -- eviction --------------------------------------------------------------------------
    def evictable(self) -> list[Entry]:
        """Entries that may go now, lowest expected reuse first (oldest score first on ties)."""
        now = self.clock.now()
        with self._lock:
            out = []
            for e in self._entries.values():
                reuse = self._reuse.get(e.model_key, Reuse())
                if e.readers == 0 and reuse.pinned_until_s <= now:
                    out.append((self._decayed(reuse, now), reuse.last_s, e))
        return [e for _, _, e in sorted(out, key=lambda t: (t[0], t[1]))]

    def remove(self, snapshot_id: str, *, force: bool = False) -> bool:
        """Delete one snapshot; refuses (returns False) while it is read unless ``force``."""
        with self._lock:
            entry = self._entries.get(snapshot_id)
            if entry is None or (entry.readers and not force):
                return False
            del self._entries[snapshot_id]
        shutil.rmtree(self.root / snapshot_id, ignore_errors=True)
        if self.on_evict is not None:
            self.on_evict(snapshot_id)
        return True

    def make_room(self, need_bytes: int) -> list[str]:
        """Evict until ``need_bytes`` more fit in the capacity; returns the ids evicted.

        Raises DiskFull (``needed_bytes``, ``free_bytes``) when pinned or in-use snapshots
        leave too little room; nothing is evicted then.
        """
        need_bytes = int(need_bytes)
        free = self.capacity_bytes - self.used_bytes
        if need_bytes <= free:
            return []
        plan, gain = [], 0
        for entry in self.evictable():
            if free + gain >= need_bytes:
                break
            plan.append(entry.snapshot_id)
            gain += entry.size_bytes
        if free + gain < need_bytes:
            raise DiskFull(
                f"{self.root}: {need_bytes} bytes needed, {free} free and only {gain} evictable "
                f"of capacity_bytes={self.capacity_bytes} (the rest is pinned or being read)",
                path=self.root, needed_bytes=need_bytes, free_bytes=free + gain)
        return [sid for sid in plan if self.remove(sid)]
