"""A replica's load, measured where it happens: tokens per second, batch size, queued prefill
tokens, KV slots in use.  Read by the worker's ``stats`` op (the node agent's view of its
replicas) and exported only by the replica's own status port (``rewarm replica
--metrics-listen``), as ``rewarm_replica_*``: tokens as a counter
(``rewarm_replica_generated_tokens_total``, whose ``rate()`` is the tokens per second),
never as a precomputed rate.

``tokens_per_s`` is the tokens emitted in the last ``window_s`` seconds divided by that wall
time (or by the time since the first step began, when that is shorter): a sliding window of
engine steps, so an idle replica drops to 0 within the window.  The capacity the replica
sustained while backlogged (agent/throughput.py) is measured from the same steps and
reported beside the load (``backlog_*`` keys) once measured.
The clock is injected (seconds, monotonic).
"""

from __future__ import annotations

import collections
import time
from typing import Any
from collections.abc import Callable

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agent.throughput import BacklogMeter


class ReplicaMeter:
    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self._clock = window_s, clock
        self._steps: collections.deque[tuple[float, int]] = collections.deque()
        self.generated_tokens = 0
        self.batch_size = 0
        self._first_s: float | None = None
        self.backlog = BacklogMeter(clock=clock)

    def step(self, tokens: int, batch: int, duration_s: float = 0.0, *,
             departed: tuple[tuple[int, int], ...] | list[tuple[int, int]] = (),
             backlog: bool = False) -> None:
        """One engine step, which took ``duration_s``, emitted ``tokens`` tokens for ``batch``
        sequences; ``departed``: ``(prompt_tokens, generated_tokens)`` of each request it
        finished, ``backlog``: whether work is left over for the next step (both for the
        capacity measured while backlogged, agent/throughput.py)."""
        self.backlog.tick(departed, backlog=backlog, batch=batch)
        now = self._clock()
        if self._first_s is None:
            self._first_s = now - duration_s
        self._steps.append((now, tokens))
        self.generated_tokens += tokens
        self.batch_size = batch
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()

    def tokens_per_s(self) -> float:
        now = self._clock()
        self._trim(now)
        if not self._steps:
            self.batch_size = 0
            return 0.0
        assert self._first_s is not None, "set by the first record()"
        wall_s = min(self.window_s, now - self._first_s)
        return sum(n for _t, n in self._steps) / wall_s if wall_s > 0 else 0.0

    def snapshot(self, engine) -> dict[str, Any]:
        """The load keys (``stats``) this meter adds: ``tokens_per_s`` (float), ``batch_size``,
        ``kv_slots_used``, ``kv_slots``, ``generated_tokens`` (ints), and once measured the
        capacity sustained while backlogged (agent/throughput.py ``BACKLOG_META_KEYS``).  The queue
        (``queued_prefill_tokens``, ``waiting_seqs``) comes from the engine's own report
        (:meth:`Engine.speed_report`, agent/speed.py's QUEUE_META_KEYS)."""
        out = {"tokens_per_s": round(self.tokens_per_s(), 3), "batch_size": self.batch_size,
               "kv_slots_used": int(engine.kv.active), "kv_slots": int(engine.kv.max_seqs),
               "generated_tokens": self.generated_tokens}
        sustained = self.backlog.capacity()
        if sustained is not None:
            out.update(sustained.to_meta())
        return out


class _Collector:
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        model = str(s.get("model") or "")
        labels = ("model",)

        def gauge(name: str, doc: str, key: str):
            fam = GaugeMetricFamily(name, doc, labels=labels)
            fam.add_metric((model,), float(s.get(key) or 0))
            return fam

        yield gauge("rewarm_replica_batch_size", "Sequences in the last engine step", "batch_size")
        yield gauge("rewarm_replica_queued_prefill_tokens", "Prompt tokens waiting to be prefilled",
                    "queued_prefill_tokens")
        yield gauge("rewarm_replica_kv_slots_used", "KV slots holding a sequence", "kv_slots_used")
        yield gauge("rewarm_replica_kv_slots", "KV slots (largest batch)", "kv_slots")
        yield gauge("rewarm_replica_kv_used_tokens", "KV cache tokens in use", "kv_used_tokens")
        total = CounterMetricFamily("rewarm_replica_generated_tokens", "Tokens generated",
                                    labels=labels)
        total.add_metric((model,), float(s.get("generated_tokens") or 0))
        yield total


def replica_registry(stats: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    """A registry exposing ``stats()``'s load keys as ``rewarm_replica_*{model}`` plus
    ``process_*``."""
    registry = CollectorRegistry()
    registry.register(_Collector(stats))
    ProcessCollector(registry=registry)
    return registry
