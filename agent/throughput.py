"""A replica's capacity as it is sustained: departures per second while it is backlogged.

The speed profile (agent/speed.py) predicts what one request meets from fitted engine costs.
It does not see everything a replica spends per request end to end (the batching loop, the
socket, detokenizing, a neighbour on its cores), and it cannot see what batching buys when
many requests wait at once.  So capacity is measured where it happens instead, the way a
queue's service rate is measured in operational analysis (Denning and Buzen, "The
Operational Analysis of Queueing Network Models", ACM Computing Surveys 10(3), 1978: the
service rate is completions over busy time):

    rps = departures / backlogged seconds

over the intervals in which the replica was **backlogged**: work was waiting at the end of
one engine tick (a sequence not yet fully prefilled, or a request accepted and not yet
handed to the engine), so the replica ran flat out until the next tick ended, at the batch
the backlog gave it, prefills included.  An idle or lightly loaded replica says nothing
about its capacity, and its time is not counted: the measurement is made only of
saturated intervals, whatever the load was otherwise.

:class:`BacklogMeter` keeps the last :data:`WINDOW_BACKLOG_S` seconds of backlogged time
(not wall time: a replica that was saturated an hour ago still knows its capacity) and
reports a :class:`BacklogCapacity` once it has seen at least :data:`MIN_BACKLOG_S` seconds
and :data:`MIN_DEPARTURES` departures.  The rate is for the requests it served then (their
mean prompt and output lengths travel with it); :meth:`BacklogCapacity.rps_at` converts it
to another request shape by the ratio of the speed profile's engine seconds for the two
shapes at the batch it ran (the profile gives only the ratio, the measurement the level).

One meter runs in the replica's batching loop (agent/replica/batching.py) and one in each
simulated replica (agent/sim/replica.py); the front door's admission, its router and the
predictor read the result from the replica's load report (:data:`BACKLOG_META_KEYS`).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from agent.errors import ConfigError
from agent.speed import SpeedProfile

BACKLOG_META_KEYS = ("backlog_rps", "backlog_s", "backlog_batch", "backlog_prompt_tokens",
                     "backlog_gen_tokens")
"""A replica's measured capacity in its load report and registry meta (all or none)."""

MIN_BACKLOG_RPS = 1e-6
MAX_BACKLOG_RPS = 1e6
"""The rates a capacity may state, and :meth:`BacklogCapacity.rps_at` answer (requests per
second): under one request in eleven days while backlogged, or over a million a second, is a
broken meter or a forged report, not a replica.  Within them ``1 / rps`` and every product
the router, admission and the predictor's sizing form from it stay finite."""
MAX_BACKLOG_BATCH = 65536.0
"""The largest mean batch a capacity may state (sequences): a replica's slots are KV-cache
rows, thousands at most."""
MAX_MEAN_TOKENS = 1e8
"""The longest mean prompt or output a capacity may state (tokens): a hundred times the
longest context window of current models."""
_LIMITS = {"backlog_rps": MAX_BACKLOG_RPS, "backlog_s": math.inf,
           "backlog_batch": MAX_BACKLOG_BATCH, "backlog_prompt_tokens": MAX_MEAN_TOKENS,
           "backlog_gen_tokens": MAX_MEAN_TOKENS}

WINDOW_BACKLOG_S = 30.0
"""Backlogged seconds kept: the capacity follows a replica whose speed changes (a neighbour
on its cores) within half a minute of saturation, and one burst does not make it."""
MIN_BACKLOG_S = 2.0
MIN_DEPARTURES = 8
"""Before this much backlogged time and this many departures the meter reports nothing:
a rate over a few requests is mostly the phase of the batch they fell in."""


@dataclass(frozen=True)
class BacklogCapacity:
    """What a replica sustained while backlogged: ``rps`` requests per second over
    ``seconds`` backlogged seconds, at a mean of ``batch`` sequences in the engine, for
    requests of ``prompt_tokens`` prompt and ``gen_tokens`` generated tokens on average.
    Raises :class:`ConfigError` naming the key, the value and the limit for a value that is
    not a finite number >= 0 (``seconds`` > 0), an ``rps`` outside [:data:`MIN_BACKLOG_RPS`,
    :data:`MAX_BACKLOG_RPS`], a ``batch`` over :data:`MAX_BACKLOG_BATCH` or a length over
    :data:`MAX_MEAN_TOKENS`."""

    rps: float
    seconds: float
    batch: float
    prompt_tokens: float
    gen_tokens: float

    def __post_init__(self) -> None:
        for key, value in zip(BACKLOG_META_KEYS, (self.rps, self.seconds, self.batch,
                                                  self.prompt_tokens, self.gen_tokens),
                              strict=True):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ConfigError(f"BacklogCapacity {key}={value!r}; limit is a finite number "
                                  ">= 0", name=key, value=value, limit=0)
            if value > _LIMITS[key]:
                raise ConfigError(f"BacklogCapacity {key}={value!r}; limit is <= "
                                  f"{_LIMITS[key]:g}", name=key, value=value, limit=_LIMITS[key])
        if self.seconds <= 0:
            raise ConfigError(f"BacklogCapacity backlog_s={self.seconds!r}; limit is > 0",
                              name="backlog_s", value=self.seconds, limit=0)
        if self.rps < MIN_BACKLOG_RPS:
            raise ConfigError(f"BacklogCapacity backlog_rps={self.rps!r}; limit is >= "
                              f"{MIN_BACKLOG_RPS:g}", name="backlog_rps", value=self.rps,
                              limit=MIN_BACKLOG_RPS)

    def rps_at(self, profile: SpeedProfile | None, prompt_tokens: float,
               gen_tokens: float) -> float:
        """Requests per second for requests of ``prompt_tokens`` / ``gen_tokens`` (mean
        lengths): :attr:`rps` times the ratio of ``profile``'s engine seconds per request
        (``SpeedProfile.service_s``) for the measured shape to that for the asked one, both
        at the measured batch (a negative length counted as 0); :attr:`rps` itself without a
        profile, or for an asked length that is not a number within :data:`MAX_MEAN_TOKENS`.
        Always within [:data:`MIN_BACKLOG_RPS`, :data:`MAX_BACKLOG_RPS`]."""
        if profile is None or not (prompt_tokens <= MAX_MEAN_TOKENS
                                   and gen_tokens <= MAX_MEAN_TOKENS):   # NaN too
            return self.rps
        prompt, gen = max(0.0, prompt_tokens), max(0.0, gen_tokens)
        batch = max(1, round(self.batch))
        then = profile.service_s(self.prompt_tokens, self.gen_tokens, batch)
        asked = profile.service_s(prompt, gen, batch)
        if not (0 < then < math.inf and 0 < asked < math.inf):
            return self.rps
        return min(MAX_BACKLOG_RPS, max(MIN_BACKLOG_RPS, self.rps * then / asked))

    def to_meta(self) -> dict[str, float]:
        """The load-report form: :data:`BACKLOG_META_KEYS` as floats."""
        return dict(zip(BACKLOG_META_KEYS, (self.rps, self.seconds, self.batch,
                                            self.prompt_tokens, self.gen_tokens), strict=True))

    @classmethod
    def from_meta(cls, meta: Mapping[str, object]) -> BacklogCapacity | None:
        """From a load report or registry meta (floats or decimal strings); None when a key
        is missing or a value is outside the limits of the class docstring (not measured
        yet, or not a measurement)."""
        try:
            values = [float(meta[k]) for k in BACKLOG_META_KEYS]  # type: ignore[arg-type]
            return cls(*values)
        except (KeyError, TypeError, ValueError, OverflowError):
            return None


class BacklogMeter:
    """Departures per backlogged second (module docstring), fed once per engine tick.

    ``window_s``: backlogged seconds kept; ``min_s`` / ``min_departures``: what must be seen
    before :meth:`capacity` reports.  The clock is injected (seconds, monotonic).  Raises
    ConfigError for a window or minimum that is not > 0.
    """

    def __init__(self, *, window_s: float = WINDOW_BACKLOG_S, min_s: float = MIN_BACKLOG_S,
                 min_departures: int = MIN_DEPARTURES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("window_s", window_s), ("min_s", min_s),
                            ("min_departures", min_departures)):
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"BacklogMeter {name}={value!r}; limit is > 0", name=name,
                                  value=value, limit=0)
        self.window_s, self.min_s, self.min_departures = window_s, min_s, min_departures
        self._clock = clock
        # one entry per backlogged interval: (seconds, departures, prompt tokens, generated
        # tokens, sequence-seconds); oldest first, at most window_s seconds in all
        self._spans: collections.deque[tuple[float, int, int, int, float]] = collections.deque()
        self._sums = [0.0, 0, 0, 0, 0.0]
        self._last_s: float | None = None
        self._backlog = False    # whether work was left over when the last tick ended

    def tick(self, departed: Sequence[tuple[int, int]], *, backlog: bool, batch: int) -> None:
        """One engine tick ended now: ``departed`` lists ``(prompt_tokens, generated_tokens)``
        of each request that finished in it, ``batch`` the sequences the engine held in it,
        ``backlog`` whether work is left over for the next (module docstring).  The time
        since the previous tick ended counts when work was left over then."""
        now = self._clock()
        last, self._last_s = self._last_s, now
        was, self._backlog = self._backlog, bool(backlog)
        if last is None or not was or now <= last:
            return
        span = (now - last, len(departed), sum(int(p) for p, _ in departed),
                sum(int(g) for _, g in departed), (now - last) * max(0, int(batch)))
        self._spans.append(span)
        for i, v in enumerate(span):
            self._sums[i] += v
        while len(self._spans) > 1 and self._sums[0] - self._spans[0][0] >= self.window_s:
            old = self._spans.popleft()
            for i, v in enumerate(old):
                self._sums[i] -= v

    def idle(self) -> None:
        """The replica ran out of work (its loop now waits): the next tick starts a new
        interval, so the wait is never counted as backlogged time."""
        self._backlog = False

    def capacity(self) -> BacklogCapacity | None:
        """The capacity measured so far, or None before ``min_s`` backlogged seconds and
        ``min_departures`` departures (never a guess), or when what it measured is outside
        :class:`BacklogCapacity`'s limits."""
        seconds, departures, prompt, gen, seq_s = self._sums
        if seconds < self.min_s or departures < self.min_departures:
            return None
        try:
            return BacklogCapacity(rps=departures / seconds, seconds=seconds,
                                   batch=seq_s / seconds, prompt_tokens=prompt / departures,
                                   gen_tokens=gen / departures)
        except ConfigError:
            return None
