"""A stand-in replica that answers with text, as a replica with a tokenizer does.

Each ``generate`` gets ``max_tokens`` ``tokens`` messages whose ``text`` is ``"w<k> "`` with
k = seed + i (seed 0 when absent), then a ``done`` with the whole ``text``, ``n_tokens``,
``prompt_tokens`` (4 characters per token of a text prompt) and ``finish_reason``.  A stop
string cuts the text before it (``finish_reason: stop``), as docs/protocol.md says.
``hold``: nothing is sent until :meth:`step` sends one token to every held request.
``cancel`` ops are recorded in ``cancelled``; ``fail_with`` answers every generate with that
error code.
"""

from __future__ import annotations

import asyncio

from agent.cluster.base import ServiceInstance
from agent.protocol import Decoder, pack


class TextStub:
    def __init__(self, model: str = "m", replica_id: str = "t1", *, hold: bool = False,
                 max_seqs: int = 64, kv_capacity_tokens: int = 1 << 20,
                 fail_with: int | None = None) -> None:
        self.model, self.replica_id, self.hold = model, replica_id, hold
        self.fail_with = fail_with  # answer every generate with this error code
        self.max_seqs, self.kv_capacity_tokens = max_seqs, kv_capacity_tokens
        self.received: list[dict] = []
        self.cancelled: list = []
        self.held: dict = {}     # (conn, id) -> [message, tokens sent]
        self._server = None

    async def start(self) -> TextStub:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Conn(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def instance(self) -> ServiceInstance:
        return ServiceInstance("rewarm-replica", self.replica_id, "127.0.0.1", self.port,
                               tags=[f"model={self.model}"],
                               meta={"max_seqs": str(self.max_seqs), "active_seqs": "0",
                                     "kv_capacity_tokens": str(self.kv_capacity_tokens),
                                     "kv_used_tokens": "0"})

    @staticmethod
    def pieces(msg: dict) -> tuple[list[str], str]:
        """The text pieces a request gets and its finish reason."""
        seed = msg.get("seed") or 0
        words = [f"w{seed + i} " for i in range(msg.get("max_tokens", 16))]
        stops = [s for s in msg.get("stop") or () if isinstance(s, str)]
        text = "".join(words)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut < 0:
            return words, "length"
        out, used = [], 0
        for w in words:
            if used + len(w) > cut:
                out.append(w[:cut - used])
                break
            out.append(w)
            used += len(w)
        return out, "stop"

    def done(self, msg: dict, pieces: list[str], finish: str) -> bytes:
        prompt = msg.get("tokens") or msg.get("prompt") or msg.get("messages") or ""
        n_prompt = len(prompt) if "tokens" in msg else max(1, len(str(prompt)) // 4)
        return pack({"id": msg["id"], "type": "done", "ttft_ms": 0.0, "total_ms": 0.0,
                     "path": "warm_hit", "replica": self.replica_id, "n_tokens": len(pieces),
                     "prompt_tokens": n_prompt, "finish_reason": finish,
                     "text": "".join(pieces)})

    def step(self) -> None:
        """Send one more token to every held request (its done after the last)."""
        for key, entry in list(self.held.items()):
            conn, msg, sent = entry
            pieces, finish = self.pieces(msg)
            out = pack({"id": msg["id"], "type": "tokens", "tokens": [sent],
                        "text": pieces[sent]})
            entry[2] = sent = sent + 1
            if sent == len(pieces):
                out += self.done(msg, pieces, finish)
                del self.held[key]
            conn.transport.write(out)

    async def stop(self) -> None:
        self._server.close()


class _Conn(asyncio.Protocol):
    def __init__(self, stub: TextStub) -> None:
        self.stub, self.decoder = stub, Decoder()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        for key in [k for k in self.stub.held if k[0] is self]:
            del self.stub.held[key]

    def data_received(self, data: bytes) -> None:
        stub, out = self.stub, []
        for msg in self.decoder.feed(data):
            stub.received.append(msg)
            if msg.get("op") == "cancel":
                stub.cancelled.append(msg["id"])
                stub.held.pop((self, msg["id"]), None)
                continue
            if stub.fail_with is not None:
                out.append(pack({"id": msg["id"], "type": "error", "code": stub.fail_with,
                                 "reason": f"stub answers {stub.fail_with}"}))
                continue
            if stub.hold:
                stub.held[(self, msg["id"])] = [self, msg, 0]
                continue
            pieces, finish = stub.pieces(msg)
            for i, p in enumerate(pieces):
                tok = {"id": msg["id"], "type": "tokens", "tokens": [i], "text": p}
                if i == 0:
                    tok["prompt_tokens"] = 1
                out.append(pack(tok))
            out.append(stub.done(msg, pieces, finish))
        if out:
            self.transport.write(b"".join(out))
