"""Connections of the front door: clients in, replicas out (asyncio Protocols, lean hot path).

Both sides batch their writes: messages are packed once and joined into one
``transport.write`` per event-loop turn.  Neither logs per request.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from typing import TYPE_CHECKING, Any

import msgpack

from agent.errors import ProtocolError
from agent.protocol import Decoder, error_message

if TYPE_CHECKING:  # pragma: no cover
    from agent.frontdoor.server import FrontDoor, Request

_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack


class _Batched(asyncio.Protocol):
    """Shared write batching: :meth:`send` queues bytes; one write per loop turn."""

    transport: asyncio.Transport | None = None

    def __init__(self) -> None:
        self._out: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self.closed = False

    def send(self, data: bytes) -> None:
        if self.closed:
            return
        if not self._out:
            self._loop.call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.closed and out:
            self.transport.write(b"".join(out) if len(out) > 1 else out[0])

    def close_after_flush(self) -> None:
        self._flush()
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class ClientConn(_Batched):
    """One client connection: decodes requests (limits enforced) and hands them to the
    front door; a protocol error is answered, then the connection closes."""

    def __init__(self, fd: "FrontDoor") -> None:
        super().__init__()
        self.fd = fd
        self.decoder = Decoder(fd.config.limits)
        self.last_active_s = fd.clock.now()
        self.frame_start_s: float | None = None  # when the current partial frame began
        self.in_flight = 0
        self.queued: set = set()  # this connection's Pending entries in admission queues
        self.tenant: str | None = None
        self.token: str | None = None  # the last token that checked out

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        _nodelay(transport)
        if not self.fd.accept(self):
            self.send(_packb(error_message(None, 429, "too many connections",
                                           retry_after_ms=1000)))
            self.close_after_flush()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        now = self.fd.clock.now()
        self.last_active_s = now
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as err:
            self.fail(err)
            return
        if not self.decoder.buffered_bytes:
            self.frame_start_s = None
        elif self.frame_start_s is None:
            self.frame_start_s = now
        handle = self.fd.handle
        for message in messages:
            if self.closed:
                return
            handle(self, message)

    def fail(self, err: ProtocolError, request_id: Any = None) -> None:
        """Answer a protocol error and close."""
        self.send(_packb(error_message(request_id, err.code, err.message)))
        self.close_after_flush()

    def pause_writing(self) -> None:   # the client does not read: stop reading it too
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._out.clear()
        self.fd.forget(self)


class ReplicaLink(_Batched):
    """The front door's connection to one replica; requests multiplex over it by id."""

    def __init__(self, fd: "FrontDoor", replica_id: str) -> None:
        super().__init__()
        self.fd = fd
        self.replica_id = replica_id
        self.decoder = Decoder(fd.config.replica_limits)
        self.in_flight: dict[int, "Request"] = {}
        self._ids = itertools.count(1)
        self.ready = False
        self._waiting: list[bytes] = []  # packed before the connection was made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        _nodelay(transport)
        self.ready = True
        for data in self._waiting:
            self.send(data)
        self._waiting.clear()

    def dispatch(self, req: "Request") -> None:
        rid = next(self._ids)
        req.replica_rid = rid
        self.in_flight[rid] = req
        msg = req.message  # forwarded as it came, less what is the front door's own
        msg["id"] = rid
        msg.pop("token", None)
        msg.pop("deadline_ms", None)
        data = _packb(msg)
        if self.ready:
            self.send(data)
        else:
            self._waiting.append(data)

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as err:
            self.fd.replica_failed(self, f"bad answer from replica: {err.message}")
            return
        on_answer = self.fd.on_answer
        for message in messages:
            req = self.in_flight.get(message.get("id"))
            if req is not None:
                on_answer(self, req, message)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:  # closed on purpose (replica gone from the registry, shutdown)
            return
        self.closed = True
        self.fd.replica_failed(self, f"connection to replica lost ({exc or 'closed'})")


packb = _packb
