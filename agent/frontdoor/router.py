"""Replica choice: among warm replicas of a model, the one with the lowest predicted TTFT.

Least-loaded by time, not by count.  Each replica's load report (its registry meta, or the
node agent's ``restore`` answer; docs/architecture.md, "Replica load reports") carries its slots and KV use,
its measured speed (:data:`~agent.speed.SPEED_META_KEYS`) and its queue
(:data:`~agent.speed.QUEUE_META_KEYS`); :meth:`ReplicaLoad.predict_ttft_s` turns them into
the TTFT a new request would meet there (:meth:`agent.speed.SpeedProfile.predict_ttft_s`).
Between reports the front door keeps its own accounting: a dispatched request counts as an
active sequence and, until its first token, its prompt as queued prefill.  A free sequence
slot and enough KV headroom are the hard limit; equal predictions go to the most headroom.

Each replica's predictions also carry its measured error: after every first token the
front door compares the TTFT it predicted when it sent the request with the one it saw
(:meth:`ReplicaLoad.observe_ttft`), and a replica that has been slower than predicted is
predicted slower by that ratio (``slowdown``: the 99th percentile of the last
:data:`SLOWDOWN_WINDOW` ratios by nearest rank, at least 1, kept across load reports; a
replica new to the view starts at its model's, until it has two first tokens of its own).  The p99 of a full
window of 100 is its second-largest ratio: one request in a hundred may be slower than the
prediction.  A window not yet full takes the same rank, so one ratio alone never sets the
slowdown: a replica's first request paid one-off costs (its tokenizer loaded, pages faulted
in after a restore) in 0.5 s against a 34 ms prediction, and taking that ratio of 11 as the
replica's speed predicted its 511-token prompts at 12 s instead of 1.1 s, refusing them for
the next hundred requests.  A replica that is really slower shows it again on the next
request, and is predicted slower from then on.  The
speed model cannot see everything a replica meets (a neighbour on its CPU, prompts longer
than any it measured, page faults after a restore); what it misses shows up here, in the
front door's own observations, within a few requests, so admission stops promising TTFTs
the replica does not keep.

A replica that has reported no speed is predicted with a conservative prior
(:meth:`Router.prior`): the slowest profile, field by field, that this model's replicas have
reported (the same engine, at its worst), else the slowest of any model's, else the
configured ``default_prior`` (:data:`DEFAULT_PRIOR`).

Pure, no I/O: the server feeds it from its cached registry view and updates it on every
dispatch, first token and completion, so the request path never asks the registry.  The
simulator drives the same class.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass, field, replace
from collections.abc import Iterable, Mapping

from agent.cluster.base import LOAD_META_KEYS as META_KEYS  # the registry meta schema
from agent.cluster.base import LOAD_META_LIMITS as META_LIMITS
from agent.cluster.base import ServiceInstance
from agent.speed import QUEUE_META_KEYS, QUEUE_META_LIMITS, SPEED_META_KEYS, SpeedProfile
from agent.throughput import BACKLOG_META_KEYS, BacklogCapacity

DEFAULT_PRIOR = SpeedProfile(prefill_tokens_per_s=500.0, prefill_overhead_s=0.02,
                             decode_base_s=0.1, decode_per_seq_s=0.005,
                             decode_per_ctx_token_s=1e-5)
"""The prior when no replica of any model has reported a speed: deliberately slow (500
prompt tokens/s, a 100 ms decode step plus 5 ms per sequence and 10 us per cached token),
slower than a 135M-parameter model decoding on two CPU cores, so that an unmeasured replica
is never assumed faster than it is; replicas report a boot-time profile at once (contract
point 2), so this is only the case before any report."""

SLOWDOWN_WINDOW = 100
"""First tokens per replica whose measured slowdown is kept: the slowdown applied is their
99th percentile (the SLO is a p99), so about a hundred requests after a slow spell (a
restore beside it on the same CPU) the replica is trusted again."""


def p99_of_window(ratios: collections.deque) -> float:
    """The nearest-rank 99th percentile of a window of 2 to :data:`SLOWDOWN_WINDOW` ratios,
    at the full window's rank at every fill: the second largest."""
    return heapq.nlargest(2, ratios)[1]


@dataclass
class ReplicaLoad:
    """One warm replica's load: sequences and KV-cache tokens (capacity and in use), its
    measured ``speed`` (None until reported) and its queue: ``waiting_seqs`` admitted but not
    yet prefilled, ``queued_prefill_tokens`` their prompt tokens, ``active_ctx_tokens`` the
    tokens cached by the active sequences.  ``penalty_s``: seconds added to predictions here
    until the next report (the replica refused a request it predicted later than we did)."""

    replica_id: str
    model: str
    address: str  # "host:port" or a Unix socket path
    max_seqs: int
    active_seqs: int
    kv_capacity_tokens: int
    kv_used_tokens: int
    speed: SpeedProfile | None = None
    waiting_seqs: int = 0
    queued_prefill_tokens: int = 0
    active_ctx_tokens: int = 0
    penalty_s: float = field(default=0.0, repr=False)
    came_up: str = ""  # the node agent's word for how it came up (meta came_up), "" if unknown
    # what it sustained while backlogged (agent/throughput.py), None until it has measured it
    backlog: BacklogCapacity | None = None
    slowdown: float = field(default=1.0, repr=False)  # measured TTFT / predicted, >= 1
    ratios: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=SLOWDOWN_WINDOW), repr=False)

    def observe_ttft(self, predicted_s: float, observed_s: float,
                     slowdown_then: float = 1.0) -> None:
        """A request sent here with a predicted TTFT of ``predicted_s`` (the slowdown of
        then, ``slowdown_then``, included) got its first token ``observed_s`` after it was
        sent: the ratio of that to the speed model's own prediction joins the window, whose
        99th percentile by nearest rank (the second largest: module docstring; at least 1)
        is the slowdown (:data:`SLOWDOWN_WINDOW`) once the window holds two; before that the
        slowdown stays what it was (its model's, or 1).  Both are
        padded with one decode step at this replica's batch (the model's quantum of error;
        a short prediction off by less says nothing about its rates).  Non-finite or
        negative values are ignored."""
        s = self.speed
        if s is None or not (0.0 <= predicted_s < float("inf")) \
                or not (0.0 <= observed_s < float("inf")):
            return
        pad = s.decode_step_s(max(1, self.active_seqs), self.active_ctx_tokens)
        model_s = predicted_s / max(1.0, slowdown_then)  # the speed model's own prediction
        self.ratios.append((observed_s + pad) / (model_s + pad))
        if len(self.ratios) >= 2:      # until then: its model's, inherited (or 1)
            self.slowdown = max(1.0, p99_of_window(self.ratios))

    @property
    def headroom_tokens(self) -> int:
        return self.kv_capacity_tokens - self.kv_used_tokens

    def fits(self, need_tokens: int) -> bool:
        return self.active_seqs < self.max_seqs and self.headroom_tokens >= need_tokens

    def predict_ttft_s(self, prompt_tokens: int, prior: SpeedProfile) -> float:
        """Predicted TTFT (s) here for a new request of ``prompt_tokens`` prompt tokens, with
        this replica's speed (``prior`` when it has reported none): the decode step in
        progress (charged whole, at every sequence it holds: an upper bound), then the
        prompts queued ahead and its own: the steps of agent/speed.py's model that prefill
        them (``SpeedProfile.prefill_wait_s``: the step's budget, when it has one), an upper
        bound that charges every queued prompt its own call.  Where prompts wait here and the
        replica has measured what it sustains backlogged (agent/throughput.py), the queue
        drains no slower than that rate (backlogged, prompts start as fast as requests
        leave: ``waiting / rps``, with batching, shared prefill calls and every overhead of
        its own in it), then its own prefill call follows: the sooner of the two."""
        # SpeedProfile.predict_ttft_s, inlined (the request path calls this per replica
        # per request)
        s = self.speed or prior
        waiting, active = self.waiting_seqs, self.active_seqs
        step_s = (s.decode_base_s + s.decode_per_seq_s * (active - 1)
                  + s.decode_per_ctx_token_s * self.active_ctx_tokens) if active > 0 else 0.0
        wait_s = s.prefill_wait_s(prompt_tokens, waiting_seqs=waiting,
                                  queued_prefill_tokens=self.queued_prefill_tokens,
                                  active_seqs=active, active_ctx_tokens=self.active_ctx_tokens)
        if self.backlog is not None and waiting > 0:
            wait_s = min(wait_s, waiting / self.backlog.rps + s.prefill_s(prompt_tokens))
        return (step_s + wait_s) * self.slowdown + self.penalty_s

    @classmethod
    def from_meta(cls, replica_id: str, model: str, address: str,
                  meta: Mapping[str, object]) -> ReplicaLoad:
        """From a load report (ints or decimal strings): :data:`META_KEYS` required (else
        ValueError naming the key and value; past :data:`META_LIMITS` naming the limit too);
        speed, queue and backlog-capacity keys optional (a missing or bad speed or backlog
        key means none measured; a missing or bad queue key is 0, one past
        :data:`~agent.speed.QUEUE_META_LIMITS` its limit)."""
        values = {}
        for key in META_KEYS:
            try:
                values[key] = int(meta[key])  # type: ignore[call-overload]
            except (KeyError, ValueError, TypeError):
                raise ValueError(f"replica {replica_id!r}: load {key!r}="
                                 f"{_shown(meta.get(key))} is not an integer") from None
            if values[key] > META_LIMITS[key]:
                raise ValueError(f"replica {replica_id!r}: load {key!r}={values[key]} "
                                 f"exceeds its limit {META_LIMITS[key]}")
        for key in QUEUE_META_KEYS:
            try:
                value = float(meta.get(key, 0))  # type: ignore[arg-type]
            except (ValueError, TypeError, OverflowError):
                value = 0.0
            limit = QUEUE_META_LIMITS[key]
            if not value >= 0:           # negative or NaN
                values[key] = 0
            elif value > limit:          # inf too
                values[key] = limit
            else:
                values[key] = int(value)
        speed = SpeedProfile.from_meta(meta) if SPEED_META_KEYS[0] in meta else None
        backlog = BacklogCapacity.from_meta(meta) if BACKLOG_META_KEYS[0] in meta else None
        return cls(replica_id, model, address, speed=speed, backlog=backlog, **values)

    @classmethod
    def from_instance(cls, inst: ServiceInstance) -> ReplicaLoad:
        """Build from a ``rewarm-replica`` registry entry (tag ``model=<name>``, meta
        :data:`META_KEYS` and the optional speed and queue keys, optional meta ``address``:
        ``host:port`` or a socket path).  Raises ValueError when the tag or a required meta
        value is missing or not an integer."""
        model = inst.tag("model")
        if not model:
            raise ValueError(f"replica {inst.id!r} has no model=<name> tag")
        # A replica on a Unix socket has port 0 and its path in meta "address".
        address = inst.meta.get("address") or f"{inst.address}:{inst.port}"
        if address.startswith("unix:"):  # the node agent's and worker's spelling of a socket
            address = address[len("unix:"):]
        load = cls.from_meta(inst.id, model, address, inst.meta)
        load.came_up = str(inst.meta.get("came_up", ""))
        return load


SHOWN_CHARS = 64
"""The most of a bad meta value a refusal quotes (the registry is re-read every poll, and
the refusal is logged each time)."""


def _shown(value: object) -> str:
    """``repr(value)``, cut to :data:`SHOWN_CHARS` with the length it had."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else \
        f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def slowest(profiles: Iterable[SpeedProfile]) -> SpeedProfile | None:
    """Field by field the slowest of ``profiles`` (lowest prefill rate, highest costs)."""
    out = None
    for p in profiles:
        if out is None:
            out = p
            continue
        out = SpeedProfile(min(out.prefill_tokens_per_s, p.prefill_tokens_per_s),
                           max(out.prefill_overhead_s, p.prefill_overhead_s),
                           max(out.decode_base_s, p.decode_base_s),
                           max(out.decode_per_seq_s, p.decode_per_seq_s),
                           max(out.decode_per_ctx_token_s, p.decode_per_ctx_token_s))
    return out


_EMPTY: dict = {}


class Router:
    """The local view of warm replicas, by model."""

    def __init__(self, default_prior: SpeedProfile = DEFAULT_PRIOR) -> None:
        self._replicas: dict[str, ReplicaLoad] = {}
        self._by_model: dict[str, dict[str, ReplicaLoad]] = {}
        self.default_prior = default_prior
        self._slowest: dict[str, SpeedProfile] = {}  # model -> slowest reported (kept)
        self._sustained: dict[str, BacklogCapacity] = {}  # model -> last capacity measured
        self._last_slowdown: dict[str, float] = {}   # model -> of its last replica removed

    def upsert(self, load: ReplicaLoad) -> None:
        """Add a replica or replace its reported load."""
        old = self._replicas.get(load.replica_id)
        if old is not None and old.model != load.model:
            self.remove(load.replica_id)
        elif old is not None:
            # the front door's own measurement outlives reports
            load.slowdown, load.ratios = old.slowdown, old.ratios
        else:  # new: as slow as its model's replicas were, until its own first token says
            load.slowdown = self.model_slowdown(load.model)
        self._replicas[load.replica_id] = load
        self._by_model.setdefault(load.model, {})[load.replica_id] = load
        if load.backlog is not None:
            self._sustained[load.model] = load.backlog
        if load.speed is not None:
            current = slowest(r.speed for r in self._by_model[load.model].values()
                              if r.speed is not None)
            if current is not None:
                self._slowest[load.model] = current

    def remove(self, replica_id: str) -> None:
        load = self._replicas.pop(replica_id, None)
        if load is not None:
            self._by_model.get(load.model, {}).pop(replica_id, None)
            self._last_slowdown[load.model] = load.slowdown

    def get(self, replica_id: str) -> ReplicaLoad | None:
        return self._replicas.get(replica_id)

    def prior(self, model: str) -> SpeedProfile:
        """The speed assumed for ``model``'s replicas that have reported none (module
        docstring): its slowest reported, else any model's slowest, else the default."""
        mine = self._slowest.get(model)
        if mine is not None:
            return mine
        return slowest(self._slowest.values()) or self.default_prior

    def sustained_rps(self, load: ReplicaLoad, prompt_tokens: float, gen_tokens: float,
                      batch: int) -> float:
        """Requests per second ``load``'s replica sustains for requests of the given mean
        lengths: what it measured while backlogged (agent/throughput.py), converted to these
        lengths; before it has measured that, its model's last measured capacity, else its
        speed profile's service rate at ``batch`` (at most its slots)."""
        speed = load.speed or self.prior(load.model)
        measured = load.backlog or self._sustained.get(load.model)
        if measured is not None:
            return measured.rps_at(speed, prompt_tokens, gen_tokens)
        return speed.service_rps(prompt_tokens, gen_tokens, max(1, min(batch, load.max_seqs)))

    def new_replica_rps(self, model: str, prompt_tokens: float, gen_tokens: float,
                        batch: int) -> float:
        """Requests per second one more replica of ``model`` (one being restored) will
        sustain: its model's last capacity measured while backlogged, converted to these
        lengths, else :meth:`held_prior`'s service rate at ``batch``."""
        measured = self._sustained.get(model)
        if measured is not None:
            return measured.rps_at(self.prior(model), prompt_tokens, gen_tokens)
        return self.held_prior(model).service_rps(prompt_tokens, gen_tokens, max(1, batch))

    def remember_capacity(self, model: str, measured: BacklogCapacity) -> None:
        """Take ``measured`` as ``model``'s last capacity measured backlogged (one measured
        before this view existed: a replay's calibration, a simulation started where a live
        front door stood)."""
        self._sustained[model] = measured

    def model_capacity(self, model: str) -> BacklogCapacity | None:
        """The last capacity a replica of ``model`` reported measuring while backlogged
        (kept after the replica is gone: a restored replica is the same engine)."""
        return self._sustained.get(model)

    def model_slowdown(self, model: str) -> float:
        """The front door's measured slowdown for a replica of ``model`` not yet in the view
        (one being restored): as for a new replica in :meth:`upsert`, the largest of its
        replicas', else that of its last replica removed; 1 when none was measured."""
        return max([r.slowdown for r in self._by_model.get(model, _EMPTY).values()]
                   + [self._last_slowdown.get(model, 1.0)])

    def held_prior(self, model: str) -> SpeedProfile:
        """:meth:`prior` slowed by :meth:`model_slowdown`: the speed a request held for
        capacity is planned with, so held predictions carry the same measured error as the
        warm ones (``ReplicaLoad.predict_ttft_s``)."""
        prior, k = self.prior(model), self.model_slowdown(model)
        if k <= 1.0:
            return prior
        return replace(prior, prefill_tokens_per_s=prior.prefill_tokens_per_s / k,
                                   prefill_overhead_s=prior.prefill_overhead_s * k,
                                   decode_base_s=prior.decode_base_s * k,
                                   decode_per_seq_s=prior.decode_per_seq_s * k,
                                   decode_per_ctx_token_s=prior.decode_per_ctx_token_s * k)

    def choose_predicted(self, model: str, need_tokens: int, prompt_tokens: int,
                         exclude: frozenset | set = frozenset()
                         ) -> tuple[ReplicaLoad, float] | None:
        """The warm replica of ``model`` with the lowest predicted TTFT for a request of
        ``prompt_tokens`` prompt tokens among those with a free sequence slot and at least
        ``need_tokens`` of KV headroom (and not in ``exclude``), with that prediction (s);
        equal predictions go to more headroom, then to the smaller id.  None when none fits."""
        best, best_s = None, 0.0
        prior = None
        for load in self._by_model.get(model, _EMPTY).values():
            if load.active_seqs >= load.max_seqs or \
                    load.kv_capacity_tokens - load.kv_used_tokens < need_tokens or \
                    (exclude and load.replica_id in exclude):
                continue
            if load.speed is None and prior is None:
                prior = self.prior(model)
            ttft_s = load.predict_ttft_s(prompt_tokens, prior)
            if best is None or ttft_s < best_s:
                best, best_s = load, ttft_s
            elif ttft_s == best_s:
                room = load.kv_capacity_tokens - load.kv_used_tokens
                best_room = best.kv_capacity_tokens - best.kv_used_tokens
                if room > best_room or (room == best_room and load.replica_id < best.replica_id):
                    best = load
        return None if best is None else (best, best_s)

    def choose(self, model: str, need_tokens: int, prompt_tokens: int = 0) -> ReplicaLoad | None:
        """:meth:`choose_predicted` without the prediction."""
        found = self.choose_predicted(model, need_tokens, prompt_tokens)
        return None if found is None else found[0]

    def on_dispatch(self, replica_id: str, need_tokens: int, prompt_tokens: int = 0) -> None:
        """A request went to the replica: one more active sequence, its KV need used, its
        prompt queued for prefill until :meth:`on_first_token`."""
        load = self._replicas.get(replica_id)
        if load is not None:
            load.active_seqs += 1
            load.kv_used_tokens += need_tokens
            if prompt_tokens:
                load.waiting_seqs += 1
                load.queued_prefill_tokens += prompt_tokens

    def on_first_token(self, replica_id: str, prompt_tokens: int) -> None:
        """The request's prompt is prefilled: out of the prefill queue, into the context."""
        load = self._replicas.get(replica_id)
        if load is not None:
            if load.waiting_seqs > 0:
                load.waiting_seqs -= 1
            left = load.queued_prefill_tokens - prompt_tokens
            load.queued_prefill_tokens = left if left > 0 else 0
            load.active_ctx_tokens += prompt_tokens

    def on_complete(self, replica_id: str, need_tokens: int, prompt_tokens: int = 0,
                    first_token: bool = True) -> None:
        """The request ended (done, error or cancel); ``first_token``: whether it had one
        (else its prompt leaves the prefill queue)."""
        load = self._replicas.get(replica_id)
        if load is not None:
            if load.active_seqs > 0:
                load.active_seqs -= 1
            used = load.kv_used_tokens - need_tokens
            load.kv_used_tokens = used if used > 0 else 0
            if prompt_tokens:
                if first_token:
                    ctx = load.active_ctx_tokens - prompt_tokens
                    load.active_ctx_tokens = ctx if ctx > 0 else 0
                else:
                    load.waiting_seqs = max(0, load.waiting_seqs - 1)
                    load.queued_prefill_tokens = max(0, load.queued_prefill_tokens
                                                     - prompt_tokens)

    def warm(self, model: str) -> list[ReplicaLoad]:
        return list(self._by_model.get(model, {}).values())

    def models(self) -> list[str]:
        return sorted(m for m, reps in self._by_model.items() if reps)
