"""The replica's batch scheduler: every connection's ``generate`` requests feed one loop.

Each tick submits what arrived, then runs one engine step (agent/replica/engine.py's module
docstring) on the engine's single worker thread, one engine call at a time:
:meth:`Engine.begin_step` (the step's prefill budget from the measured speed and the ITL
target), :meth:`Engine.prefill` while :attr:`Engine.can_prefill` (one forward call over the
oldest waiting prompts' chunks; the first tokens of the prompts it completes are sent before
the next call starts), then :meth:`Engine.decode` (one batched decode step for all running
sequences).  So the server's event loop keeps answering ``health`` and ``stats`` while the
model runs, a running stream waits at most one step (about the ITL target) for its next token
however many prompts arrive, and a request's TTFT is the steps that prefill the prompts
queued ahead of it and its own (agent/speed.py's model), not every prefill of the step.
Cancels that arrive meanwhile are applied between calls (a prompt part-way through its
prefill frees its slot).

The scheduler holds the requests accepted but not yet handed to the engine (``submits``),
the engine sequences in flight (``by_seq``) and the cancels for the next tick; what it needs
of the server is a :class:`SchedulerHost` (the loaded model, its tokenizer, the replica id).

An engine step that raises never stops the loop.  A typed error (:class:`RewarmError`, e.g.
a package refusing its inputs: nothing ran) fails the requests of that step with its own
code.  Any other exception (a ``RuntimeError`` from a forward: what it left in the KV cache
is unknown) answers every request held or being submitted 503 ``replica_failed`` (none of
the step's tokens is sent: the events of a failed call are never delivered) and frees their
KV slots; the loop keeps serving while the engine stays usable, and after
``ENGINE_FAILURES_MAX`` such steps in a row without one that succeeds, or when freeing the
slots fails too, the engine is broken: ``on_broken`` is called (the worker then drains and
exits, so its node agent replaces it), :meth:`BatchScheduler.health` says why, and every
later request is answered 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Protocol

from agent.errors import RewarmError
from agent.protocol import error_message, pack
from agent.replica.meter import ReplicaMeter
from agent.replica.stops import StopText
from agent.wire import refusals

log = logging.getLogger("agent.replica.worker")

ENGINE_FAILURES_MAX = 3
"""Engine steps failing with an untyped exception in a row, with none succeeding between,
after which the engine is taken as broken (one may be a bad input's; three are the engine)."""


@dataclass
class Request:
    """One accepted ``generate``: where its answers go, its tokens so far, its stop state."""

    request_id: Any
    writer: asyncio.StreamWriter
    started_s: float
    text: bool
    seq_id: int = -1
    first_s: float | None = None
    tokens: list[int] = field(default_factory=list)
    prefix_at: int = 0        # incremental detokenization: text sent covers tokens[:read_at]
    read_at: int = 0
    prompt_tokens: int = 0
    stops: StopText = field(default_factory=StopText)
    fed: str = ""             # detokenized text fed to ``stops`` so far
    sent: str = ""            # text let out so far (the done message's ``text``)
    owner: dict | None = None  # the connection's requests by id (left when answered)

    def finished(self) -> None:
        if self.owner is not None and self.owner.get(request_key(self.request_id)) is self:
            del self.owner[request_key(self.request_id)]


def request_key(request_id: Any) -> Any:
    """A request id as a dict key (ids are ints or strings; anything else shares None)."""
    return request_id if type(request_id) in (int, str) else None


def send(writer: asyncio.StreamWriter, message: dict) -> None:
    """Write one message to ``writer`` unless its connection is closing."""
    if not writer.is_closing():
        writer.write(pack(message))


class SchedulerHost(Protocol):
    """What the scheduler reads of the server (agent/replica/worker.py's ``Worker``)."""

    loaded: Any          # agent/replica/zygote.Loaded: ``engine``, ``path`` (how it came up)
    replica_id: str

    def tokenizer(self) -> Any:
        ...


class BatchScheduler:
    """One batching loop over the engine (module docstring).  ``pool``: the engine's one
    thread (agent/replica/worker.py's ``make_engine_thread``); ``meter``: the replica's
    measured speed, fed one step per tick; ``on_broken``: called once if the engine breaks
    (module docstring)."""

    def __init__(self, host: SchedulerHost, pool: ThreadPoolExecutor,
                 meter: ReplicaMeter, on_broken: Callable[[], None] | None = None) -> None:
        self.host = host
        self._pool = pool
        self.meter = meter
        self.submits: list[tuple[Request, dict]] = []   # accepted, not yet submitted
        self.cancels: list[int] = []                    # engine sequences to cancel next tick
        self.by_seq: dict[int, Request] = {}            # engine sequence id -> its request
        self.wake = asyncio.Event()
        self.send = send          # writes one answer to a connection (tests watch it here)
        self.failures = 0         # untyped engine failures in a row (module docstring)
        self._taking: list[Request] = []   # taken from ``submits``, not yet held or answered
        self.broken: str | None = None   # why the engine is taken as broken, once it is
        self.on_broken = on_broken
        self.call_started_s: float | None = None   # perf_counter when the engine call began
        # (prompt, generated tokens) of the requests finished in this step, for the meter
        self.departed: list[tuple[int, int]] = []

    def accept(self, request: Request, args: dict) -> None:
        """Queue ``request`` for the next tick (``args``: :meth:`Engine.submit`'s)."""
        self.submits.append((request, args))

    def cancel(self, request: Request) -> None:
        """Stop ``request`` (its client left or sent ``cancel``): out of the submit list, or
        its engine sequence cancelled (KV slot freed) on the next tick; no answer is sent."""
        self.submits = [(r, m) for r, m in self.submits if r is not request]
        if request.seq_id >= 0 and self.by_seq.get(request.seq_id) is request:
            del self.by_seq[request.seq_id]
            self.cancels.append(request.seq_id)
            self.wake.set()

    def in_flight(self) -> int:
        """Requests accepted and not yet answered."""
        return len(self.by_seq) + len(self.submits)

    def holds(self, request: Request) -> bool:
        """Whether ``request`` is still queued or running here."""
        return request.seq_id in self.by_seq or any(r is request for r, _ in self.submits)

    def _tick(self, submits: list[tuple[Request, dict]], cancels: list[int]):
        """On the engine thread: cancel, submit, begin the step (its prefill budget at the
        running batch), then its first prefill call (if one can run); :meth:`_prefill_one`
        runs the others, one per call, and the decode follows once their first tokens are
        sent."""
        engine = self.host.loaded.engine
        for seq_id in cancels:
            engine.cancel(seq_id)
        failed = []
        for request, args in submits:
            try:
                request.seq_id = engine.submit(**args)
            except RewarmError as exc:
                failed.append((request, exc))
        engine.begin_step()
        return failed, (engine.prefill() if engine.can_prefill else [])

    def _prefill_one(self, cancels: list[int]):
        """On the engine thread: cancel, then the step's next prefill call (if one can run)."""
        engine = self.host.loaded.engine
        for seq_id in cancels:
            engine.cancel(seq_id)
        return engine.prefill() if engine.can_prefill else []

    async def _fail_held(self, exc: RewarmError, submitting: list[Request]) -> None:
        """An engine step raised a typed error (a forward refusing its inputs, e.g.
        PackageInputError: nothing ran).  Fail what the engine holds and ``submitting``,
        answer each request with the error, and keep serving the next ones."""
        log.error("engine step failed; failing the requests in it: %s", exc)
        held, again = await self._release(submitting)
        if again is None:
            self._answer(held, exc.code, exc.message, exc.refusal)
            return
        self.failures = ENGINE_FAILURES_MAX      # it cannot free its slots: it is broken
        self._failed(held, f"engine step failed: {type(exc).__name__}: {exc}; freeing its KV "
                           f"slots failed too: {type(again).__name__}: {again}")

    async def _engine_raised(self, exc: Exception, submitting: list[Request]) -> None:
        """An engine step raised an untyped exception (module docstring): every request held
        or ``submitting`` is answered 503 ``replica_failed``, their slots are freed, and after
        ``ENGINE_FAILURES_MAX`` in a row (or when freeing fails) the engine is broken."""
        self.failures += 1
        reason = f"engine step failed: {type(exc).__name__}: {exc}"
        log.error("%s (%d in a row); failing the requests in it", reason, self.failures,
                  exc_info=exc, extra={"replica": self.host.replica_id})
        held, again = await self._release(submitting)
        if again is not None:   # the engine cannot even free its slots
            reason += f"; freeing its KV slots failed too: {type(again).__name__}: {again}"
            self.failures = ENGINE_FAILURES_MAX
        self._failed(held, reason)

    async def _release(self, submitting: list[Request]) -> tuple[list[Request], Exception | None]:
        """Take every request the engine holds, and ``submitting``, off the batch and free
        their sequences on the engine thread: the requests (each once) and what freeing
        raised (None when it worked)."""
        held = list({id(r): r for r in [*self.by_seq.values(), *submitting]}.values())
        ids = [r.seq_id for r in held if r.seq_id >= 0]
        self.by_seq.clear()
        engine = self.host.loaded.engine
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._pool, lambda: [engine.cancel(i) for i in ids])
        except Exception as again:
            return held, again
        return held, None

    def _answer(self, held: list[Request], code: int, reason: str, refusal: str | None) -> None:
        for request in held:
            request.finished()
            self.send(request.writer, error_message(request.request_id, code, reason,
                                                    refusal=refusal))

    def _failed(self, held: list[Request], reason: str) -> None:
        """Answer ``held`` 503 ``replica_failed``; at ``ENGINE_FAILURES_MAX`` failures in a
        row the engine is broken (once): health says so and ``on_broken`` runs."""
        self._answer(held, 503, reason, refusals.REPLICA_FAILED)
        if self.failures >= ENGINE_FAILURES_MAX and self.broken is None:
            self.broken = reason
            log.error("engine broken (%s): this replica stops taking requests", reason,
                      extra={"replica": self.host.replica_id})
            if self.on_broken is not None:
                self.on_broken()

    def health(self) -> dict[str, Any]:
        """What the ``health`` op adds: ``broken`` (why) once the engine is broken, and
        ``engine_busy_s`` while an engine call runs (seconds since it began: a front door
        that found the replica silent keeps it out of routing while this is past its bound,
        agent/frontdoor/first_token.py)."""
        out: dict[str, Any] = {} if self.broken is None else {"broken": self.broken}
        started = self.call_started_s
        if started is not None:
            out["engine_busy_s"] = round(time.perf_counter() - started, 3)
        return out

    def _refuse_broken(self) -> None:
        """The engine is broken: answer what was accepted since, without touching it."""
        submits, self.submits = self.submits, []
        self.cancels.clear()
        for request, _ in submits:
            request.finished()
            self.send(request.writer, error_message(
                request.request_id, 503, f"replica's engine is broken ({self.broken}); it is "
                "being replaced", refusal=refusals.REPLICA_FAILED))

    async def _engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the engine thread, timed for :meth:`health` while it runs."""
        self.call_started_s = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.call_started_s = None

    async def run(self) -> None:
        """The batching loop (module docstring), until cancelled.  An exception outside the
        engine calls (sending, bookkeeping) is handled like an engine step's: the requests
        held are answered 503 and their slots freed, and the loop goes on (or the engine is
        broken): it never ends with requests unanswered."""
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # requests taken from the queue but not yet held by the engine's sequences
                # are answered too, but none twice
                taken, self._taking = self._taking, []
                await self._engine_raised(exc, [r for r in taken if r.owner is None
                                                or r.owner.get(request_key(r.request_id)) is r])

    def loop_ended(self, task: asyncio.Task, stop: Callable[[], None]) -> None:
        """:meth:`run`'s task ended other than by a stop (a bug past its own guard): the
        engine is taken as broken (health says so) and ``stop`` answers what is held 503,
        so no request waits on a loop that is gone."""
        if task.cancelled():
            return
        self.broken = self.broken or f"batch loop ended: {task.exception()!r}"
        log.error("%s; the replica stops", self.broken, extra={"replica": self.host.replica_id})
        stop()

    async def _step(self) -> None:
        """One pass of :meth:`run`: wait for work, or tick the engine once."""
        loaded = self.host.loaded
        if self.broken is not None:
            self._refuse_broken()
        if not (self.submits or self.cancels or (loaded and loaded.engine.busy)) \
                or self.broken is not None:
            self.meter.backlog.idle()   # the wait for work is never backlogged time
            self.wake.clear()
            await self.wake.wait()
            return
        submits, self.submits = self.submits, []
        self._taking = [r for r, _ in submits]
        cancels, self.cancels = self.cancels, []
        for request, _ in submits:
            request.seq_id = -2  # being submitted
        started = time.perf_counter()
        try:
            failed, events = await self._engine(self._tick, submits, cancels)
        except RewarmError as exc:
            await self._fail_held(exc, [r for r, _ in submits])
            return
        except Exception as exc:   # untyped: the engine's state is unknown
            await self._engine_raised(exc, [r for r, _ in submits])
            return
        for request, err in failed:
            request.finished()
            self.send(request.writer, error_message(request.request_id, err.code, err.message,
                                                     refusal=err.refusal))
        for request, _ in submits:
            if request.seq_id >= 0 and (request.writer.is_closing()
                                        or request.owner is not None
                                        and request.owner.get(request_key(request.request_id))
                                        is not request):  # left or cancelled meanwhile
                self.cancels.append(request.seq_id)
            elif request.seq_id >= 0:
                self.by_seq[request.seq_id] = request
        self._taking = []    # each is held by a sequence now, or answered
        for seq_id in cancels:
            self.by_seq.pop(seq_id, None)
        self._deliver(events)
        try:
            # One prefill call per engine call, its first tokens sent at once: a request's
            # TTFT is the calls queued ahead of it and its own (agent/speed.py's model), not
            # every call of the step (the ones behind it too).
            while self.host.loaded.engine.can_prefill:
                cancels, self.cancels = self.cancels, []
                for seq_id in cancels:
                    self.by_seq.pop(seq_id, None)
                admitted = await self._engine(self._prefill_one, cancels)
                self._deliver(admitted)
                events += admitted
            decoded = await self._engine(self.host.loaded.engine.decode)
        except RewarmError as exc:
            await self._fail_held(exc, [])
            return
        except Exception as exc:   # untyped: the engine's state is unknown
            await self._engine_raised(exc, [])
            return
        self.failures = 0
        self._deliver(decoded)
        # the step's wall time as the streams saw it: its overrun of the plan shrinks the
        # next budgets (agent/replica/speedmeter.py)
        self.host.loaded.engine.end_step(time.perf_counter() - started)
        events += decoded  # one tick for the meter: the step's prefill calls and its decode
        departed, self.departed = self.departed, []
        # backlogged: work is left for the next step (prompt tokens still to prefill, or
        # requests accepted meanwhile), so this replica ran flat out (agent/throughput.py)
        backlog = bool(self.submits) or self.host.loaded.engine.load.waiting_seqs > 0
        self.meter.step(sum(1 for e in events if e.token >= 0),
                        len({e.seq_id for e in events}), time.perf_counter() - started,
                        departed=departed, backlog=backlog)

    def _deliver(self, events) -> None:
        """Send each event's token (and the ``done`` answer) to its request's connection."""
        now = time.perf_counter()
        for event in events:
            request = self.by_seq.get(event.seq_id)
            if request is not None:
                self._on_event(request, event, now)

    def _on_event(self, request: Request, event, now: float) -> None:
        """Answer one engine event: a ``tokens`` message (with the text that can be let out:
        never past a stop string), and ``done`` when the sequence ended — at ``max_tokens``
        (``finish_reason: length``), a stop token or a stop string (``stop``; the engine's
        sequence is then cancelled, freeing its slot)."""
        finish = None
        if event.token >= 0:
            request.first_s = request.first_s or now
            request.tokens.append(event.token)
            out = {"id": request.request_id, "type": "tokens", "tokens": [event.token]}
            if len(request.tokens) == 1:
                out["prompt_tokens"] = request.prompt_tokens
            if request.text:
                piece = next_text(self.host.tokenizer(), request)
                request.fed += piece
                out["text"] = self._let_out(request, piece, event.done)
                if request.stops.stopped:
                    finish = "stop"
            self.send(request.writer, out)
        if event.done and finish is None:
            finish = "stop" if event.token < 0 else "length"
            if request.text and event.token < 0:  # a stop token: no tokens message carried
                self._let_out(request, "", True)  # the last text; done's ``text`` does
        if finish is None:
            return
        del self.by_seq[event.seq_id]
        if not event.done:  # a stop string ended it: the engine stops too
            self.cancels.append(event.seq_id)
        request.finished()
        done = {"id": request.request_id, "type": "done",
                "ttft_ms": round(((request.first_s or now) - request.started_s) * 1e3, 3),
                "total_ms": round((now - request.started_s) * 1e3, 3),
                "path": self.host.loaded.path, "replica": self.host.replica_id,
                "n_tokens": len(request.tokens), "prompt_tokens": request.prompt_tokens,
                "finish_reason": finish}
        if request.text:
            done["text"] = request.sent
        self.departed.append((request.prompt_tokens, len(request.tokens)))
        self.send(request.writer, done)

    def _let_out(self, request: Request, piece: str, last: bool) -> str:
        """Feed ``piece`` to the request's stop strings; returns the text that may be sent.
        On the last token, the text the window decode still held back (a last character
        cut, a tail that might have begun a stop string) is matched and let out too."""
        out = request.stops.feed(piece)
        if last and not request.stops.stopped:
            full = self.host.tokenizer().decode(request.tokens)
            rest = full[len(request.fed):] if full.startswith(request.fed) else ""
            request.fed += rest
            out += request.stops.feed(rest)
            out += request.stops.flush()
        request.sent += out
        return out


def next_text(tokenizer, request: Request) -> str:
    """The text ``request.tokens`` add since the last call ("" while the newest tokens end in
    the middle of a character).  Decodes a short window — from the token before the text
    already sent — rather than each token alone, so byte-level BPE pieces of one character are
    joined before they are sent (the usual incremental detokenization of serving engines)."""
    prefix = tokenizer.decode(request.tokens[request.prefix_at:request.read_at])
    window = tokenizer.decode(request.tokens[request.prefix_at:])
    if len(window) <= len(prefix) or window.endswith("\ufffd"):
        return ""
    request.prefix_at, request.read_at = request.read_at, len(request.tokens)
    return window[len(prefix):]
