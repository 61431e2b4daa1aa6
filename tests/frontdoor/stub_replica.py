"""A stand-in replica for front-door tests: answers ``generate`` at once over the protocol.

Each request gets one ``tokens`` message (``max_tokens`` ids counting up from the prompt's
length) and a ``done``.  ``hold`` keeps answers back until :meth:`release`; ``fail_with``
answers every request with that error code instead; ``crash`` hangs up on the first request.
"""

from __future__ import annotations

import asyncio

from agent.cluster.base import ServiceInstance
from agent.protocol import Decoder, error_message, pack


class StubReplica:
    def __init__(self, model: str = "m", replica_id: str = "r1", *, max_seqs: int = 64,
                 kv_capacity_tokens: int = 1 << 20, hold: bool = False,
                 fail_with: int | None = None, crash: bool = False) -> None:
        self.model, self.replica_id = model, replica_id
        self.max_seqs, self.kv_capacity_tokens = max_seqs, kv_capacity_tokens
        self.hold, self.fail_with, self.crash = hold, fail_with, crash
        self.received: list[dict] = []
        self._held: list[tuple[asyncio.Transport, bytes]] = []
        self._server = None

    async def start(self) -> "StubReplica":
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Conn(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def instance(self, active_seqs: int = 0, kv_used_tokens: int = 0) -> ServiceInstance:
        return ServiceInstance("rewarm-replica", self.replica_id, "127.0.0.1", self.port,
                               tags=[f"model={self.model}"],
                               meta={"max_seqs": str(self.max_seqs),
                                     "active_seqs": str(active_seqs),
                                     "kv_capacity_tokens": str(self.kv_capacity_tokens),
                                     "kv_used_tokens": str(kv_used_tokens)})

    def answer(self, msg: dict) -> bytes:
        rid = msg["id"]
        if self.fail_with is not None:
            return pack(error_message(rid, self.fail_with, "stub refuses"))
        n0 = len(msg.get("tokens") or [])
        toks = list(range(n0, n0 + msg["max_tokens"]))
        return (pack({"id": rid, "type": "tokens", "tokens": toks})
                + pack({"id": rid, "type": "done", "ttft_ms": 0.0, "total_ms": 0.0,
                        "path": "warm_hit", "replica": self.replica_id, "n_tokens": len(toks)}))

    def release(self) -> None:
        held, self._held = self._held, []
        for transport, data in held:
            transport.write(data)

    async def stop(self) -> None:
        self._server.close()


class _Conn(asyncio.Protocol):
    def __init__(self, stub: StubReplica) -> None:
        self.stub, self.decoder = stub, Decoder()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.stub.crash:
            self.transport.abort()
            return
        out = []
        for msg in self.decoder.feed(data):
            self.stub.received.append(msg)
            out.append(self.stub.answer(msg))
        if self.stub.hold:
            self.stub._held.append((self.transport, b"".join(out)))
        else:
            self.transport.write(b"".join(out))
