"""``rewarm replica``: one process, one model, an asyncio server on agent/protocol.py framing.

States (a zygote starts in ZYGOTE, a booted replica in SERVING)::

    ZYGOTE --restore ok--> SERVING --shutdown / SIGTERM / parent died--> CLOSED
      |  ^                    |
      |  +--restore failed----+ (answered with the error; the zygote stays a zygote)
      +--------shutdown / SIGTERM / parent died--------------------------> CLOSED

Requests multiplex over one connection by ``id``.  ``generate`` requests from every
connection are checked against the wire's schema (agent/wire/schema.py) and feed one batching
loop (agent/replica/batching.py's :class:`BatchScheduler`), so the event loop keeps answering
``health`` and ``stats`` while the model runs.

Speed: ``stats`` carries the engine's measured speed (agent/speed.py ``SPEED_META_KEYS``,
once measured), its queue (``QUEUE_META_KEYS``, counting requests accepted but not yet handed
to the engine) and ``decode_tokens_per_s_per_seq`` at the current batch.  A ``generate`` that
carries ``deadline_ms`` (ms left for its first token) is refused with 429 when the predicted
TTFT here exceeds it (:meth:`Worker.predict_ttft_s`), so the queue is bounded in time.
After a restore, ``stats`` also carries the load's ``phases_s`` (the golden check's prefill,
decode and sampling among them) and ``warm``: whether the zygote's warmed engine served it,
why not, and on which threads the warm-up and the check ran (agent/replica/warmup.py).  No process is left behind: the worker exits when its parent dies
(PR_SET_PDEATHSIG on Linux, and a parent-pid watchdog everywhere), on ``shutdown`` and on
SIGTERM.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agent.errors import (ConfigError, ContextLengthExceeded, Overloaded,
                          ProtocolError, RewarmError, Unauthorized)
from agent.protocol import (DEFAULT_LIMITS, REPLICA_SCHEMAS, Decoder, error_message,
                            read_messages, validate_request)
from agent.replica.batching import BatchScheduler, Request, request_key, send
from agent.replica.meter import ReplicaMeter
from agent.replica.model_text import ModelText
from agent.replica.stops import StopText
from agent.replica.worker_restore import RestoreOps, State
from agent.wire import refusals

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
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


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent exits (prctl PR_SET_PDEATHSIG).
    Returns False where that is not available (the watchdog in :class:`Worker` still runs)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


class Worker:
    """The replica server.  ``loaded`` (agent/replica/zygote.Loaded) or None for a zygote that
    restores into ``buffer``.  ``parent_pid``: exit when the parent changes (None: no watchdog).
    ``itl_target_s``: the inter-token-latency target its engine's steps plan by, set on every
    model it serves (:meth:`apply_step_target`; None: the engine's default, agent/speed.py
    ``DEFAULT_ITL_SLO_S``; 0: whole prompts, no per-step budget)."""

    def __init__(self, loaded=None, *, buffer=None, replica_id: str = "replica",
                 parent_pid: int | None = None, watchdog_s: float = 1.0,
                 tcp_control: bool = True, drain_grace_s: float = 30.0,
                 engine_thread: ThreadPoolExecutor | None = None,
                 itl_target_s: float | None = None) -> None:
        self.loaded, self.buffer, self.replica_id = loaded, buffer, replica_id
        self.itl_target_s = itl_target_s
        self.apply_step_target()
        # restore/capture/shutdown read or write files on this host or end the process: on a
        # TCP listener they are refused unless ``tcp_control`` (a unix socket's file mode
        # already says who may connect).
        self.tcp_control = tcp_control
        self.state = State.SERVING if loaded is not None else State.ZYGOTE
        self.parent_pid, self.watchdog_s = parent_pid, watchdog_s
        # the engine's one thread (make_engine_thread); pass the one that loaded the model
        self._pool = engine_thread if engine_thread is not None else make_engine_thread()
        self._stop = asyncio.Event()
        self.meter = ReplicaMeter()
        # an engine found broken: health says so, and the replica drains and stops (its node
        # agent sees it gone and replaces it; agent/replica/batching.py)
        self.batch = BatchScheduler(self, self._pool, self.meter, on_broken=self.drain)
        self.drain_grace_s, self.draining = drain_grace_s, False
        self.text = ModelText(loaded)   # its tokenizer and chat template, loaded ahead
        if loaded is not None:          # (a zygote's come with its restore: worker_restore.py)
            self.text.preload_in_background()
        self.snapshots = RestoreOps(self)   # the restore and capture ops

    # --- lifecycle -----------------------------------------------------------------------
    async def serve(self, listen: str, ready=None, data_listen: str | None = None) -> None:
        """Listen on ``HOST:PORT`` or ``unix:PATH`` until stopped; ``ready(address)`` is called
        once listening (port 0 picks a free port).  ``data_listen`` (``HOST:PORT``) is a second,
        TCP listener for other hosts' front doors (a node agent keeps ``listen`` a unix socket
        for its control ops); its address is ``self.data_address``."""
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
        batching = asyncio.create_task(self.batch.run())
        batching.add_done_callback(lambda t: None if self._stop.is_set() else
                                   self.batch.loop_ended(t, self.stop))
        tasks = [batching]
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
            held = list(self.batch.by_seq.values())
            for request in held + [r for r, _ in self.batch.submits]:
                self._send(request.writer, error_message(request.request_id, 503,
                                                         "replica shutting down",
                                                         refusal=refusals.DRAINING))
            for task in tasks:
                task.cancel()
            # Free their KV slots too, and those of sequences answered but whose cancel was
            # still due on the next tick (a stop string ended them): an engine can outlive this
            # server (an in-process replica, a test's shared model).  Queued on the engine
            # thread, after the step that may be running; nothing else is queued there once
            # the loop is cancelled.
            ids = [r.seq_id for r in held if r.seq_id >= 0] + self.batch.cancels
            if self.loaded is not None and ids:
                engine = self.loaded.engine
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
        return self.batch.in_flight()


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
    _send = staticmethod(send)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mine: dict[Any, Request] = {}  # this connection's generate requests by id
        try:
            async for message in read_messages(reader, Decoder()):
                await self._dispatch(message, writer, mine)
                await writer.drain()
        except ProtocolError as exc:
            # The stream cannot be trusted past this point: what is still running for this
            # connection is cancelled below, and said so, before the framing error and close.
            for request in mine.values():
                if self.batch.holds(request):
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

    def _cancel(self, request: Request) -> None:
        self.batch.cancel(request)

    @property
    def _submits(self) -> list[tuple[Request, dict]]:
        """Requests accepted, not yet handed to the engine (the scheduler's list: the
        deadline check counts them, as agent/sim/worker.py's stand-in does its own)."""
        return self.batch.submits

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
                                                 retry_after_ms=1000, refusal=refusals.DRAINING))
            elif op == "generate":
                if request_key(rid) in mine:    # its answers could not be told apart
                    raise ProtocolError(f"id {rid!r} is already in flight on this connection",
                                        field="id", value=rid, limit="unique while in flight")
                request = self._accept(msg, writer)
                request.owner = mine
                mine[request_key(rid)] = request
                self.batch.wake.set()
            elif op == "cancel":
                request = mine.pop(request_key(rid), None)
                if request is not None:
                    self._cancel(request)
            elif op == "health":
                reply({"ok": self.state is State.SERVING and self.batch.broken is None,
                       "state": self.state.value, **self.batch.health()})
            elif op == "stats":
                reply(self.stats())
            elif op == "restore":
                reply(await self.snapshots.restore(msg))
            elif op == "capture":
                reply(await self.snapshots.capture(msg))
            elif op == "shutdown":
                reply({"state": State.CLOSED.value})
                await writer.drain()
                self.stop()
            else:
                raise ProtocolError(f"unknown op {op!r}", field="op", value=op,
                                    limit=["generate", "cancel", "health", "stats", "restore",
                                           "capture", "shutdown"])
        except RewarmError as exc:
            self._send(writer, error_message(rid, exc.code, exc.message, refusal=exc.refusal,
                                             **getattr(exc, "answer", {})))
        except Exception as exc:  # a bug or a torch error: answer, keep serving the others
            log.exception("op %s failed", op)
            self._send(writer, error_message(rid, 500, f"{type(exc).__name__}: {exc}"))

    # --- ops -----------------------------------------------------------------------------
    def apply_step_target(self) -> None:
        """Set the loaded engine's ITL target to this worker's (when it has one): at start and
        on every model a restore installs."""
        if self.loaded is not None and self.itl_target_s is not None:
            self.loaded.engine.itl_target_s = self.itl_target_s

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
                          restore_io=self.loaded.restore_io, fallback=self.loaded.fallback,
                          warm=self.loaded.warm)
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

    def _accept(self, msg: dict, writer) -> Request:
        """Check one generate against the wire's schema (agent/wire/schema.py's
        :data:`REPLICA_SCHEMAS`: the front door's fields, limits and sampling ranges) and
        queue it for the next tick.  A ``prompt`` is tokenized here and ``messages`` rendered
        with the model's chat template first; both stop at the model's end-of-sequence token
        beside the ``stop`` they name (text in, text out), while a ``tokens`` request stops
        only at the ids it names."""
        if self.state is not State.SERVING:
            raise ProtocolError(f"replica is {self.state.value}, not serving", field="state",
                                value=self.state.value, limit=State.SERVING.value)
        validate_request(msg, DEFAULT_LIMITS, REPLICA_SCHEMAS)
        # exactly one of tokens, prompt and messages (the schema's check)
        tokens: list[int] | None = msg.get("tokens")
        prompt: str | None = msg.get("prompt")
        if tokens is None and "messages" in msg:
            prompt = self.text.chat_template().render(msg["messages"])
        stop = msg.get("stop") or []
        stop_ids = {t for t in stop if type(t) is int}
        stop_strs = [t for t in stop if type(t) is str and t]
        text = tokens is None or bool(stop_strs) or msg.get("detokenize") is True
        if tokens is None and isinstance(prompt, str):
            tokens = self.text.tokenizer_for("prompt").encode(prompt).ids
            eos = self.loaded.config.eos_token_id
            if eos is not None and eos >= 0 and msg.get("ignore_eos") is not True:
                stop_ids.add(eos)
        if text and tokens is not None and not stop_strs and not self.text.has_tokenizer():
            text = False   # detokenize is "text too, when the model has a tokenizer"
        if text:
            self.text.tokenizer_for("stop" if stop_strs else "prompt")
        assert tokens is not None   # given, or the prompt's (a prompt or rendered messages)
        max_tokens, seed = msg["max_tokens"], msg.get("seed")   # the schema fills max_tokens
        sampling = _sampling(msg)
        # The context: a slot holds max_seq_len tokens (vLLM's max_model_len).  With
        # fit_context (an OpenAI chat without max_tokens) max_tokens is what the slot leaves,
        # as vLLM's serving_engine.py sets it; either way prompt + max_tokens must fit.
        context = self.loaded.engine.kv.max_seq_len
        if msg.get("fit_context") is True:
            max_tokens = max(1, min(max_tokens, context - len(tokens)))
        if len(tokens) + max_tokens > context:
            raise ContextLengthExceeded(context, len(tokens), max_tokens)
        # The engine checks the rest (token range, KV capacity, sampling ranges) before
        # anything is allocated.
        self.loaded.engine.kv.check(len(tokens) + max_tokens)
        self._check_deadline(msg.get("deadline_ms"), len(tokens))
        request = Request(msg.get("id"), writer, time.perf_counter(), text,
                          prompt_tokens=len(tokens), stops=StopText(stop_strs))
        self.batch.accept(request, {"prompt": tokens, "max_tokens": max_tokens,
                                    "seed": seed, "stop": stop_ids, "sampling": sampling})
        return request

    def _check_deadline(self, deadline_ms: Any, prompt_tokens: int) -> None:
        """Refuse (Overloaded, 429) a request whose ``deadline_ms`` (ms left for its first
        token) the predicted TTFT here exceeds; the answer names both and, as
        ``retry_after_ms``, how far over the prediction is."""
        if deadline_ms is None:   # (its type and range are the schema's)
            return
        predicted_ms = self.predict_ttft_s(prompt_tokens) * 1e3
        if predicted_ms > deadline_ms:
            exc = Overloaded(
                f"replica {self.replica_id}: predicted TTFT {predicted_ms:.1f} ms exceeds "
                f"deadline_ms {deadline_ms:g}", model=self.loaded.identity.name,
                retry_after_ms=max(1, round(predicted_ms - deadline_ms)),
                depth=len(self._submits) + self.loaded.engine.load.waiting_seqs,
                limit=deadline_ms, refusal=refusals.DEADLINE_UNREACHABLE)
            exc.answer = {"predicted_ttft_ms": round(predicted_ms, 3),
                          "deadline_ms": deadline_ms,
                          "retry_after_ms": exc.retry_after_ms}
            raise exc

    def tokenizer(self):
        """The model's tokenizer (:meth:`ModelText.tokenizer`)."""
        return self.text.tokenizer()


def _sampling(msg: dict):
    """The engine's Sampling from a generate's ``temperature``, ``top_p`` and ``top_k``,
    already checked by the wire's schema (types and ranges)."""
    from agent.replica.engine import Sampling

    values = {name: msg[name] for name in ("temperature", "top_p", "top_k")
              if msg.get(name) is not None}
    return Sampling(**values)


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
                warm: str | None = None, device: str = "cpu", shared: bool = True,
                itl_target_s: float | None = None) -> int:
    """The body of ``rewarm replica``: load one way, print the ready line, serve until stopped.

    Exactly one of ``model_dir`` (full boot; ``release`` binds its AOT package, ``compile``
    uses torch.compile), ``snapshot`` (restore into a fresh process) or ``zygote_mode`` (wait
    for a ``restore`` op; ``buffer_bytes`` sizes the restore buffer, ``warm`` names the snapshot
    it will likely restore, whose first-call costs it pays before it is ready; ``shared``: on
    the CPU the buffer is that snapshot's page-cache pages, shared by every replica of it on
    the node, and a zygote without ``warm`` holds none: prepare_zygote).  On a TCP ``listen``
    the control ops (:data:`CONTROL_OPS`) are refused unless ``tcp_control``.  Raises
    ConfigError when not exactly one is given.  SIGTERM drains for ``drain_grace_s``;
    ``metrics_listen`` (HOST:PORT) serves /metrics, /healthz, /readyz (agent/health.py).
    ``device`` ("cpu", "cuda[:N]"): where the model runs; a zygote there holds a CUDA context
    and a device restore buffer (agent/replica/zygote.py ``prepare_zygote``).
    ``itl_target_s``: the step's inter-token-latency target (:class:`Worker`).
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
                                               warm=Path(warm) if warm else None, device=device,
                                               shared=shared)
        if snapshot:
            return zygote.restore(Path(snapshot), release=Path(release) if release else None,
                                  device=device), None
        return zygote.boot(Path(model_dir), release=Path(release) if release else None,
                           compile=compile, device=device), None

    engine_thread = make_engine_thread()
    loaded, buffer = engine_thread.submit(load).result()
    worker = Worker(loaded, buffer=buffer, replica_id=replica_id or f"replica-{os.getpid()}",
                    parent_pid=parent, tcp_control=tcp_control, drain_grace_s=drain_grace_s,
                    engine_thread=engine_thread, itl_target_s=itl_target_s)
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
        if worker.batch.broken is not None:
            return False, f"engine broken: {worker.batch.broken}"
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
