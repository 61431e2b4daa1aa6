"""``rewarm replica``: one process, one model, an asyncio server on agent/protocol.py framing.

States (a zygote starts in ZYGOTE, a booted replica in SERVING)::

    ZYGOTE --restore ok--> SERVING --shutdown / SIGTERM / parent died--> CLOSED
      |  ^                    |
      |  +--restore failed----+ (answered with the error; the zygote stays a zygote)
      +--------shutdown / SIGTERM / parent died--------------------------> CLOSED

Requests multiplex over one connection by ``id``.  ``generate`` requests from every
connection feed one batching loop: each tick submits what arrived, then runs one engine step
on a single worker thread — :meth:`Engine.admit` one sequence at a time (the prefill of each
admitted sequence, whose first token is sent before the next prefill starts) then
:meth:`Engine.decode` (one batched decode step for all active ones) — so the event loop keeps answering ``health`` and ``stats`` while the model runs.

Speed: ``stats`` carries the engine's measured speed (agent/speed.py ``SPEED_META_KEYS``,
once measured), its queue (``QUEUE_META_KEYS``, counting requests accepted but not yet handed
to the engine) and ``decode_tokens_per_s_per_seq`` at the current batch.  A ``generate`` that
carries ``deadline_ms`` (ms left for its first token) is refused with 429 when the predicted
TTFT here exceeds it (:meth:`Worker.predict_ttft_s`), so the queue is bounded in time.  No process is left behind: the worker exits when its parent dies
(PR_SET_PDEATHSIG on Linux, and a parent-pid watchdog everywhere), on ``shutdown`` and on
SIGTERM.
"""

from __future__ import annotations

import asyncio
import ctypes
import enum
import json
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import (ConfigError, InvalidCheckpoint, Overloaded, ProtocolError,
                          RewarmError, Unauthorized)
from agent.protocol import (DEFAULT_LIMITS, DEFAULT_MAX_TOKENS, Decoder, check_stop,
                            error_message, pack, read_messages)
from agent.replica.meter import ReplicaMeter
from agent.replica.stops import StopText

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
MAX_TOKENS_LIMIT = 1 << 16
CONTROL_OPS = frozenset({"restore", "capture", "shutdown"})


def make_engine_thread() -> ThreadPoolExecutor:
    """The one thread that runs every torch call of a replica process: the load (boot, restore,
    a zygote's warm-up), the restore op and every engine step.  One thread, because each thread
    that opens OpenMP parallel regions gets its own team of OpenMP workers: with two teams
    (say the warm-up on the main thread, the restore on this one) libgomp counts more threads
    than cores and throttles its spin-wait, so every parallel region's workers sleep and are
    woken through a futex — the same slowdown as ``OMP_WAIT_POLICY=passive``.  Measured
    (bench/golden_profile.py, 2 cores, load 0.4-0.8, median of 5): the zygote's golden check
    372 ms with the warm-up on another thread, 266 ms on the same one.

    The same spin-wait is a hazard where the cores are shared: beside another process running
    torch on both cores the one-team check took 3.0 s against 0.83 s for two teams (median of
    3).  Give replicas that share cores ``--threads 1`` (no OpenMP workers at all, as the trace
    replay does), or set ``OMP_WAIT_POLICY=passive`` (libgomp then sleeps at once: robust,
    and as slow as two teams on a quiet machine)."""
    return ThreadPoolExecutor(1, thread_name_prefix="engine")


class State(enum.Enum):
    ZYGOTE = "zygote"
    RESTORING = "restoring"
    SERVING = "serving"
    CLOSED = "closed"


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent exits (prctl PR_SET_PDEATHSIG).
    Returns False where that is not available (the watchdog in :class:`Worker` still runs)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


@dataclass
class _Request:
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
        if self.owner is not None and self.owner.get(_key(self.request_id)) is self:
            del self.owner[_key(self.request_id)]


def _key(request_id: Any) -> Any:
    """A request id as a dict key (ids are ints or strings; anything else shares None)."""
    return request_id if type(request_id) in (int, str) else None


class Worker:
    """The replica server.  ``loaded`` (agent/replica/zygote.Loaded) or None for a zygote that
    restores into ``buffer``.  ``parent_pid``: exit when the parent changes (None: no watchdog)."""

    def __init__(self, loaded=None, *, buffer=None, replica_id: str = "replica",
                 parent_pid: int | None = None, watchdog_s: float = 1.0,
                 tcp_control: bool = True, drain_grace_s: float = 30.0,
                 engine_thread: ThreadPoolExecutor | None = None) -> None:
        self.loaded, self.buffer, self.replica_id = loaded, buffer, replica_id
        # restore/capture/shutdown read or write files on this host or end the process: on a
        # TCP listener they are refused unless ``tcp_control`` (a unix socket's file mode
        # already says who may connect).
        self.tcp_control, self._tcp = tcp_control, False
        self.state = State.SERVING if loaded is not None else State.ZYGOTE
        self.parent_pid, self.watchdog_s = parent_pid, watchdog_s
        # the engine's one thread (make_engine_thread); pass the one that loaded the model
        self._pool = engine_thread if engine_thread is not None else make_engine_thread()
        self._submits: list[tuple[_Request, dict]] = []
        self._cancels: list[int] = []
        self._by_seq: dict[int, _Request] = {}
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._tokenizer = None
        self.meter = ReplicaMeter()
        self.drain_grace_s, self.draining = drain_grace_s, False
        self._chat_template = None  # loaded on first use; False: the model has none

    # --- lifecycle -----------------------------------------------------------------------
    async def serve(self, listen: str, ready=None, data_listen: str | None = None) -> None:
        """Listen on ``HOST:PORT`` or ``unix:PATH`` until stopped; ``ready(address)`` is called
        once listening (port 0 picks a free port).  ``data_listen`` (``HOST:PORT``) is a second,
        TCP listener for other hosts' front doors (a node agent keeps ``listen`` a unix socket
        for its control ops); its address is ``self.data_address``."""
        self._tcp = not listen.startswith("unix:")
        self.data_address = None
        extra = None
        if data_listen:
            dhost, _, dport = data_listen.rpartition(":")
            extra = await asyncio.start_server(self._connection, dhost or "127.0.0.1", int(dport))
            bound = extra.sockets[0].getsockname()
            self.data_address = f"{bound[0]}:{bound[1]}"
        if listen.startswith("unix:"):
            server = await asyncio.start_unix_server(self._connection, path=listen[5:])
            address = listen
        else:
            host, _, port = listen.rpartition(":")
            server = await asyncio.start_server(self._connection, host or "127.0.0.1", int(port))
            bound = server.sockets[0].getsockname()
            address = f"{bound[0]}:{bound[1]}"
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.drain)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        tasks = [asyncio.create_task(self._batch_loop())]
        if self.parent_pid is not None:
            tasks.append(asyncio.create_task(self._watch_parent()))
        if ready is not None:
            ready(address)
        try:
            await self._stop.wait()
        finally:
            server.close()
            if extra is not None:
                extra.close()
            self.state = State.CLOSED
            held = list(self._by_seq.values())
            for request in held + [r for r, _ in self._submits]:
                self._send(request.writer, error_message(request.request_id, 503, "replica shutting down"))
            for task in tasks:
                task.cancel()
            if self.loaded is not None and held:
                # Free their KV slots too: an engine can outlive this server (an in-process
                # replica, a test's shared model).  Queued on the engine thread, after the step
                # that may be running; nothing else is queued there once the loop is cancelled.
                engine, ids = self.loaded.engine, [r.seq_id for r in held if r.seq_id >= 0]
                self._pool.submit(lambda: [engine.cancel(i) for i in ids])
            self._pool.shutdown(wait=False)
            if listen.startswith("unix:"):
                Path(listen[5:]).unlink(missing_ok=True)

    def stop(self) -> None:
        self._stop.set()

    def drain(self) -> None:
        """SIGTERM: refuse new ``generate`` (503 + ``retry_after_ms``), let the requests in
        flight finish for up to ``drain_grace_s``, then stop (what is left gets 503)."""
        if self.draining:
            return
        self.draining = True
        log.info("draining: %d requests in flight, at most %.1f s", self.in_flight(),
                 self.drain_grace_s, extra={"replica": self.replica_id})
        asyncio.get_running_loop().create_task(self._drain_then_stop())

    def in_flight(self) -> int:
        return len(self._by_seq) + len(self._submits)

    async def _drain_then_stop(self, poll_s: float = 0.05) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_grace_s
        while self.in_flight() and loop.time() < deadline:
            await asyncio.sleep(min(poll_s, deadline - loop.time()))
        self.stop()

    async def _watch_parent(self) -> None:
        while True:
            if os.getppid() != self.parent_pid:
                log.warning("parent %s is gone; exiting", self.parent_pid)
                self.stop()
                return
            await asyncio.sleep(self.watchdog_s)

    # --- connections ---------------------------------------------------------------------
    @staticmethod
    def _send(writer: asyncio.StreamWriter, message: dict) -> None:
        if not writer.is_closing():
            writer.write(pack(message))

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mine: dict[Any, _Request] = {}  # this connection's generate requests by id
        try:
            async for message in read_messages(reader, Decoder()):
                await self._dispatch(message, writer, mine)
                await writer.drain()
        except ProtocolError as exc:
            # The stream cannot be trusted past this point: what is still running for this
            # connection is cancelled below, and said so, before the framing error and close.
            pending = {id(r) for r, _ in self._submits}
            for request in mine.values():
                if request.seq_id in self._by_seq or id(request) in pending:
                    self._send(writer, error_message(
                        request.request_id, 503, "cancelled: a framing error on this "
                        "connection closes it"))
            self._send(writer, error_message(None, exc.code, exc.message))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            for request in mine.values():  # the client left: free its KV slots
                self._cancel(request)
            writer.close()

    def _cancel(self, request: _Request) -> None:
        """Stop ``request`` (its client left or sent ``cancel``): out of the submit list, or
        its engine sequence cancelled (KV slot freed) on the next tick; no answer is sent."""
        self._submits = [(r, m) for r, m in self._submits if r is not request]
        if request.seq_id >= 0 and self._by_seq.get(request.seq_id) is request:
            del self._by_seq[request.seq_id]
            self._cancels.append(request.seq_id)
            self._wake.set()

    async def _dispatch(self, msg: dict, writer: asyncio.StreamWriter, mine: dict) -> None:
        op, rid = msg.get("op"), msg.get("id")
        reply = lambda result: self._send(writer, {"id": rid, "type": "result", "result": result})  # noqa: E731
        try:
            if op in CONTROL_OPS and _over_tcp(writer) and not self.tcp_control:
                raise Unauthorized(f"op {op!r} reads or writes files on this host or stops the "
                                   "replica: accepted on a unix-socket listener only (start "
                                   "with --tcp-control on a trusted network)", op=op)
            if op == "generate" and self.draining:
                self._send(writer, error_message(rid, 503, "replica draining: it stops within "
                                                 f"drain_grace_s({self.drain_grace_s})",
                                                 retry_after_ms=1000))
            elif op == "generate":
                request = self._accept(msg, writer)
                request.owner = mine
                mine[_key(rid)] = request
                self._wake.set()
            elif op == "cancel":
                request = mine.pop(_key(rid), None)
                if request is not None:
                    self._cancel(request)
            elif op == "health":
                reply({"ok": self.state is State.SERVING, "state": self.state.value})
            elif op == "stats":
                reply(self.stats())
            elif op == "restore":
                reply(await self._restore(msg))
            elif op == "capture":
                reply(await self._capture(msg))
            elif op == "shutdown":
                reply({"state": State.CLOSED.value})
                await writer.drain()
                self.stop()
            else:
                raise ProtocolError(f"unknown op {op!r}", field="op", value=op,
                                    limit=["generate", "cancel", "health", "stats", "restore",
                                           "capture", "shutdown"])
        except RewarmError as exc:
            self._send(writer, error_message(rid, exc.code, exc.message,
                                             **getattr(exc, "answer", {})))
        except Exception as exc:  # a bug or a torch error: answer, keep serving the others
            log.exception("op %s failed", op)
            self._send(writer, error_message(rid, 500, f"{type(exc).__name__}: {exc}"))

    # --- ops -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = {"state": self.state.value, "replica": self.replica_id,
                                  "kv_capacity_tokens": 0, "kv_used_tokens": 0, "max_seqs": 0,
                                  "active_seqs": 0, "model": None, "version": None}
        if self.loaded is not None:
            engine = self.loaded.engine
            result.update(engine.capacity())
            result.update(model=self.loaded.identity.name, version=self.loaded.identity.version,
                          path=self.loaded.path, package_digest=self.loaded.package_digest,
                          phases_s=self.loaded.phases_s, device=self.loaded.device,
                          restore_io=self.loaded.restore_io, fallback=self.loaded.fallback)
            pending = [args["prompt"] for _, args in self._submits]
            result["waiting_seqs"] += len(pending)
            result["queued_prefill_tokens"] += sum(len(p) for p in pending)
            result.update(engine.speed_report(result["active_seqs"], result["active_ctx_tokens"]))
            result.update(self.meter.snapshot(engine))
        result["draining"] = self.draining
        return result

    def predict_ttft_s(self, prompt_tokens: int) -> float:
        """Predicted TTFT (s) here for a new request of ``prompt_tokens`` tokens: the engine's
        queue plus the requests accepted but not yet submitted (:meth:`Engine.predict_ttft_s`)."""
        pending = [args["prompt"] for _, args in self._submits]
        return self.loaded.engine.predict_ttft_s(
            prompt_tokens, waiting_seqs=len(pending),
            queued_prefill_tokens=sum(len(p) for p in pending))

    def _accept(self, msg: dict, writer) -> _Request:
        """Check one generate (docs/protocol.md) and queue it for the next tick.  A ``prompt``
        is tokenized here and ``messages`` rendered with the model's chat template first;
        both stop at the model's end-of-sequence token beside the ``stop`` they name (text
        in, text out), while a ``tokens`` request stops only at the ids it names."""
        if self.state is not State.SERVING:
            raise ProtocolError(f"replica is {self.state.value}, not serving", field="state",
                                value=self.state.value, limit=State.SERVING.value)
        tokens, prompt = msg.get("tokens"), msg.get("prompt")
        if tokens is None and isinstance(msg.get("messages"), list):
            prompt = self.chat_template().render(msg["messages"])
        stop = msg.get("stop") or []
        if not isinstance(stop, list) or not all(type(t) in (int, str) for t in stop):
            raise ProtocolError("stop must be a list of token ids and strings", field="stop",
                                value=stop, limit="[int | str]")
        # the protocol's counts and lengths (the front door's too): each stop string is
        # searched for at every token, on the event loop
        check_stop(stop, DEFAULT_LIMITS)
        stop_ids = {t for t in stop if type(t) is int}
        stop_strs = [t for t in stop if type(t) is str and t]
        text = tokens is None or bool(stop_strs) or msg.get("detokenize") is True
        if tokens is None and isinstance(prompt, str):
            tokens = self.tokenizer_for("prompt").encode(prompt).ids
            eos = self.loaded.config.eos_token_id
            if eos is not None and eos >= 0 and msg.get("ignore_eos") is not True:
                stop_ids.add(eos)
        if text:
            self.tokenizer_for("stop")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ProtocolError("generate needs tokens: [int], prompt: str or messages",
                                field="tokens", value=type(tokens).__name__, limit="list of int")
        max_tokens, seed = msg.get("max_tokens", DEFAULT_MAX_TOKENS), msg.get("seed")
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise ProtocolError(f"max_tokens={max_tokens!r} must be an int in [1, {MAX_TOKENS_LIMIT}]",
                                field="max_tokens", value=max_tokens, limit=MAX_TOKENS_LIMIT)
        if seed is not None and not isinstance(seed, int):
            raise ProtocolError(f"seed={seed!r} must be an int or absent", field="seed", value=seed, limit=None)
        sampling = _sampling(msg)
        # The engine checks the rest (token range, KV capacity, sampling ranges) before
        # anything is allocated.
        self.loaded.engine.kv.check(len(tokens) + max_tokens)
        self._check_deadline(msg.get("deadline_ms"), len(tokens))
        request = _Request(msg.get("id"), writer, time.perf_counter(), text,
                           prompt_tokens=len(tokens), stops=StopText(stop_strs))
        self._submits.append((request, {"prompt": tokens, "max_tokens": max_tokens,
                                        "seed": seed, "stop": stop_ids, "sampling": sampling}))
        return request

    def _check_deadline(self, deadline_ms: Any, prompt_tokens: int) -> None:
        """Refuse (Overloaded, 429) a request whose ``deadline_ms`` (ms left for its first
        token) the predicted TTFT here exceeds; the answer names both and, as
        ``retry_after_ms``, how far over the prediction is."""
        if deadline_ms is None:
            return
        if isinstance(deadline_ms, bool) or not isinstance(deadline_ms, (int, float)) \
                or not deadline_ms > 0 or deadline_ms == float("inf"):
            raise ProtocolError(f"deadline_ms={deadline_ms!r} must be a finite number > 0 (ms "
                                "left for the first token)", field="deadline_ms",
                                value=deadline_ms, limit="> 0")
        predicted_ms = self.predict_ttft_s(prompt_tokens) * 1e3
        if predicted_ms > deadline_ms:
            exc = Overloaded(
                f"replica {self.replica_id}: predicted TTFT {predicted_ms:.1f} ms exceeds "
                f"deadline_ms {deadline_ms:g}", model=self.loaded.identity.name,
                retry_after_ms=max(1, round(predicted_ms - deadline_ms)),
                depth=len(self._submits) + self.loaded.engine.load.waiting_seqs,
                limit=deadline_ms)
            exc.answer = {"predicted_ttft_ms": round(predicted_ms, 3),
                          "deadline_ms": deadline_ms,
                          "retry_after_ms": exc.retry_after_ms}
            raise exc

    def tokenizer_for(self, field_name: str):
        """The tokenizer, or a 400 naming ``field_name`` when the model has none."""
        try:
            return self.tokenizer()
        except InvalidCheckpoint as exc:
            raise ProtocolError(f"{field_name}: model {self.loaded.identity.name!r} has no "
                                f"tokenizer ({exc.message}); send tokens: [int] and stop "
                                "token ids instead", field=field_name, value="text",
                                limit="tokens") from exc

    def chat_template(self):
        """The model's chat template (a 400 when it has none)."""
        from agent.replica.tokenizer import load_chat_template

        if self._chat_template is None:
            self._chat_template = load_chat_template(self.loaded.tokenizer_dir or "") or False
        if self._chat_template is False:
            raise ProtocolError(f"messages: model {self.loaded.identity.name!r} has no chat "
                                "template; send prompt or tokens instead", field="messages",
                                value="messages", limit="prompt or tokens")
        return self._chat_template

    def tokenizer(self):
        if self._tokenizer is None:
            from agent.replica.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.loaded.tokenizer_dir or "")
        return self._tokenizer

    async def _restore(self, msg: dict) -> dict:
        from agent.replica import zygote

        if self.state is not State.ZYGOTE:
            raise ProtocolError(f"restore needs a zygote; this replica is {self.state.value}",
                                field="state", value=self.state.value, limit=State.ZYGOTE.value)
        if not isinstance(msg.get("snapshot"), str):
            raise ProtocolError("restore needs snapshot: path", field="snapshot",
                                value=msg.get("snapshot"), limit="str")
        self.state = State.RESTORING
        release = msg.get("release")
        try:
            loaded = await asyncio.get_running_loop().run_in_executor(
                self._pool, lambda: zygote.restore(Path(msg["snapshot"]), buffer=self.buffer,
                                                   release=Path(release) if release else None,
                                                   path="zygote_restore"))
        except BaseException:
            self.state = State.ZYGOTE  # fail closed: still a zygote, never serving
            raise
        self.loaded, self.state = loaded, State.SERVING
        return self.stats()

    async def _capture(self, msg: dict) -> dict:
        from agent.replica import zygote

        if self.loaded is None:
            raise ProtocolError("capture needs a loaded model", field="state",
                                value=self.state.value, limit=State.SERVING.value)
        if not isinstance(msg.get("dest"), str):
            raise ProtocolError(f"capture needs dest: path, got {msg.get('dest')!r}",
                                field="dest", value=msg.get("dest"), limit="str")
        if os.path.lexists(msg["dest"]):
            raise ConfigError(f"capture: dest {msg['dest']} already exists; a snapshot is never "
                              "written over another", name="dest", value=msg["dest"],
                              limit="a path that does not exist")
        manifest = await asyncio.get_running_loop().run_in_executor(
            self._pool, zygote.capture, self.loaded, Path(msg["dest"]))
        return {"dest": msg["dest"], "total_bytes": manifest.total_bytes,
                "golden_prompts": len(manifest.golden.prompts) if manifest.golden else 0}

    # --- the batching loop ----------------------------------------------------------------
    def _tick(self, submits: list[tuple[_Request, dict]], cancels: list[int]):
        """On the engine thread: cancel, submit, then the first prefill of the step (if a
        slot admits one); :meth:`_admit_one` does the rest, one per call, and the decode half
        follows once their first tokens are sent."""
        engine = self.loaded.engine
        for seq_id in cancels:
            engine.cancel(seq_id)
        failed = []
        for request, args in submits:
            try:
                request.seq_id = engine.submit(**args)
            except RewarmError as exc:
                failed.append((request, exc))
        return failed, (engine.admit(1) if engine.busy else [])

    def _admit_one(self, cancels: list[int]):
        """On the engine thread: cancel, then prefill the next waiting sequence (if any)."""
        engine = self.loaded.engine
        for seq_id in cancels:
            engine.cancel(seq_id)
        return engine.admit(1)

    async def _fail_held(self, exc: RewarmError, submitting: list[_Request]) -> None:
        """An engine step raised a typed error (a forward refusing its inputs, e.g.
        PackageInputError: nothing ran).  Fail what the engine holds and ``submitting``,
        answer each request with the error, and keep serving the next ones."""
        log.error("engine step failed; failing the requests in it: %s", exc)
        held = list(self._by_seq.values()) + submitting
        ids = [r.seq_id for r in held if r.seq_id >= 0]
        self._by_seq.clear()
        engine = self.loaded.engine
        await asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: [engine.cancel(i) for i in ids])
        for request in {id(r): r for r in held}.values():
            request.finished()
            self._send(request.writer, error_message(request.request_id, exc.code, exc.message))

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._submits or self._cancels or (self.loaded and self.loaded.engine.busy)):
                self._wake.clear()
                await self._wake.wait()
                continue
            submits, self._submits = self._submits, []
            cancels, self._cancels = self._cancels, []
            for request, _ in submits:
                request.seq_id = -2  # being submitted
            started = time.perf_counter()
            try:
                failed, events = await loop.run_in_executor(self._pool, self._tick, submits, cancels)
            except RewarmError as exc:
                await self._fail_held(exc, [r for r, _ in submits])
                continue
            for request, exc in failed:
                request.finished()
                self._send(request.writer, error_message(request.request_id, exc.code, exc.message))
            for request, _ in submits:
                if request.seq_id >= 0 and (request.writer.is_closing()
                                            or request.owner is not None
                                            and request.owner.get(_key(request.request_id))
                                            is not request):  # left or cancelled meanwhile
                    self._cancels.append(request.seq_id)
                elif request.seq_id >= 0:
                    self._by_seq[request.seq_id] = request
            for seq_id in cancels:
                self._by_seq.pop(seq_id, None)
            self._deliver(events)
            try:
                # One prefill per call, its first token sent at once: a request's TTFT is
                # the prefills queued ahead of it and its own (agent/speed.py's model), not
                # every prefill of the step (the ones behind it too).
                while self.loaded.engine.can_admit:
                    cancels, self._cancels = self._cancels, []
                    for seq_id in cancels:
                        self._by_seq.pop(seq_id, None)
                    admitted = await loop.run_in_executor(self._pool, self._admit_one, cancels)
                    self._deliver(admitted)
                    events += admitted
                decoded = await loop.run_in_executor(self._pool, self.loaded.engine.decode)
            except RewarmError as exc:
                await self._fail_held(exc, [])
                continue
            self._deliver(decoded)
            events += decoded  # one tick for the meter: the admitted prefills and the decode step
            self.meter.step(sum(1 for e in events if e.token >= 0),
                            len({e.seq_id for e in events}), time.perf_counter() - started)

    def _deliver(self, events) -> None:
        """Send each event's token (and the ``done`` answer) to its request's connection."""
        now = time.perf_counter()
        for event in events:
            request = self._by_seq.get(event.seq_id)
            if request is not None:
                self._on_event(request, event, now)

    def _on_event(self, request: _Request, event, now: float) -> None:
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
                piece = next_text(self.tokenizer(), request)
                request.fed += piece
                out["text"] = self._let_out(request, piece, event.done)
                if request.stops.stopped:
                    finish = "stop"
            self._send(request.writer, out)
        if event.done and finish is None:
            finish = "stop" if event.token < 0 else "length"
            if request.text and event.token < 0:  # a stop token: no tokens message carried
                self._let_out(request, "", True)  # the last text; done's ``text`` does
        if finish is None:
            return
        del self._by_seq[event.seq_id]
        if not event.done:  # a stop string ended it: the engine stops too
            self._cancels.append(event.seq_id)
        request.finished()
        done = {"id": request.request_id, "type": "done",
                "ttft_ms": round(((request.first_s or now) - request.started_s) * 1e3, 3),
                "total_ms": round((now - request.started_s) * 1e3, 3),
                "path": self.loaded.path, "replica": self.replica_id,
                "n_tokens": len(request.tokens), "prompt_tokens": request.prompt_tokens,
                "finish_reason": finish}
        if request.text:
            done["text"] = request.sent
        self._send(request.writer, done)

    def _let_out(self, request: _Request, piece: str, last: bool) -> str:
        """Feed ``piece`` to the request's stop strings; returns the text that may be sent.
        On the last token, the text the window decode still held back (a last character
        cut, a tail that might have begun a stop string) is matched and let out too."""
        out = request.stops.feed(piece)
        if last and not request.stops.stopped:
            full = self.tokenizer().decode(request.tokens)
            rest = full[len(request.fed):] if full.startswith(request.fed) else ""
            request.fed += rest
            out += request.stops.feed(rest)
            out += request.stops.flush()
        request.sent += out
        return out


def _sampling(msg: dict):
    """The engine's Sampling from a generate's ``temperature``, ``top_p`` and ``top_k``
    (ranges are the engine's to check; types here)."""
    from agent.replica.engine import Sampling

    values = {}
    for name, kinds in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", (int,))):
        value = msg.get(name)
        if value is not None:
            if type(value) not in kinds:
                raise ProtocolError(f"{name}={value!r} must be a number", field=name,
                                    value=value, limit=[k.__name__ for k in kinds])
            values[name] = value
    return Sampling(**values)


def next_text(tokenizer, request: _Request) -> str:
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


def _over_tcp(writer: asyncio.StreamWriter) -> bool:
    """Whether this connection came over TCP (not the unix socket the node agent uses)."""
    sock = writer.get_extra_info("socket")
    return sock is not None and sock.family != socket.AF_UNIX


def ready_line(address: str, worker: Worker, started_unix: float,
               imports_done_unix: float | None = None) -> str:
    """The one JSON line a worker prints on stdout once it listens (parents wait for it):
    address, pid, state, wall-clock stamps (``*_unix``, seconds) and the load phases."""
    stats = worker.stats()
    return json.dumps({"ready": address, "data": getattr(worker, "data_address", None),
                       "pid": os.getpid(), "state": worker.state.value,
                       "started_unix": started_unix, "imports_done_unix": imports_done_unix,
                       "ready_unix": time.time(),
                       "phases_s": stats.get("phases_s", {}), "path": stats.get("path")})


def run_replica(listen: str, *, model_dir: str | None = None, snapshot: str | None = None,
                zygote_mode: bool = False, release: str | None = None, compile: bool = False,
                buffer_bytes: int | None = None, threads: int | None = None,
                replica_id: str | None = None, started_unix: float | None = None,
                tcp_control: bool = False, data_listen: str | None = None,
                drain_grace_s: float = 30.0, metrics_listen: str | None = None,
                warm: str | None = None, device: str = "cpu") -> int:
    """The body of ``rewarm replica``: load one way, print the ready line, serve until stopped.

    Exactly one of ``model_dir`` (full boot; ``release`` binds its AOT package, ``compile``
    uses torch.compile), ``snapshot`` (restore into a fresh process) or ``zygote_mode`` (wait
    for a ``restore`` op; ``buffer_bytes`` sizes the restore buffer, ``warm`` names the snapshot
    it will likely restore, whose first-call costs it pays before it is ready).  On a TCP ``listen``
    the control ops (:data:`CONTROL_OPS`) are refused unless ``tcp_control``.  Raises
    ConfigError when not exactly one is given.  SIGTERM drains for ``drain_grace_s``;
    ``metrics_listen`` (HOST:PORT) serves /metrics, /healthz, /readyz (agent/health.py).
    ``device`` ("cpu", "cuda[:N]"): where the model runs; a zygote there holds a CUDA context
    and a device restore buffer (agent/replica/zygote.py ``prepare_zygote``).
    """
    from agent.errors import ConfigError

    started_unix = started_unix or time.time()
    chosen = [x for x in (model_dir, snapshot, zygote_mode or None) if x]
    if len(chosen) != 1:
        raise ConfigError("give exactly one of --model-dir, --snapshot, --zygote", name="mode",
                          value=len(chosen), limit=1)
    die_with_parent()
    parent = os.getppid()
    import torch

    from agent.replica import zygote

    imports_done_unix = time.time()
    torch.set_num_threads(threads or os.cpu_count() or 1)

    def load():   # on the engine thread, which then serves (see make_engine_thread)
        # OpenMP's thread count is per thread: a new thread starts at the core count until
        # torch next initialises it, so set it here, where the regions will run.
        torch.set_num_threads(threads or os.cpu_count() or 1)
        if zygote_mode:
            return None, zygote.prepare_zygote(threads, buffer_bytes or zygote.DEFAULT_BUFFER_BYTES,
                                               warm=Path(warm) if warm else None, device=device)
        if snapshot:
            return zygote.restore(Path(snapshot), release=Path(release) if release else None,
                                  device=device), None
        return zygote.boot(Path(model_dir), release=Path(release) if release else None,
                           compile=compile, device=device), None

    engine_thread = make_engine_thread()
    loaded, buffer = engine_thread.submit(load).result()
    worker = Worker(loaded, buffer=buffer, replica_id=replica_id or f"replica-{os.getpid()}",
                    parent_pid=parent, tcp_control=tcp_control, drain_grace_s=drain_grace_s,
                    engine_thread=engine_thread)
    status = _serve_status(worker, metrics_listen) if metrics_listen else None

    def ready(address: str) -> None:
        print(ready_line(address, worker, started_unix, imports_done_unix), flush=True)

    try:
        asyncio.run(worker.serve(listen, ready, data_listen))
    finally:
        if status is not None:
            status.close()
    return 0


def _serve_status(worker: Worker, listen: str):
    """The replica's status port: its load as ``rewarm_replica_*`` and readiness (serving
    and not draining)."""
    from agent.health import serve_status
    from agent.replica.meter import replica_registry

    def ready() -> tuple[bool, str]:
        if worker.draining:
            return False, "draining"
        if worker.state is not State.SERVING:
            return False, f"state {worker.state.value}"
        return True, "ready"

    host, _, port = listen.rpartition(":")
    try:
        return serve_status(replica_registry(worker.stats), host or "127.0.0.1", int(port),
                            ready=ready, component="replica")
    except OSError as exc:
        raise ConfigError(f"--metrics-listen {listen}: cannot listen: {exc}",
                          name="metrics_listen", value=listen, limit="a free HOST:PORT") from exc


def call(address: str, message: dict, *, timeout_s: float = 120.0) -> list[dict]:
    """A blocking one-request client (tests, benchmarks, the node agent's probes); see
    :func:`agent.protocol.request`."""
    from agent.protocol import request

    return request(address, message, timeout_s=timeout_s)
