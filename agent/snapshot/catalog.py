"""The node's SQLite catalog: snapshots, replicas, cold-start events and traffic forecasts.

Tables follow the data model of docs/architecture.md ("Snapshots", "Data model"): ``snapshots`` (status pending/ready/corrupt/stale, the driver pin, size and digest,
remote URI), ``replicas`` (lifecycle state and the snapshot it came from), ``traffic_forecasts``
and a ``cold_starts`` event log (the document's ColdStartEvent as rows).  Status only moves
along :data:`STATUS_MOVES`; a snapshot that went corrupt or stale never becomes ready again.

One connection per catalog, guarded by a lock, so the agent's threads can share it; times are
seconds from the injected clock (``*_s``).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from agent.clock import Clock, SystemClock
from agent.errors import ConfigError, SnapshotError, SnapshotNotFound

STATUSES = ("pending", "ready", "corrupt", "stale")
STATUS_MOVES: dict[str, frozenset[str]] = {
    "pending": frozenset({"ready", "corrupt", "stale"}),
    "ready": frozenset({"corrupt", "stale"}),
    "corrupt": frozenset(),
    "stale": frozenset(),
}
"""Status moves forward only: a failed or outdated snapshot is never trusted again."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    snapshot_id   TEXT PRIMARY KEY,
    model_name    TEXT NOT NULL,
    model_version TEXT NOT NULL,
    path          TEXT NOT NULL,
    remote_uri    TEXT,
    driver_version TEXT NOT NULL,
    pins          TEXT NOT NULL,          -- JSON of the manifest's Pins
    size_bytes    INTEGER NOT NULL,
    digest        TEXT NOT NULL,
    status        TEXT NOT NULL CHECK (status IN ('pending', 'ready', 'corrupt', 'stale')),
    reason        TEXT NOT NULL DEFAULT '',
    created_s     REAL NOT NULL,
    updated_s     REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_snapshots_model
    ON snapshots (model_name, model_version, status, created_s DESC);
CREATE TABLE IF NOT EXISTS replicas (
    replica_id    TEXT PRIMARY KEY,
    model_name    TEXT NOT NULL,
    model_version TEXT NOT NULL,
    node_id       TEXT NOT NULL,
    device        TEXT NOT NULL,
    state         TEXT NOT NULL CHECK (state IN
                  ('cold', 'restoring', 'warm', 'suspended', 'draining', 'dead')),
    snapshot_id   TEXT REFERENCES snapshots(snapshot_id),
    last_active_s REAL NOT NULL,
    created_s     REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_replicas_model_state ON replicas (model_name, state);
CREATE TABLE IF NOT EXISTS cold_starts (
    event_id      INTEGER PRIMARY KEY AUTOINCREMENT,
    replica_id    TEXT,
    model_name    TEXT NOT NULL,
    path          TEXT NOT NULL,          -- restore | staged_restore | cold_boot | resume
    outcome       TEXT NOT NULL,          -- ok | failed: <reason>
    duration_s    REAL NOT NULL,
    at_s          REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS traffic_forecasts (
    model_name     TEXT NOT NULL,
    window_start_s REAL NOT NULL,
    forecast_rps   REAL NOT NULL,
    actual_rps     REAL,
    target_replicas INTEGER NOT NULL,
    PRIMARY KEY (model_name, window_start_s)
);
"""


@dataclass(frozen=True)
class SnapshotRow:
    snapshot_id: str
    model_name: str
    model_version: str
    path: str
    remote_uri: str | None
    driver_version: str
    pins: dict[str, Any]
    size_bytes: int
    digest: str
    status: str
    reason: str
    created_s: float
    updated_s: float


class StatusRegression(SnapshotError, ValueError):
    """A snapshot status move against :data:`STATUS_MOVES`. Attributes: ``snapshot_id``,
    ``value`` (from, to), ``limit`` (allowed targets)."""


class Catalog:
    """SQLite catalog at ``path`` (``":memory:"`` for tests)."""

    def __init__(self, path: str | Path, clock: Clock | None = None) -> None:
        self.clock = clock or SystemClock()
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            with self._lock:
                if str(path) != ":memory:":
                    self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA foreign_keys=ON")
                self._db.executescript(SCHEMA)
        except sqlite3.Error as exc:
            raise ConfigError(f"catalog {path}: cannot open it as an SQLite database: {exc}",
                              name="catalog", value=str(path),
                              limit="a writable SQLite file in an existing directory") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, tuple(params)).fetchall()

    # -- snapshots -----------------------------------------------------------------------
    def add_snapshot(self, snapshot_id: str, *, model_name: str, model_version: str, path: str,
                     pins: dict[str, Any], size_bytes: int, digest: str,
                     remote_uri: str | None = None, status: str = "pending") -> SnapshotRow:
        """Insert a snapshot row (``pending`` unless told). Raises ValueError on a bad status
        and sqlite3.IntegrityError on a duplicate id."""
        if status not in STATUSES:
            raise ValueError(f"snapshot status {status!r} not one of {STATUSES}")
        now = self.clock.now()
        driver = str(pins.get("cuda_driver", "cpu"))
        self._exec("INSERT INTO snapshots VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                   (snapshot_id, model_name, model_version, path, remote_uri, driver,
                    json.dumps(pins, sort_keys=True), int(size_bytes), digest, status, "",
                    now, now))
        return self.snapshot(snapshot_id)

    def snapshot(self, snapshot_id: str) -> SnapshotRow:
        rows = self._exec("SELECT * FROM snapshots WHERE snapshot_id = ?", (snapshot_id,))
        if not rows:
            raise SnapshotNotFound(f"no snapshot {snapshot_id!r} in the catalog", path=snapshot_id)
        return _snapshot_row(rows[0])

    def set_status(self, snapshot_id: str, status: str, reason: str = "") -> SnapshotRow:
        """Move a snapshot's status forward. Raises StatusRegression, SnapshotNotFound."""
        with self._lock:
            rows = self._db.execute("SELECT status FROM snapshots WHERE snapshot_id = ?",
                                    (snapshot_id,)).fetchall()
            if not rows:
                raise SnapshotNotFound(f"no snapshot {snapshot_id!r} in the catalog",
                                       path=snapshot_id)
            before = rows[0]["status"]
            if status != before and status not in STATUS_MOVES[before]:
                allowed = sorted(STATUS_MOVES[before])
                raise StatusRegression(
                    f"snapshot {snapshot_id}: status {before} -> {status} not allowed; "
                    f"from {before} only {allowed}", snapshot_id=snapshot_id,
                    value=(before, status), limit=allowed)
            self._db.execute("UPDATE snapshots SET status = ?, reason = ?, updated_s = ? "
                             "WHERE snapshot_id = ?",
                             (status, reason, self.clock.now(), snapshot_id))
        return self.snapshot(snapshot_id)

    def set_remote(self, snapshot_id: str, remote_uri: str) -> None:
        self._exec("UPDATE snapshots SET remote_uri = ? WHERE snapshot_id = ?",
                   (remote_uri, snapshot_id))

    def snapshots(self, model_name: str | None = None, model_version: str | None = None,
                  status: str | None = None) -> list[SnapshotRow]:
        """Matching rows, newest first."""
        sql, params = "SELECT * FROM snapshots WHERE 1=1", []
        for col, val in (("model_name", model_name), ("model_version", model_version),
                         ("status", status)):
            if val is not None:
                sql += f" AND {col} = ?"
                params.append(val)
        rows = self._exec(sql + " ORDER BY created_s DESC, rowid DESC", params)
        return [_snapshot_row(r) for r in rows]

    def newest_ready(self, model_name: str, model_version: str) -> SnapshotRow | None:
        rows = self.snapshots(model_name, model_version, "ready")
        return rows[0] if rows else None

    def remove_snapshot(self, snapshot_id: str) -> None:
        """Forget a snapshot (evicted locally and not held remotely); replicas keep no link."""
        with self._lock:
            self._db.execute("UPDATE replicas SET snapshot_id = NULL WHERE snapshot_id = ?",
                             (snapshot_id,))
            self._db.execute("DELETE FROM snapshots WHERE snapshot_id = ?", (snapshot_id,))

    def durable_ready(self, model_name: str) -> bool:
        """True when a ready snapshot of ``model_name`` also has a remote copy (the scale-in
        guard against the idle-timeout race: docs/architecture.md, "Failure modes")."""
        rows = self._exec("SELECT 1 FROM snapshots WHERE model_name = ? AND status = 'ready' "
                          "AND remote_uri IS NOT NULL LIMIT 1", (model_name,))
        return bool(rows)

    # -- replicas ------------------------------------------------------------------------
    def upsert_replica(self, replica_id: str, *, model_name: str, model_version: str,
                       node_id: str, device: str, state: str,
                       snapshot_id: str | None = None) -> None:
        now = self.clock.now()
        self._exec(
            "INSERT INTO replicas VALUES (?,?,?,?,?,?,?,?,?) ON CONFLICT(replica_id) DO UPDATE "
            "SET state = excluded.state, snapshot_id = COALESCE(excluded.snapshot_id, "
            "replicas.snapshot_id), last_active_s = excluded.last_active_s",
            (replica_id, model_name, model_version, node_id, device, state, snapshot_id,
             now, now))

    def replica(self, replica_id: str) -> dict[str, Any] | None:
        rows = self._exec("SELECT * FROM replicas WHERE replica_id = ?", (replica_id,))
        return dict(rows[0]) if rows else None

    def replicas(self, model_name: str | None = None, states: Iterable[str] | None = None
                 ) -> list[dict[str, Any]]:
        sql, params = "SELECT * FROM replicas WHERE 1=1", []
        if model_name is not None:
            sql += " AND model_name = ?"
            params.append(model_name)
        if states is not None:
            states = list(states)
            sql += f" AND state IN ({','.join('?' * len(states))})"
            params.extend(states)
        return [dict(r) for r in self._exec(sql + " ORDER BY created_s", params)]

    # -- events and forecasts ------------------------------------------------------------
    def record_cold_start(self, model_name: str, path: str, outcome: str, duration_s: float,
                          replica_id: str | None = None) -> None:
        self._exec("INSERT INTO cold_starts (replica_id, model_name, path, outcome, duration_s, "
                   "at_s) VALUES (?,?,?,?,?,?)",
                   (replica_id, model_name, path, outcome, float(duration_s), self.clock.now()))

    def cold_starts(self, model_name: str | None = None) -> list[dict[str, Any]]:
        if model_name is None:
            rows = self._exec("SELECT * FROM cold_starts ORDER BY event_id")
        else:
            rows = self._exec("SELECT * FROM cold_starts WHERE model_name = ? ORDER BY event_id",
                              (model_name,))
        return [dict(r) for r in rows]

    def record_forecast(self, model: str, window_start_s: float, forecast_rps: float,
                        actual_rps: float | None, target: int) -> None:
        """One row per (model, window); a second write for the same window replaces it."""
        self._exec("INSERT OR REPLACE INTO traffic_forecasts VALUES (?,?,?,?,?)",
                   (model, float(window_start_s), float(forecast_rps),
                    None if actual_rps is None else float(actual_rps), int(target)))

    def forecasts(self, model: str) -> list[dict[str, Any]]:
        rows = self._exec("SELECT * FROM traffic_forecasts WHERE model_name = ? "
                          "ORDER BY window_start_s", (model,))
        return [dict(r) for r in rows]


def _snapshot_row(row: sqlite3.Row) -> SnapshotRow:
    data = dict(row)
    data["pins"] = json.loads(data["pins"])
    return SnapshotRow(**data)
