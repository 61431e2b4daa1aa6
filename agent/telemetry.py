"""Cold-start telemetry: one event per request as a JSON line, and Prometheus metrics.

The event follows the snapshot design document's ``ColdStartEvent`` (request_id, model,
path, queue_wait_ms, restore_ms, ttft_ms, sla_breached, timestamp_ms) with the answer's
``code`` added; ``path`` is one of warm_hit, suspended_resume, snapshot_restore, cold_boot,
or ``refused`` for requests answered with an error before reaching a replica.  Events are
kept in memory and written in batches so that the request path only appends a tuple.

Metrics (prometheus-client custom collector reading plain counters at scrape time, served
on an HTTP port by :meth:`Telemetry.serve_http`):
``rewarm_requests_total{path,code}``, ``rewarm_queue_depth{model}``,
``rewarm_ttft_seconds`` and ``rewarm_queue_wait_seconds`` histograms,
``rewarm_restores_in_flight``.
"""

from __future__ import annotations

import json
import time
from bisect import bisect_left
from pathlib import Path
from typing import Any, TextIO

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

EVENT_FIELDS = ("request_id", "model", "path", "code", "queue_wait_ms", "restore_ms",
                "ttft_ms", "sla_breached", "timestamp_ms")

# Latency buckets (s): from sub-millisecond warm hits to multi-second restores.
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


_LINE = ('{"request_id": %s, "model": %s, "path": "%s", "code": %d, "queue_wait_ms": %s, '
         '"restore_ms": %s, "ttft_ms": %s, "sla_breached": %s, "timestamp_ms": %d}\n')


def _num(x: float | None) -> str:
    if x is None or x != x or x in (float("inf"), float("-inf")):
        return "null"
    return repr(float(x))


class _Histogram:
    """Bucket counts kept as plain ints (prometheus-client's Histogram takes a lock and
    does more per observation; this is one bisect)."""

    __slots__ = ("counts", "sum", "n")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.sum, self.n = 0.0, 0

    def observe(self, x: float) -> None:
        self.counts[bisect_left(_BUCKETS, x)] += 1
        self.sum += x
        self.n += 1

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, _BUCKETS), "+Inf"), counts):
            cumulative += count
            buckets.append((bound, cumulative))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class _Collector:
    """Exposes :class:`Telemetry`'s plain counters at scrape time (prometheus-client custom
    collector), so the request path never touches a metrics lock."""

    def __init__(self, t: "Telemetry") -> None:
        self.t = t

    def collect(self):
        t = self.t
        requests = CounterMetricFamily("rewarm_requests", "Requests answered, by path and code",
                                       labels=("path", "code"))
        for (path, code), n in list(t.request_counts.items()):
            requests.add_metric((path, str(code)), n)
        depth = GaugeMetricFamily("rewarm_queue_depth", "Requests waiting for capacity",
                                  labels=("model",))
        for model, n in list(t.depths.items()):
            depth.add_metric((model,), n)
        yield requests
        yield depth
        yield t.ttft.family("rewarm_ttft_seconds", "Time to first token at the front door")
        yield t.queue_wait.family("rewarm_queue_wait_seconds", "Time spent queued for capacity")
        yield GaugeMetricFamily("rewarm_restores_in_flight", "Restores asked for, not finished",
                                value=t.restores)


class Telemetry:
    """Collects cold-start events and metrics.

    ``events_path``: JSON-lines file appended to (None: events are counted, not written);
    ``flush_events``: events buffered before a write (small, so that formatting a batch,
    about 2 us per event, never stalls the event loop for long: 128 events ~ 0.3 ms).
    ``registry``: the Prometheus registry (a fresh one by default, so several front doors
    in one test process coexist).
    """

    def __init__(self, events_path: Path | str | None = None, *,
                 registry: CollectorRegistry | None = None, flush_events: int = 128) -> None:
        self.registry = registry or CollectorRegistry()
        self.request_counts: dict[tuple[str, int], int] = {}
        self.depths: dict[str, int] = {}
        self.ttft, self.queue_wait = _Histogram(), _Histogram()
        self.restores = 0
        self.registry.register(_Collector(self))
        self._quoted: dict[str, str] = {}
        self._file: TextIO | None = open(events_path, "a") if events_path else None
        self._buffer: list[tuple] = []
        self._flush_events = flush_events
        self.events = 0

    def event(self, request_id: Any, model: str, path: str, code: int, queue_wait_ms: float,
              restore_ms: float | None, ttft_ms: float | None, sla_breached: bool) -> None:
        """Record one request's outcome (``timestamp_ms``: wall clock, ms since the epoch)."""
        key = (path, code)
        counts = self.request_counts
        counts[key] = counts.get(key, 0) + 1
        if ttft_ms is not None:
            self.ttft.observe(ttft_ms / 1000.0)
        if queue_wait_ms:
            self.queue_wait.observe(queue_wait_ms / 1000.0)
        self.events += 1
        if self._file is not None:
            self._buffer.append((request_id, model, path, code, queue_wait_ms, restore_ms,
                                 ttft_ms, sla_breached, int(time.time() * 1000)))
            if len(self._buffer) >= self._flush_events:
                self.flush()

    def queue_depth(self, model: str, depth: int) -> None:
        self.depths[model] = depth

    def restores_in_flight(self, n: int) -> None:
        self.restores = n

    def flush(self) -> None:
        """Write buffered events as JSON lines."""
        if self._file is None or not self._buffer:
            return
        rows, self._buffer = self._buffer, []
        self._file.write("".join(map(self._line, rows)))
        self._file.flush()

    def _line(self, row: tuple) -> str:
        """One event as a JSON line, formatted by hand (json.dumps of a dict costs ~4 us);
        strings still go through json.dumps for escaping, model names once each."""
        rid, model, path, code, wait, restore, ttft, breached, stamp = row
        quoted = self._quoted.get(model)
        if quoted is None:
            quoted = self._quoted[model] = json.dumps(model)
        return _LINE % (rid if type(rid) is int else json.dumps(rid), quoted, path, code,
                        _num(wait), _num(restore), _num(ttft),
                        "true" if breached else "false", stamp)

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def serve_http(self, port: int, addr: str = "127.0.0.1"):
        """Serve ``/metrics`` on ``addr:port`` in a daemon thread; returns the server."""
        server, _thread = start_http_server(port, addr, registry=self.registry)
        return server
