"""A simulated replica at the protocol level: what the front door's link talks to.

:class:`SimWorker` behaves like agent/replica/worker.py's ``Worker`` as the front door sees
it, on a virtual-time loop (agent/sim/vloop.py):

- the front door's :class:`~agent.frontdoor.links.ReplicaLink` is connected to a
  :class:`SimTransport`, whose ``write`` decodes the msgpack frames (agent/protocol.py's
  ``Decoder``) and hands each message to the worker; the worker answers through
  ``link.data_received(pack(...))``, so the link's own decoding and dispatch run;
- ``generate`` is checked against its ``deadline_ms`` with the replica's own rule
  (``Worker._check_deadline``, called on this worker: the prediction it compares is
  :meth:`SimReplica.predict_ttft_s`, agent/speed.py's model on the replica's queue, as
  ``Engine.predict_ttft_s``), refused with 429 (``predicted_ttft_ms``, ``retry_after_ms``),
  else queued at the :class:`~agent.sim.replica.SimReplica` engine: steps back to back while
  it has work (the engine's step: prefill calls within the step's token budget, then one
  decode step over the batch), the first ``tokens`` message when the call that ends its
  prefill ends, one ``tokens`` message per decode step
  for every sequence still running (as the worker streams them: the front door's stream
  watch judges a replica by them) and ``done`` when its last token is decoded;
- ``cancel`` forgets a request (its answers are dropped; the engine finishes the sequence);
- draining: ``generate`` answered 503 with ``retry_after_ms``, as the worker does;
- :meth:`stats` is the load report the node agent copies into the registry meta
  (``LOAD_META_KEYS``, ``QUEUE_META_KEYS``, ``SPEED_META_KEYS``).
"""

from __future__ import annotations

import asyncio
from typing import Any
from collections.abc import Callable

from agent.errors import Overloaded, ProtocolError, RewarmError
from agent.protocol import Decoder, error_message, pack
from agent.replica.worker import Worker
from agent.sim.replica import SimReplica
from agent.speed import SpeedProfile
from agent.throughput import BacklogMeter


class SimTransport(asyncio.Transport):
    """The link's transport: bytes written go to ``worker.receive`` as decoded messages."""

    def __init__(self, worker: SimWorker) -> None:
        super().__init__()
        self.worker = worker
        self.decoder = Decoder()
        self.closed = False
        self.link: Any = None    # the front door's ReplicaLink, set by SimWorker.connect

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed:
            return
        for message in self.decoder.feed(bytes(data)):
            self.worker.receive(self, message)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class _Identity:
    def __init__(self, name: str) -> None:
        self.name = name


class _Loaded:
    """What ``Worker._check_deadline`` reads of ``self.loaded``: the model's name and the
    engine's waiting sequences (here: none outside the engine's queue)."""

    class _Load:
        waiting_seqs = 0

    class _Engine:
        load: Any

    def __init__(self, model: str) -> None:
        self.identity = _Identity(model)
        self.engine = self._Engine()
        self.engine.load = self._Load()


class SimWorker:
    """One simulated replica (module docstring): it serves at ``speed`` and plans, reports
    and predicts with ``reported`` (default ``speed``) at the step target ``itl_target_s``
    (:class:`SimReplica`'s: 0 whole prompts, None the profile's own or the live engine's
    default).  ``on_idle`` is called when a drained replica has nothing left in flight."""

    def __init__(self, replica_id: str, model: str, speed: SpeedProfile, *, max_seqs: int,
                 max_seq_len: int, reported: SpeedProfile | None = None,
                 itl_target_s: float | None = None) -> None:
        self.replica_id, self.model = replica_id, model
        self.engine = SimReplica(speed, max_seqs, reported, itl_target_s=itl_target_s,
                                 max_seq_len=max_seq_len)
        self.max_seq_len = max_seq_len
        self.loaded = _Loaded(model)
        self._submits: list = []          # Worker._check_deadline reads its length
        self.links: list = []
        self._requests: dict[int, tuple[Any, Any, int, int]] = {}  # key -> (link, id, prompt, max)
        self._keys = iter(range(1, 1 << 62))
        self._by_rid: dict[tuple[int, Any], int] = {}
        self.draining = False
        self.stopped = False
        self.on_idle: Callable[[], None] | None = None
        self.served = self.refused = 0
        # what it sustains while backlogged, measured as the live replica's batch loop does
        self.backlog = BacklogMeter(clock=lambda: asyncio.get_running_loop().time())

    # --- the connection -------------------------------------------------------------------
    async def connect(self, link) -> None:
        """Connect ``link`` (a :class:`~agent.frontdoor.links.ReplicaLink`) to this worker."""
        if self.stopped:
            raise ConnectionRefusedError(f"replica {self.replica_id} is stopped")
        transport = SimTransport(self)
        transport.link = link
        self.links.append(transport)
        link.connection_made(transport)

    def _send(self, transport: SimTransport, message: dict) -> None:
        if not transport.closed:
            transport.link.data_received(pack(message))

    def receive(self, transport: SimTransport, message: dict) -> None:
        """One message from the front door over ``transport`` (:meth:`SimTransport.write`)."""
        op, rid = message.get("op"), message.get("id")
        if op == "generate":
            self._generate(transport, rid, message)
        elif op == "cancel":
            key = self._by_rid.pop((id(transport), rid), None)
            if key is not None:
                self._requests.pop(key, None)

    def _generate(self, transport: SimTransport, rid: Any, message: dict) -> None:
        if self.draining or self.stopped:
            self._send(transport, error_message(rid, 503, "replica draining: it stops after "
                                                "its requests in flight", retry_after_ms=1000))
            return
        tokens = message.get("tokens") or []
        prompt = len(tokens)
        max_tokens = int(message.get("max_tokens", 1))
        try:
            if prompt + max_tokens > self.max_seq_len:
                raise ProtocolError(f"prompt {prompt} + max_tokens {max_tokens} exceeds "
                                    f"max_seq_len {self.max_seq_len}", field="max_tokens",
                                    value=prompt + max_tokens, limit=self.max_seq_len)
            Worker._check_deadline(self, message.get("deadline_ms"), prompt)  # type: ignore[arg-type]  # the replica's own check, over the same attributes
        except Overloaded as exc:
            self.refused += 1
            self._send(transport, error_message(rid, exc.code, exc.message, **exc.answer))
            return
        except RewarmError as exc:
            self._send(transport, error_message(rid, exc.code, exc.message))
            return
        key = next(self._keys)
        self._requests[key] = (transport, rid, prompt, max_tokens)
        self._by_rid[(id(transport), rid)] = key
        self.engine.submit(key, prompt, max_tokens)
        if not self.engine.stepping:
            self._step()

    def predict_ttft_s(self, prompt_tokens: int) -> float:
        """What ``Worker.predict_ttft_s`` gives (``Worker._check_deadline`` calls it)."""
        return self.engine.predict_ttft_s(prompt_tokens)

    # --- the engine's steps on the loop ----------------------------------------------------
    def _step(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        firsts, end_s = self.engine.start_step(now)
        for req, first_s in firsts:     # each when its own prefill ends, as the worker sends it
            loop.call_at(first_s, self._first_tokens, [req])
        loop.call_at(end_s, self._step_end, self.engine.generation)

    def _first_tokens(self, keys: list[int]) -> None:
        for key in keys:
            entry = self._requests.get(key)
            if entry is not None:
                transport, rid, prompt, _ = entry
                self._send(transport, {"id": rid, "type": "tokens", "tokens": [1],
                                       "prompt_tokens": prompt})

    def _step_end(self, generation: int) -> None:
        if generation != self.engine.generation or not self.engine.stepping:
            return
        batch = self.engine.slots_held + len(self.engine._ending)
        departed = []
        for key in self.engine.end_step():
            entry = self._requests.pop(key, None)
            if entry is None:
                continue
            transport, rid, prompt, max_tokens = entry
            departed.append((prompt, max_tokens))
            self._by_rid.pop((id(transport), rid), None)
            self.served += 1
            self._send(transport, {"id": rid, "type": "done", "n_tokens": max_tokens,
                                   "prompt_tokens": prompt, "finish_reason": "length"})
        for seq in self.engine._active:    # decoded a token this step: the stream moves on
            entry = self._requests.get(seq[0])
            if entry is not None:
                self._send(entry[0], {"id": entry[1], "type": "tokens", "tokens": [1]})
        self.backlog.tick(departed, backlog=bool(self.engine._waiting), batch=batch)
        if self.engine.busy:
            self._step()
        else:
            self.backlog.idle()
            if self.draining and self.on_idle is not None:
                self.on_idle()

    # --- what the node agent reads -----------------------------------------------------------
    def in_flight(self) -> int:
        """Sequences queued or running (the node agent's drain waits for 0)."""
        return len(self.engine._waiting) + len(self.engine._active) + len(self.engine._ending)

    def stats(self) -> dict[str, Any]:
        """The ``stats`` keys the node agent puts in the registry meta: slots and KV
        (tokens), the queue, the speed (agent/speed.py's keys) and, once measured, what it
        sustained while backlogged (agent/throughput.py's keys)."""
        eng = self.engine
        report = eng.report()
        used = sum(w.prompt + w.output for w in eng._waiting) \
            + sum(s[2] + s[1] for s in eng._active)
        report.update(kv_capacity_tokens=eng.max_seqs * self.max_seq_len, kv_used_tokens=used,
                      max_seq_len=self.max_seq_len)
        sustained = self.backlog.capacity()
        if sustained is not None:
            report.update(sustained.to_meta())
        return report

    def stop(self) -> None:
        """The process ends: links see the connection lost."""
        self.stopped = True
        self.engine.reset()
        for transport in self.links:
            if not transport.closed:
                transport.closed = True
                transport.link.connection_lost(None)
        self.links.clear()
