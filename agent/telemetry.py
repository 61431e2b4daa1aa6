"""Cold-start telemetry: one event per request as a JSON line, and Prometheus metrics.

The event is a cold-start event (request_id, model,
path, queue_wait_ms, restore_ms, ttft_ms, sla_breached, timestamp_ms) with the answer's
``code`` added; ``path`` is one of warm_hit, suspended_resume, snapshot_restore, cold_boot,
or ``refused`` for requests answered with an error before reaching a replica.  Events are
kept in memory and written in batches so that the request path only appends a tuple.

Metrics (one scheme across rewarm, labels bounded: ``model`` — at most
``max_models`` distinct names, the rest folded into ``_other`` since clients name models —,
``path`` (:data:`PATHS`), ``code`` (the status code), ``reason`` (:data:`REJECT_REASONS`)):

=======================================  ==========================================
``rewarm_requests_total``                {model, path, code}  requests answered
``rewarm_rejections_total``              {model, code, reason}  429/503/504/413 answers
``rewarm_ttft_seconds``                  {model, path}  histogram, front door TTFT
``rewarm_queue_wait_seconds``            {model, path}  histogram, time queued for capacity
``rewarm_ttft_prediction_ratio``         {model, path}  histogram, actual / predicted TTFT
``rewarm_prompt_tokens_total``           {model, path}  prompt tokens of answered requests
``rewarm_generation_tokens_total``       {model, path}  tokens generated for them
``rewarm_e2e_request_latency_seconds``   {model, path}  histogram, arrival to the last token
``rewarm_inter_token_latency_seconds``   {model, path}  histogram, between tokens after the
                                         first (a message of k tokens after a gap g: k
                                         observations of g / k)
``rewarm_queue_depth``                   {model}  requests waiting for capacity
``rewarm_restores_in_flight``            —  restores asked for, not finished
``process_*``                            prometheus-client's ProcessCollector
=======================================  ==========================================

Latency buckets reach 600 s (:data:`BUCKETS_S`) so a multi-minute cold boot lands in a bucket,
not in ``+Inf``.  Counters are plain ints read by a custom collector at scrape time, so the
request path never takes a metrics lock.  :meth:`Telemetry.serve_http` serves ``/metrics``,
``/healthz`` and ``/readyz`` (agent/health.py).
"""

from __future__ import annotations

import json
import time
from bisect import bisect_left
from pathlib import Path
from typing import Any, TextIO
from collections.abc import Callable

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from agent.wire import refusals

EVENT_FIELDS = ("request_id", "model", "path", "code", "queue_wait_ms", "restore_ms",
                "ttft_ms", "sla_breached", "timestamp_ms")

BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
             30, 60, 120, 300, 600)
"""Latency buckets (s): sub-millisecond warm hits to a 10-minute cold boot (the issue's
measured 44 s cold boot and the ladder's 417 s naive boot both land below the top)."""

RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4, 10)
"""actual / predicted TTFT: 1.0 is a perfect prediction, above it the prediction was low."""

PATHS = ("warm_hit", "suspended_resume", "snapshot_restore", "cold_boot", "refused")

REJECT_REASONS = refusals.REFUSALS
"""The ``reason`` label of ``rewarm_rejections_total``: the refusal's code, set where the
refusal was decided (agent/wire/refusals.py), never read from its text."""

OTHER_MODEL = "_other"

DEFAULT_METRICS_PORT = 9403
"""The front door's documented status port (``/metrics``), and ``rewarm up``'s default: not
9400, dcgm-exporter's default on the GPU hosts a front door may share; the node agent's is
9401 and the predictor's 9402 (jobs/systemd/rewarm.env.example)."""

_LINE = ('{"request_id": %s, "model": %s, "path": "%s", "code": %d, "queue_wait_ms": %s, '
         '"restore_ms": %s, "ttft_ms": %s, "sla_breached": %s, "timestamp_ms": %d}\n')

REJECTION_CODES = frozenset((413, 429, 503, 504))
"""The statuses ``rewarm_rejections_total`` counts: refusals of a well-formed request."""


def reject_reason(code: int, refusal: str | None) -> str:
    """The bounded ``reason`` label of a refusal answered ``code``: ``refusal`` when it is one
    of :data:`REJECT_REASONS`; else ``deadline`` for a 504 (its only meaning) and ``other``.
    The refusal's human-readable text is never classified."""
    known = refusals.known_refusal(refusal)
    if known is not None:
        return known
    return refusals.DEADLINE if code == 504 else refusals.OTHER


def _num(x: float | None) -> str:
    if x is None or x != x or x in (float("inf"), float("-inf")):
        return "null"
    return repr(float(x))


class _Histogram:
    """Bucket counts kept as plain ints (prometheus-client's Histogram takes a lock and
    does more per observation; this is one bisect)."""

    __slots__ = ("bounds", "counts", "sum", "n")

    def __init__(self, bounds: tuple = BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum, self.n = 0.0, 0

    def observe(self, x: float, n: int = 1) -> None:
        """``n`` observations of ``x``."""
        self.counts[bisect_left(self.bounds, x)] += n
        self.sum += x * n
        self.n += n

    def buckets(self) -> list[tuple[str, int]]:
        cumulative, out = 0, []
        for bound, count in zip((*map(str, self.bounds), "+Inf"), list(self.counts), strict=True):
            cumulative += count
            out.append((bound, cumulative))
        return out


def _histograms(name: str, doc: str, table: dict) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=("model", "path"))
    for (model, path), h in list(table.items()):
        family.add_metric((model, path), h.buckets(), h.sum)
    return family


class _Collector:
    """Exposes :class:`Telemetry`'s plain counters at scrape time (prometheus-client custom
    collector), so the request path never touches a metrics lock."""

    def __init__(self, t: Telemetry) -> None:
        self.t = t

    def collect(self):
        t = self.t
        requests = CounterMetricFamily("rewarm_requests", "Requests answered at the front door",
                                       labels=("model", "path", "code"))
        for (model, path, code), n in list(t._requests.items()):
            requests.add_metric((model, path, str(code)), n)
        rejected = CounterMetricFamily("rewarm_rejections", "Requests refused (429, 503, 504,"
                                       " 413) by reason", labels=("model", "code", "reason"))
        for (model, code, reason), n in list(t._rejections.items()):
            rejected.add_metric((model, str(code), reason), n)
        depth = GaugeMetricFamily("rewarm_queue_depth", "Requests waiting for capacity",
                                  labels=("model",))
        for model, n in list(t.depths.items()):
            depth.add_metric((model,), n)
        yield requests
        yield rejected
        yield depth
        yield _histograms("rewarm_ttft_seconds", "Time to first token at the front door", t._ttft)
        yield _histograms("rewarm_queue_wait_seconds", "Time spent queued for capacity",
                          t._queue_wait)
        yield _histograms("rewarm_ttft_prediction_ratio", "Actual TTFT / the TTFT predicted "
                          "when the request was routed", t._ratio)
        prompt = CounterMetricFamily("rewarm_prompt_tokens", "Prompt tokens of answered "
                                     "requests", labels=("model", "path"))
        generation = CounterMetricFamily("rewarm_generation_tokens", "Tokens generated for "
                                         "answered requests", labels=("model", "path"))
        for (model, path), (n_prompt, n_generated) in list(t._tokens.items()):
            prompt.add_metric((model, path), n_prompt)
            generation.add_metric((model, path), n_generated)
        yield prompt
        yield generation
        yield _histograms("rewarm_e2e_request_latency_seconds", "Arrival at the front door to "
                          "the request's last token", t._e2e)
        yield _histograms("rewarm_inter_token_latency_seconds", "Time between tokens after "
                          "the first, as the front door receives them", t._itl)
        yield GaugeMetricFamily("rewarm_restores_in_flight", "Restores asked for, not finished",
                                value=t.restores)


class Telemetry:
    """Collects cold-start events and metrics.

    ``events_path``: JSON-lines file appended to (None: events are counted, not written);
    ``flush_events``: events buffered before a write (small, so that formatting a batch,
    about 2 us per event, never stalls the event loop for long: 128 events ~ 0.3 ms).
    ``registry``: the Prometheus registry (a fresh one by default, so several front doors
    in one test process coexist); ``process_metrics``: add ``process_*`` (CPU, RSS, fds).
    ``max_models``: distinct ``model`` label values kept before folding into ``_other``.
    """

    def __init__(self, events_path: Path | str | None = None, *,
                 registry: CollectorRegistry | None = None, flush_events: int = 128,
                 process_metrics: bool = True, max_models: int = 64) -> None:
        self.registry = registry or CollectorRegistry()
        self._requests: dict[tuple[str, str, int], int] = {}
        self._rejections: dict[tuple[str, int, str], int] = {}
        self.depths: dict[str, int] = {}
        self._ttft: dict[tuple[str, str], _Histogram] = {}
        self._queue_wait: dict[tuple[str, str], _Histogram] = {}
        self._ratio: dict[tuple[str, str], _Histogram] = {}
        self._e2e: dict[tuple[str, str], _Histogram] = {}
        self._itl: dict[tuple[str, str], _Histogram] = {}
        self._tokens: dict[tuple[str, str], list[int]] = {}   # (model, path) -> [prompt, gen]
        self.restores = 0
        self._models: dict[str, str] = {}
        self.max_models = max_models
        self.restore_outcomes: dict[str, tuple[bool, str]] = {}
        self.registry.register(_Collector(self))
        if process_metrics:
            ProcessCollector(registry=self.registry)
        self._quoted: dict[str, str] = {}
        self._file: TextIO | None = open(events_path, "a") if events_path else None
        self._buffer: list[tuple] = []
        self._flush_events = flush_events
        self.events = 0

    def _model(self, model: str) -> str:
        label = self._models.get(model)
        if label is None:
            label = model if len(self._models) < self.max_models else OTHER_MODEL
            if label != OTHER_MODEL:
                self._models[model] = label
        return label

    @staticmethod
    def _new(table: dict, key: tuple, bounds: tuple) -> _Histogram:
        h = table[key] = _Histogram(bounds)
        return h

    @property
    def request_counts(self) -> dict[tuple[str, int], int]:
        """Requests answered by (path, code), summed over models."""
        out: dict[tuple[str, int], int] = {}
        for (_m, path, code), n in list(self._requests.items()):
            out[(path, code)] = out.get((path, code), 0) + n
        return out

    def event(self, request_id: Any, model: str, path: str, code: int, queue_wait_ms: float,
              restore_ms: float | None, ttft_ms: float | None, sla_breached: bool, *,
              reason: str | None = None, predicted_ttft_ms: float | None = None,
              done: dict | None = None, token_gaps: list | None = None) -> None:
        """Record one request's outcome (``timestamp_ms``: wall clock, ms since the epoch).

        ``reason``: for a refusal, why, as data (one of :data:`REJECT_REASONS`, set where the
        refusal was decided; anything else counts as ``other``);
        ``predicted_ttft_ms``: the TTFT the router predicted when it chose the replica (feeds
        ``rewarm_ttft_prediction_ratio`` when the request got a first token); ``done``: an
        answered request's ``done`` message (``prompt_tokens``, ``n_tokens``, ``total_ms``:
        the token counters and the end-to-end histogram); ``token_gaps``: ``(gap_s, k)``
        per tokens message after the first (k tokens arrived ``gap_s`` after the previous)."""
        label = self._models.get(model) or self._model(model)
        key = (label, path, code)
        counts = self._requests
        counts[key] = counts.get(key, 0) + 1
        if code in REJECTION_CODES:
            rkey = (label, code, reject_reason(code, reason))
            self._rejections[rkey] = self._rejections.get(rkey, 0) + 1
        if ttft_ms is not None:
            hkey = (label, path)
            h = self._ttft.get(hkey) or self._new(self._ttft, hkey, BUCKETS_S)
            h.observe(ttft_ms / 1000.0)
            if predicted_ttft_ms:
                r = self._ratio.get(hkey) or self._new(self._ratio, hkey, RATIO_BUCKETS)
                r.observe(ttft_ms / predicted_ttft_ms)
        if done is not None:
            self._answered(label, path, done, token_gaps)
        if queue_wait_ms:
            hkey = (label, path)
            h = self._queue_wait.get(hkey) or self._new(self._queue_wait, hkey, BUCKETS_S)
            h.observe(queue_wait_ms / 1000.0)
        self.events += 1
        if self._file is not None:
            self._buffer.append((request_id, model, path, code, queue_wait_ms, restore_ms,
                                 ttft_ms, sla_breached, int(time.time() * 1000)))
            if len(self._buffer) >= self._flush_events:
                self.flush()

    def _answered(self, label: str, path: str, done: dict, token_gaps: list | None) -> None:
        hkey = (label, path)
        counts = self._tokens.get(hkey)
        if counts is None:
            counts = self._tokens[hkey] = [0, 0]
        prompt, generated = done.get("prompt_tokens"), done.get("n_tokens")
        if type(prompt) is int and prompt > 0:
            counts[0] += prompt
        if type(generated) is int and generated > 0:
            counts[1] += generated
        total_ms = done.get("total_ms")
        if isinstance(total_ms, (int, float)) and total_ms >= 0:
            h = self._e2e.get(hkey) or self._new(self._e2e, hkey, BUCKETS_S)
            h.observe(total_ms / 1000.0)
        if token_gaps:
            h = self._itl.get(hkey) or self._new(self._itl, hkey, BUCKETS_S)
            for gap_s, k in token_gaps:
                h.observe(gap_s / k, k)

    def queue_depth(self, model: str, depth: int) -> None:
        self.depths[self._model(model)] = depth

    def restores_in_flight(self, n: int) -> None:
        self.restores = n

    def restore_outcome(self, model: str, ok: bool, reason: str = "") -> None:
        """The front door's latest restore request for ``model`` succeeded or failed (with
        ``reason``); :meth:`ready` reads these."""
        self.restore_outcomes[self._model(model)] = (ok, reason)

    def ready(self) -> tuple[bool, str]:
        """Not ready while the latest restore of every model that asked for one failed
        (e.g. ``503 no candidate nodes``): nothing can be brought up, so only warm replicas
        serve.  Ready otherwise (including before any restore was asked for)."""
        outcomes = list(self.restore_outcomes.items())
        if outcomes and not any(ok for _m, (ok, _r) in outcomes):
            return False, "every restore fails: " + "; ".join(
                f"{m}: {r}" for m, (_ok, r) in sorted(outcomes))
        return True, "ready"

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
            quoted = json.dumps(model)
            if len(self._quoted) < 4096:
                self._quoted[model] = quoted
        return _LINE % (rid if type(rid) is int else json.dumps(rid), quoted, path, code,
                        _num(wait), _num(restore), _num(ttft),
                        "true" if breached else "false", stamp)

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def serve_http(self, port: int, addr: str = "127.0.0.1", *,
                   ready: Callable[[], tuple[bool, str]] | None = None):
        """Serve ``/metrics``, ``/healthz`` and ``/readyz`` on ``addr:port`` in a daemon thread
        (agent/health.py); ``ready`` defaults to :meth:`ready`.  Returns the server
        (``server_address``, ``shutdown()``, ``close()``)."""
        from agent.health import serve_status

        return serve_status(self.registry, addr, port, ready=ready or self.ready,
                            component="frontdoor")
