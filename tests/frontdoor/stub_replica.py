"""A stand-in replica for front-door tests: answers ``generate`` over the protocol.

Each request gets one ``tokens`` message (``max_tokens`` ids counting up from the prompt's
length) and a ``done``.  ``hold`` keeps answers back until :meth:`release`; ``fail_with``
answers every request with that error code instead; ``refuse`` answers the first ``refuse``
requests 429 as a replica does when it predicts it cannot start one within its
``deadline_ms`` (docs/architecture.md, "The replica's refusal": ``predicted_ttft_ms``, ``deadline_ms``,
``retry_after_ms``); ``crash`` hangs up on the first request.

The stub reports its ``speed`` (agent/speed.py; :data:`INSTANT`, the speed of answering at
once, unless given; ``speed=None``: no profile, as a replica that has not measured itself) in
its registry meta with its queue (docs/architecture.md, "Replica load reports").  ``paced``: answer at that speed — the
first token after the TTFT the profile predicts for its queue at arrival, ``done`` after
``max_tokens`` decode steps more (event-loop timers; tests never assert on wall time).
``cancel`` ops are honoured (the answer is dropped).
"""

from __future__ import annotations

import asyncio

from agent.cluster.base import ServiceInstance
from agent.protocol import Decoder, error_message, pack
from agent.speed import SpeedProfile

INSTANT = SpeedProfile(prefill_tokens_per_s=1e6, prefill_overhead_s=1e-4, decode_base_s=1e-4,
                       decode_per_seq_s=1e-6, decode_per_ctx_token_s=0.0)
"""About how fast an unpaced stub answers (loopback, no model)."""
_DEFAULT = object()


class StubReplica:
    def __init__(self, model: str = "m", replica_id: str = "r1", *, max_seqs: int = 64,
                 kv_capacity_tokens: int = 1 << 20, hold: bool = False,
                 fail_with: int | None = None, crash: bool = False, refuse: int = 0,
                 speed: SpeedProfile | None | object = _DEFAULT, paced: bool = False) -> None:
        self.model, self.replica_id = model, replica_id
        self.max_seqs, self.kv_capacity_tokens = max_seqs, kv_capacity_tokens
        self.hold, self.fail_with, self.crash = hold, fail_with, crash
        self.refuse, self.paced = refuse, paced
        self.speed: SpeedProfile | None = INSTANT if speed is _DEFAULT else speed  # type: ignore[assignment]
        self.received: list[dict] = []
        self.cancelled: list[int] = []
        self.probes = 0          # health probes answered
        self._held: list[tuple[asyncio.Transport, bytes]] = []
        self._server = None
        self.active = 0          # sequences admitted and not done (paced mode)
        self.waiting_tokens = 0  # prompt tokens not yet prefilled (paced mode)

    async def start(self) -> StubReplica:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Conn(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def instance(self, active_seqs: int = 0, kv_used_tokens: int = 0) -> ServiceInstance:
        meta = {"max_seqs": str(self.max_seqs), "active_seqs": str(active_seqs),
                "kv_capacity_tokens": str(self.kv_capacity_tokens),
                "kv_used_tokens": str(kv_used_tokens)}
        if self.speed is not None:
            meta.update(self.speed.to_meta())
            meta.update(waiting_seqs="0", queued_prefill_tokens=str(self.waiting_tokens),
                        active_ctx_tokens="0")
        return ServiceInstance("rewarm-replica", self.replica_id, "127.0.0.1", self.port,
                               tags=[f"model={self.model}"], meta=meta)

    def answer(self, msg: dict) -> bytes:
        rid = msg["id"]
        if self.fail_with is not None:
            return pack(error_message(rid, self.fail_with, "stub refuses"))
        if self.refuse > 0:
            self.refuse -= 1
            deadline = msg.get("deadline_ms", 0.0)
            return pack(error_message(
                rid, 429, f"replica {self.replica_id}: predicted TTFT exceeds deadline_ms",
                predicted_ttft_ms=float(deadline) + 1000.0, deadline_ms=deadline,
                retry_after_ms=1000))
        return self.tokens(msg) + self.done(msg)

    def tokens(self, msg: dict) -> bytes:
        n0 = len(msg.get("tokens") or [])
        return pack({"id": msg["id"], "type": "tokens",
                     "tokens": list(range(n0, n0 + msg["max_tokens"]))})

    def done(self, msg: dict) -> bytes:
        return pack({"id": msg["id"], "type": "done", "ttft_ms": 0.0, "total_ms": 0.0,
                     "path": "warm_hit", "replica": self.replica_id,
                     "n_tokens": msg["max_tokens"]})

    def release(self) -> None:
        held, self._held = self._held, []
        for transport, data in held:
            transport.write(data)

    async def stop(self) -> None:
        self._server.close()


class _Conn(asyncio.Protocol):
    def __init__(self, stub: StubReplica) -> None:
        self.stub, self.decoder = stub, Decoder()
        self.cancelled: set = set()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        stub = self.stub
        if stub.crash:
            self.transport.abort()
            return
        out = []
        for msg in self.decoder.feed(data):
            if msg.get("op") == "cancel":
                stub.cancelled.append(msg["id"])
                self.cancelled.add(msg["id"])
                continue
            if msg.get("op") == "health":   # the event loop answers while the engine holds
                stub.probes += 1
                out.append(pack({"id": msg["id"], "type": "result",
                                 "result": {"ok": True, "state": "serving"}}))
                continue
            stub.received.append(msg)
            if stub.paced and stub.fail_with is None and stub.refuse <= 0:
                self._paced(msg)
                continue
            out.append(stub.answer(msg))
        if stub.hold:
            stub._held.append((self.transport, b"".join(out)))
        elif out:
            self.transport.write(b"".join(out))

    def _paced(self, msg: dict) -> None:
        """Answer at the stub's speed (module docstring)."""
        stub, loop = self.stub, asyncio.get_running_loop()
        prompt = len(msg.get("tokens") or []) or len(msg.get("prompt", "")) // 3 + 1
        ttft_s = stub.speed.predict_ttft_s(prompt, active_seqs=stub.active,
                                           queued_prefill_tokens=stub.waiting_tokens)
        step_s = stub.speed.decode_step_s(stub.active + 1)
        stub.active += 1
        stub.waiting_tokens += prompt

        def first() -> None:
            stub.waiting_tokens -= prompt
            if msg["id"] not in self.cancelled and not self.transport.is_closing():
                self.transport.write(stub.tokens(msg))

        def end() -> None:
            stub.active -= 1
            if msg["id"] not in self.cancelled and not self.transport.is_closing():
                self.transport.write(stub.done(msg))
        loop.call_later(ttft_s, first)
        loop.call_later(ttft_s + msg["max_tokens"] * step_s, end)
