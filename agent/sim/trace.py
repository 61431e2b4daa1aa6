"""Request workloads for the simulator: CSV traces, time-scaling, background mixing, synthetic.

A :class:`Workload` is a struct of arrays (one row per request, sorted by arrival), so a
720,000-request hour costs a few numpy arrays and no Python object per request.

The trace format is the Azure LLM inference trace 2023 (``TIMESTAMP,ContextTokens,
GeneratedTokens``; docs/architecture.md, "Traces"): one request per line, timestamps as
``YYYY-MM-DD HH:MM:SS.fffffff``.  Any CSV with those three columns is accepted.

Per-request timing comes from tokens (:class:`TokenTiming`): occupancy (how long the request
holds one sequence slot of a replica) is prefill plus decode; TTFT on a free replica is the
prefill time.
"""

from __future__ import annotations

import csv
from typing import Any
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.errors import InvalidTrace, TraceNotFound

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

    def sorted(self) -> Workload:
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


@dataclass(frozen=True)
class TraceRows:
    """A trace as read, sorted by arrival; every array has shape ``[N]``.

    ``arrival_s`` float64 (seconds after the earliest row), ``context_tokens`` and
    ``generated_tokens`` int64 (the CSV's ``ContextTokens`` and ``GeneratedTokens``),
    ``line`` int64 (the 1-based CSV line each row came from, for error messages).
    """

    path: Path
    arrival_s: np.ndarray
    context_tokens: np.ndarray
    generated_tokens: np.ndarray
    line: np.ndarray

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    def window(self, start_s: float, length_s: float) -> TraceRows:
        """Rows arriving in ``[start_s, start_s + length_s)``, re-based so the window starts
        at 0 (its first second, not its first request: a quiet start stays quiet)."""
        keep = (self.arrival_s >= start_s) & (self.arrival_s < start_s + length_s)
        return TraceRows(self.path, self.arrival_s[keep] - start_s, self.context_tokens[keep],
                         self.generated_tokens[keep], self.line[keep])


def _utf8_lines(path: Path, f):
    """Decode a binary file line by line; a non-UTF-8 byte is InvalidTrace naming the line
    and the byte offset within it."""
    for line_no, raw in enumerate(f, start=1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidTrace(
                f"trace {path} line {line_no}: byte {raw[exc.start]:#04x} at column "
                f"{exc.start + 1} is not UTF-8", path=path, line=line_no, field="encoding",
                value=raw[exc.start], limit="UTF-8 text") from None


_STAMP_LIMIT = "YYYY-MM-DD HH:MM:SS[.fffffff]"


def _parse_stamps(path: Path, stamps: list[str], lines: list[int]) -> np.ndarray:
    """Timestamps -> int64 ns since the epoch; the first unparsable one or ``NaT`` is
    InvalidTrace naming its line."""
    try:
        with warnings.catch_warnings():   # numpy warns about (and accepts) a zone suffix
            warnings.simplefilter("ignore", UserWarning)
            t = np.array(stamps, dtype="datetime64[ns]")
    except ValueError:
        t = None
    if t is not None:
        bad = np.flatnonzero(np.isnat(t))
        if not bad.size:
            return t.astype(np.int64)
        i = int(bad[0])
        raise InvalidTrace(f"trace {path} line {lines[i]}: TIMESTAMP={stamps[i]!r} is not a "
                           f"time (limit: {_STAMP_LIMIT})", path=path, line=lines[i],
                           field="TIMESTAMP", value=stamps[i], limit=_STAMP_LIMIT)
    for i, text in enumerate(stamps):   # only on failure: find the row to name
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                ok = not np.isnat(np.datetime64(text, "ns"))
        except ValueError:
            ok = False
        if not ok:
            raise InvalidTrace(f"trace {path} line {lines[i]}: TIMESTAMP={text!r} is not a "
                               f"time (limit: {_STAMP_LIMIT})", path=path, line=lines[i],
                               field="TIMESTAMP", value=text, limit=_STAMP_LIMIT)
    raise InvalidTrace(f"trace {path}: unparsable TIMESTAMP column", path=path, line=None,
                       field="TIMESTAMP", value=None, limit=_STAMP_LIMIT)   # pragma: no cover


def read_trace(path: Path, *, max_rows: int = MAX_TRACE_ROWS,
               max_bytes: int = MAX_TRACE_BYTES) -> TraceRows:
    """Read a ``TIMESTAMP,ContextTokens,GeneratedTokens`` CSV into :class:`TraceRows`.

    Arrivals are seconds after the earliest timestamp (rows are sorted if they are not).
    Blank lines at the end of the file are ignored.  Raises one :class:`InvalidTrace` naming
    the path, line, field, value and limit when the file is missing or unreadable, over
    ``max_bytes`` (checked before reading), not UTF-8, has more than ``max_rows`` rows, a
    wrong header, a blank line before the last row, a row without three fields, a token
    count that is not an integer in ``[0, MAX_TOKENS_PER_REQUEST]``, or a timestamp that is
    not a time (``NaT`` included).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as exc:
        kind = TraceNotFound if isinstance(exc, FileNotFoundError) else InvalidTrace
        raise kind(f"trace {path}: cannot read it ({exc.strerror or exc})", path=path,
                           line=None, field="path", value=str(path),
                           limit="a readable CSV file") from exc
    if size > max_bytes:
        f.close()
        raise InvalidTrace(f"trace {path}: {size} bytes exceeds max_bytes({max_bytes})",
                           path=path, line=None, field="size_bytes", value=size, limit=max_bytes)
    stamps: list[str] = []
    lines: list[int] = []
    prompt: list[int] = []
    output: list[int] = []
    blank_at: int | None = None
    with f:
        reader = csv.reader(_utf8_lines(path, f))
        try:
            header = next(reader, None)
        except csv.Error as exc:
            raise InvalidTrace(f"trace {path} line 1: {exc}", path=path, line=1,
                               field="header", value=str(exc), limit=HEADER) from None
        if header is None or tuple(h.strip().lstrip("\ufeff") for h in header) != HEADER:
            raise InvalidTrace(f"trace {path}: header {header!r} is not {','.join(HEADER)}",
                               path=path, line=1, field="header", value=header, limit=HEADER)
        while True:
            try:
                row = next(reader, None)
            except csv.Error as exc:
                raise InvalidTrace(f"trace {path} line {reader.line_num}: {exc}", path=path,
                                   line=reader.line_num, field="row", value=str(exc),
                                   limit="CSV") from None
            if row is None:
                break
            line_no = reader.line_num
            if not row or all(not c.strip() for c in row):
                blank_at = blank_at or line_no
                continue
            if blank_at is not None:
                raise InvalidTrace(f"trace {path} line {blank_at}: blank line before the last "
                                   f"row (line {line_no})", path=path, line=blank_at,
                                   field="row", value="", limit="no blank line between rows")
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
            lines.append(line_no)
    if not stamps:
        raise InvalidTrace(f"trace {path}: no requests", path=path, line=None, field="rows",
                           value=0, limit=1)
    t_ns = _parse_stamps(path, stamps, lines)
    order = np.argsort(t_ns, kind="stable")
    arrival = ((t_ns - t_ns.min()) / 1e9)[order].astype(np.float64)
    return TraceRows(path, arrival, np.asarray(prompt, dtype=np.int64)[order],
                     np.asarray(output, dtype=np.int64)[order],
                     np.asarray(lines, dtype=np.int64)[order])


def load_trace(path: Path, *, timing: TokenTiming = TokenTiming(),
               max_rows: int = MAX_TRACE_ROWS, max_bytes: int = MAX_TRACE_BYTES) -> Workload:
    """A trace (:func:`read_trace`, which raises :class:`InvalidTrace`) as a
    :class:`Workload` timed by ``timing``."""
    rows = read_trace(path, max_rows=max_rows, max_bytes=max_bytes)
    return workload_from_rows(rows, timing)


def workload_from_rows(rows: TraceRows, timing: TokenTiming = TokenTiming()) -> Workload:
    """:class:`TraceRows` -> :class:`Workload` (occupancy and TTFT from ``timing``)."""
    p, o = rows.context_tokens, rows.generated_tokens
    return Workload(rows.arrival_s.copy(), timing.occupancy_s(p, o).astype(np.float64),
                    timing.prefill_s(p).astype(np.float64), p + o,
                    np.zeros(len(p), dtype=np.int16), p.copy(), o.copy())


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
    occ: Any
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
