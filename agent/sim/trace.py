"""Request workloads for the simulator: CSV traces, time-scaling, background mixing, synthetic.

A :class:`Workload` is a struct of arrays (one row per request, sorted by arrival), so a
720,000-request hour costs a few numpy arrays and no Python object per request.

The trace format is the Azure LLM inference trace 2023 (``TIMESTAMP,ContextTokens,
GeneratedTokens``; see ``../shared/traces/README.md``): one request per line, timestamps as
``YYYY-MM-DD HH:MM:SS.fffffff``.  Any CSV with those three columns is accepted.

Per-request timing comes from tokens (:class:`TokenTiming`): occupancy (how long the request
holds one sequence slot of a replica) is prefill plus decode; TTFT on a free replica is the
prefill time.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.errors import InvalidTrace

MAX_TRACE_ROWS = 20_000_000
MAX_TRACE_BYTES = 2 << 30
MAX_TOKENS_PER_REQUEST = 1 << 20
HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class TokenTiming:
    """How tokens become seconds on one replica.

    Defaults are a 13B-class FP16 model on one 40 GB GPU with continuous batching:
    ``prefill_tokens_per_s`` (prompt tokens per second for one sequence) and
    ``decode_tokens_per_s`` (output tokens per second for one sequence in a full batch).
    With 900-token contexts (the snapshot document's average, section "Scaling and
    Performance") and ~200 output tokens this gives ~7 s occupancy, the document's figure.
    """

    prefill_tokens_per_s: float = 4000.0
    decode_tokens_per_s: float = 30.0

    def prefill_s(self, prompt_tokens: np.ndarray) -> np.ndarray:
        return prompt_tokens / self.prefill_tokens_per_s

    def occupancy_s(self, prompt_tokens: np.ndarray, output_tokens: np.ndarray) -> np.ndarray:
        return prompt_tokens / self.prefill_tokens_per_s + output_tokens / self.decode_tokens_per_s


@dataclass
class Workload:
    """Requests sorted by arrival; every array has shape ``[N]``.

    ``arrival_s`` float64 (seconds from the workload's origin), ``occupancy_s`` float64
    (seconds one request holds a sequence slot), ``prefill_s`` float64 (TTFT on a free
    replica), ``need_tokens`` int64 (KV tokens: prompt + output), ``tenant`` int16
    (0 = the trace or the spiking tenant, 1 = background).  ``prompt_tokens`` and
    ``output_tokens`` int64, when known (a trace's tokens; None for the fixed-occupancy
    synthetic workloads), let replicas at a measured speed (agent/sim/replica.py) run them.
    """

    arrival_s: np.ndarray
    occupancy_s: np.ndarray
    prefill_s: np.ndarray
    need_tokens: np.ndarray
    tenant: np.ndarray
    prompt_tokens: np.ndarray | None = None
    output_tokens: np.ndarray | None = None

    def _columns(self) -> tuple:
        tokens = (self.prompt_tokens, self.output_tokens)
        return (self.arrival_s, self.occupancy_s, self.prefill_s, self.need_tokens,
                self.tenant) + (tokens if all(t is not None for t in tokens) else ())

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    def sorted(self) -> "Workload":
        order = np.argsort(self.arrival_s, kind="stable")
        return Workload(*(c[order] for c in self._columns()))

    def offered_concurrency(self, times_s: np.ndarray) -> np.ndarray:
        """Requests that would be in flight at each of ``times_s`` [T] if none waited or dropped.

        Counts ``arrival <= t < arrival + occupancy``: the demand curve the spike scenario
        compares with capacity.  Returns int64 [T].
        """
        ends = np.sort(self.arrival_s + self.occupancy_s)
        started = np.searchsorted(self.arrival_s, times_s, side="right")
        finished = np.searchsorted(ends, times_s, side="right")
        return (started - finished).astype(np.int64)


def load_trace(path: Path, *, timing: TokenTiming = TokenTiming(),
               max_rows: int = MAX_TRACE_ROWS, max_bytes: int = MAX_TRACE_BYTES) -> Workload:
    """Read a ``TIMESTAMP,ContextTokens,GeneratedTokens`` CSV into a :class:`Workload`.

    Arrivals are seconds after the first row's timestamp (rows are sorted if they are not).
    Raises :class:`InvalidTrace` naming the path, line, field, value and limit when the file
    is over ``max_bytes`` (checked before reading), has more than ``max_rows`` rows, a wrong
    header, an unparsable field, or a token count outside ``[0, MAX_TOKENS_PER_REQUEST]``.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise InvalidTrace(f"trace {path}: cannot read it ({exc.strerror or exc})", path=path,
                           line=None, field="path", value=str(path),
                           limit="a readable CSV file") from exc
    if size > max_bytes:
        raise InvalidTrace(f"trace {path}: {size} bytes exceeds max_bytes({max_bytes})",
                           path=path, line=None, field="size_bytes", value=size, limit=max_bytes)
    stamps: list[str] = []
    prompt: list[int] = []
    output: list[int] = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != HEADER:
            raise InvalidTrace(f"trace {path}: header {header!r} is not {','.join(HEADER)}",
                               path=path, line=1, field="header", value=header, limit=HEADER)
        for line_no, row in enumerate(reader, start=2):
            if len(stamps) >= max_rows:
                raise InvalidTrace(f"trace {path}: more than max_rows({max_rows}) rows",
                                   path=path, line=line_no, field="rows", value=len(stamps) + 1,
                                   limit=max_rows)
            if len(row) != 3:
                raise InvalidTrace(f"trace {path} line {line_no}: {len(row)} fields, expected 3",
                                   path=path, line=line_no, field="row", value=row, limit=3)
            for name, text, dest in (("ContextTokens", row[1], prompt),
                                     ("GeneratedTokens", row[2], output)):
                try:
                    n = int(text)
                except ValueError:
                    raise InvalidTrace(f"trace {path} line {line_no}: {name}={text!r} is not an integer",
                                       path=path, line=line_no, field=name, value=text,
                                       limit="integer") from None
                if not 0 <= n <= MAX_TOKENS_PER_REQUEST:
                    raise InvalidTrace(
                        f"trace {path} line {line_no}: {name}={n} outside [0, {MAX_TOKENS_PER_REQUEST}]",
                        path=path, line=line_no, field=name, value=n, limit=MAX_TOKENS_PER_REQUEST)
                dest.append(n)
            stamps.append(row[0].strip())
    if not stamps:
        raise InvalidTrace(f"trace {path}: no requests", path=path, line=None, field="rows",
                           value=0, limit=1)
    try:
        t_ns = np.array(stamps, dtype="datetime64[ns]").astype(np.int64)
    except ValueError as exc:
        raise InvalidTrace(f"trace {path}: unparsable TIMESTAMP ({exc})", path=path, line=None,
                           field="TIMESTAMP", value=str(exc), limit="YYYY-MM-DD HH:MM:SS.f") from None
    arrival = (t_ns - t_ns.min()) / 1e9
    p = np.asarray(prompt, dtype=np.int64)
    o = np.asarray(output, dtype=np.int64)
    return Workload(arrival.astype(np.float64), timing.occupancy_s(p, o).astype(np.float64),
                    timing.prefill_s(p).astype(np.float64), p + o,
                    np.zeros(len(p), dtype=np.int16), p, o).sorted()


def time_scale(w: Workload, speedup: float) -> Workload:
    """Compress arrivals by ``speedup`` (2.0 = twice the request rate); per-request work unchanged.

    Raises :class:`InvalidTrace` when ``speedup`` is not positive.
    """
    if not speedup > 0:
        raise InvalidTrace(f"time scale speedup={speedup} must be > 0", path=None, line=None,
                           field="speedup", value=speedup, limit="> 0")
    return Workload(w.arrival_s / speedup, *w._columns()[1:])


def poisson_arrivals(rate_rps: np.ndarray, *, step_s: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times (s, sorted, float64) of a Poisson process whose rate is piecewise constant.

    ``rate_rps`` [K] holds the rate for each step of ``step_s`` seconds.
    """
    counts = rng.poisson(np.maximum(rate_rps, 0.0) * step_s)
    starts = np.repeat(np.arange(len(rate_rps)) * step_s, counts)
    return np.sort(starts + rng.random(starts.shape[0]) * step_s)


def synthetic(rate_rps: np.ndarray, *, step_s: float, occupancy_s: float, prefill_s: float,
              need_tokens: int, rng: np.random.Generator, tenant: int = 0,
              occupancy_cv: float = 0.0) -> Workload:
    """A synthetic workload: Poisson arrivals at ``rate_rps`` [K] (one value per ``step_s``).

    Occupancy is ``occupancy_s`` for every request, or gamma-distributed with that mean and
    coefficient of variation ``occupancy_cv`` when it is > 0.
    """
    arrival = poisson_arrivals(rate_rps, step_s=step_s, rng=rng)
    n = arrival.shape[0]
    if occupancy_cv > 0:
        shape = 1.0 / occupancy_cv ** 2
        occ = rng.gamma(shape, occupancy_s / shape, n)
    else:
        occ = np.full(n, occupancy_s)
    return Workload(arrival, occ.astype(np.float64), np.full(n, prefill_s),
                    np.full(n, need_tokens, dtype=np.int64), np.full(n, tenant, dtype=np.int16))


def mix(*workloads: Workload) -> Workload:
    """Merge workloads (e.g. a trace and steady background traffic from other tenants); the
    tokens are kept only when every part has them."""
    width = min(len(w._columns()) for w in workloads)
    return Workload(*(np.concatenate([w._columns()[k] for w in workloads])
                      for k in range(width))).sorted()


def background(duration_s: float, rate_rps: float, *, occupancy_s: float, prefill_s: float,
               need_tokens: int, rng: np.random.Generator) -> Workload:
    """Steady Poisson traffic of other tenants (tenant 1) for ``duration_s`` seconds."""
    steps = max(1, int(np.ceil(duration_s)))
    return synthetic(np.full(steps, rate_rps), step_s=1.0, occupancy_s=occupancy_s,
                     prefill_s=prefill_s, need_tokens=need_tokens, rng=rng, tenant=1)
