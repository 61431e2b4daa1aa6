"""Deadline-bounded admission: a per-model queue ordered by deadline (earliest first).

Pure and clock-injected, with no asyncio inside: the asyncio server and the simulator
(agent/sim) drive the very same objects.  Every request has a deadline counted from its
arrival at the front door; the queue bounds both its depth and the wait it promises.  Past
either bound :meth:`AdmissionQueue.offer` raises :class:`~agent.errors.Overloaded` (429) with
``retry_after_ms``; a request whose deadline passes is handed back by :meth:`expire` (504)
and is never dispatched.  Heap operations are O(log n) (docs/architecture.md, "Admission").
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from agent.clock import Clock
from agent.errors import ConfigError, Overloaded
from agent.wire import refusals
from agent.speed import SpeedProfile


@dataclass(eq=False)  # identity: a queued request is a thing, not a value (hashable)
class Pending:
    """One request waiting for capacity.

    ``arrival_s`` and ``deadline_s`` are on the admission clock's scale; ``need_tokens`` is
    the KV the request needs (prompt + max_tokens); ``payload`` is whatever the caller needs
    to answer it later (the server keeps its connection and message there).
    """

    request_id: Any
    model: str
    arrival_s: float
    deadline_s: float
    need_tokens: int
    payload: Any = field(default=None, repr=False)
    give_up_s: float = field(default=float("inf"), repr=False)  # set by AdmissionQueue.offer
    cancelled: bool = field(default=False, repr=False)           # set by AdmissionQueue.cancel
    predicted_ttft_s: float | None = field(default=None, repr=False)  # when it was admitted
    # held for its model's start from zero: served when a replica comes up, never expired
    awaits_start: bool = field(default=False, repr=False)


class AdmissionQueue:
    """Queue of :class:`Pending` for one model, earliest deadline first (the effective
    deadline ``give_up_s`` below, which is ``deadline_s`` unless the wait bound is earlier).

    ``max_depth`` bounds the requests held; ``max_wait_s`` bounds how long one is held:
    a request leaves at ``give_up_s = min(deadline_s, arrival_s + max_wait_s)``, one that
    ``awaits_start`` (held for its model's start from zero) at its ``deadline_s`` (the
    model's default deadline; the caller answers it 429) unless the replica that start
    brings up serves it first, or the start fails first.
    :meth:`expire` hands back those past ``give_up_s``: the caller answers 504 when the
    request's own deadline has passed (``deadline_s <= now``) and 429 otherwise (the wait
    bound).  ``expected_wait_s`` may be set by the owner (e.g. the restore p99 while no
    replica is warm); ``offer`` refuses when it exceeds ``max_wait_s``.  Raises
    :class:`ConfigError` for a depth below 1 or a wait that is not positive.
    """

    def __init__(self, model: str, *, clock: Clock, max_depth: int, max_wait_s: float) -> None:
        if max_depth < 1:
            raise ConfigError(f"AdmissionQueue max_depth={max_depth} must be >= 1",
                              name="max_depth", value=max_depth, limit=1)
        if not max_wait_s > 0:
            raise ConfigError(f"AdmissionQueue max_wait_s={max_wait_s} must be > 0",
                              name="max_wait_s", value=max_wait_s, limit=0)
        self.model = model
        self.max_depth = max_depth
        self.max_wait_s = float(max_wait_s)
        self._clock = clock
        self._heap: list[tuple[float, int, Pending]] = []
        self._seq = itertools.count()  # ties keep arrival order
        self._live = 0
        self.expected_wait_s = 0.0

    def __len__(self) -> int:
        return self._live

    def retry_after_ms(self) -> int:
        """A hint for refused clients: when the earliest queued deadline falls due (ms, >= 1)."""
        head = self.peek()
        if head is None:
            return max(1, int(self.max_wait_s * 1000))
        return max(1, math.ceil((head.deadline_s - self._clock.now()) * 1000))

    def offer(self, p: Pending) -> None:
        """Queue ``p``.  Raises :class:`Overloaded` (429) when ``max_depth`` requests are
        held already or when ``p``'s deadline has no room left (it would expire unserved)."""
        now = self._clock.now()
        if self._live >= self.max_depth:
            raise Overloaded(
                f"model {self.model!r}: admission queue depth {self._live} is at max_depth"
                f"({self.max_depth})", model=self.model, retry_after_ms=self.retry_after_ms(),
                depth=self._live, limit=self.max_depth, refusal=refusals.QUEUE_FULL)
        if self.expected_wait_s > self.max_wait_s:
            raise Overloaded(
                f"model {self.model!r}: expected wait {self.expected_wait_s:.3f} s exceeds "
                f"max_wait_s({self.max_wait_s})", model=self.model,
                retry_after_ms=max(1, int(self.expected_wait_s * 1000)), depth=self._live,
                limit=self.max_wait_s, refusal=refusals.MAX_WAIT)
        if p.deadline_s <= now:
            raise Overloaded(
                f"model {self.model!r}: request {p.request_id!r} has no time left to wait "
                f"(deadline {p.deadline_s - now:.3f} s from now)", model=self.model,
                retry_after_ms=self.retry_after_ms(), depth=self._live, limit=self.max_depth,
                refusal=refusals.DEADLINE_UNREACHABLE)
        p.give_up_s = p.deadline_s if p.awaits_start else \
            min(p.deadline_s, p.arrival_s + self.max_wait_s)
        heapq.heappush(self._heap, (p.give_up_s, next(self._seq), p))
        self._live += 1

    def peek(self) -> Pending | None:
        """The earliest-deadline request still held, without taking it."""
        heap = self._heap
        while heap and heap[0][2].cancelled:  # lazy removal (see cancel)
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def cancel(self, p: Pending) -> None:
        """Forget a queued request whose client went away (O(1); its heap entry is dropped
        when it reaches the top).  Only for requests offered and not yet taken out."""
        if not p.cancelled:
            p.cancelled = True
            self._live -= 1

    def pop_earliest(self) -> Pending | None:
        """Take the earliest-deadline request (None when empty).  Does not check expiry:
        call :meth:`expire` first."""
        if self.peek() is None:
            return None
        self._live -= 1
        return heapq.heappop(self._heap)[2]

    def expire(self) -> list[Pending]:
        """Take every request past its ``give_up_s``, earliest first; none of them may be
        dispatched.  Answer 504 when ``deadline_s <= now``, else 429 (held ``max_wait_s``)."""
        now = self._clock.now()
        out: list[Pending] = []
        while True:
            head = self.peek()
            if head is None or head.give_up_s > now:
                return out
            out.append(head)
            self.pop_earliest()

    def drain(self) -> list[Pending]:
        """Take everything (for 503 when no capacity can be made), earliest deadline first."""
        out = []
        while (p := self.pop_earliest()) is not None:
            out.append(p)
        return out

    def ordered(self, limit: int | None = None) -> list[Pending]:
        """The requests held, earliest deadline first (a copy; O(n log n)), or the first
        ``limit`` of them (O(n log limit))."""
        entries = sorted(self._heap) if limit is None else heapq.nsmallest(
            limit + (len(self._heap) - self._live), self._heap)
        out = [entry[2] for entry in entries if not entry[2].cancelled]
        return out if limit is None else out[:limit]


# --- when capacity that is not warm yet can serve a request (pure helpers) ---------------

def capacity_etas_s(now_s: float, started_s: list[float], p50_s: float | None,
                    p99_s: float | None, startable: int) -> list[float]:
    """Clock times (s) at which new replicas of one model are expected, soonest first.

    ``started_s``: when each restore in flight began; ``p50_s``/``p99_s``: the model's
    measured restore quantiles on the tier it restores from (None: not measured yet: every
    ETA is "now", and the caller holds the request to the model's default deadline rather
    than the restore SLO, since the first restore may be a cold boot); ``startable``:
    restores that could still start now.  A restore in flight is due ``started + p99``; one
    already past it is in the tail, and is given the larger of ``p99 - p50`` (the measured
    spread) and its overrun so far."""
    if p99_s is None:  # nothing measured: no ETA to hold it to (the caller's budget does)
        etas = [now_s] * (len(started_s) + max(0, startable))
        return etas
    p99 = p99_s
    spread = max(0.0, p99 - (p50_s or p99))
    etas = []
    for t0 in started_s:
        due = t0 + p99
        # overdue: in the tail; at least the measured spread more, and as long again as it
        # has overrun (so a restore that hangs is not "due any moment" for ever)
        etas.append(due if due > now_s else now_s + max(spread, now_s - due))
    etas.extend([now_s + p99] * max(0, startable))
    etas.sort()
    return etas


def slot_times_s(frees_s: list[float], etas_s: list[float], per_replica: int,
                 speed: SpeedProfile, mean_prompt_tokens: float) -> list[float]:
    """Clock times (s) at which a queued request can start its own prefill, one entry per
    request, soonest first: a slot freed at each of ``frees_s`` (a warm replica's sequence
    that ends, already including the decode step then in progress), and ``per_replica``
    slots on each new replica due at ``etas_s`` (its sustainable concurrency at the SLO): the
    j-th waits for the step of the j before it and their prefills (``mean_prompt_tokens``
    each), as :meth:`SpeedProfile.predict_ttft_s` counts them."""
    slots = list(frees_s)
    base = speed.prefill_s(0)
    for j in range(max(1, per_replica)):
        wait_s = speed.predict_ttft_s(0, active_seqs=j, waiting_seqs=j,
                                      queued_prefill_tokens=int(j * mean_prompt_tokens)) - base
        slots.extend(eta + wait_s for eta in etas_s)
    slots.sort()
    return slots


def fluid_starts_s(now_s: float, ahead: float, capacity: list[tuple[float, float]],
                   count: int) -> list[float]:
    """When each of ``count`` requests in line (after ``ahead`` already waiting at the
    replicas) can start, at best, if the replicas start requests as fast as they sustain
    backlogged (agent/throughput.py): ``capacity`` lists ``(from_s, rps)``, a replica that
    starts requests at ``rps`` per second from clock time ``from_s`` on (a warm one from now,
    one being restored from its ETA).  The ``k``-th (0-based) starts once the capacity summed
    since ``now_s`` has served ``ahead + k + 1`` requests: a fluid bound of a queue whose
    service is measured as a rate, not as each request's predicted time.  Clock seconds,
    ``inf`` for a request no capacity in the list ever reaches."""
    events = sorted((max(now_s, t), r) for t, r in capacity if r > 0)
    out: list[float] = []
    need = ahead + 1.0
    t, rate, done, i = now_s, 0.0, 0.0, 0
    for _ in range(max(0, count)):
        while True:
            next_t = events[i][0] if i < len(events) else math.inf
            if rate > 0 and t + (need - done) / rate <= next_t:
                t, done = t + (need - done) / rate, need
                break
            if next_t == math.inf:
                t = math.inf
                break
            done += rate * (next_t - t)
            t, rate = next_t, rate + events[i][1]
            i += 1
        out.append(t)
        need += 1.0
    return out
