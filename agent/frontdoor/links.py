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
    front door.

    A request that fails validation is answered by the front door and the connection stays
    open.  A framing error (the byte stream can no longer be trusted), the client's
    half-close, the idle timeout and shutdown all *end* the connection: no more requests are
    read (further input is discarded), every request already in flight is still answered,
    and then it closes gracefully: the answers are flushed, our side is half-closed and
    input is drained for at most ``close_linger_s`` / ``close_linger_bytes`` so that the
    kernel does not reset the connection (and lose the answers) over unread input.
    """

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
        self.ending = False       # read no more requests; close once in_flight is 0
        self._peer_eof = False    # the client half-closed (sends nothing more)
        self._lingering = False   # our side is half-closed; draining input until close
        self._discarded = 0       # input bytes thrown away since ending (or lingering)
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        _nodelay(transport)
        if not self.fd.accept(self):
            self.send(_packb(error_message(None, 429, "too many connections",
                                           retry_after_ms=1000)))
            self.end()

    def data_received(self, data: bytes) -> None:
        if self.ending:
            self._discard(len(data))
            return
        if self.closed:
            return
        now = self.fd.clock.now()
        self.last_active_s = now
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as err:
            # Messages complete before the bad bytes (when the decoder hands them over)
            # are still served; then the connection ends.
            for message in getattr(err, "decoded", None) or ():
                if self.closed:
                    return
                self.fd.handle(self, message)
            self.fail(err)
            return
        if not self.decoder.buffered_bytes:
            self.frame_start_s = None
        elif messages or self.frame_start_s is None:
            # A new partial frame began in this read: its deadline counts from now.
            self.frame_start_s = now
        handle = self.fd.handle
        for message in messages:
            if self.closed:
                return
            handle(self, message)

    def eof_received(self) -> bool:
        """The client half-closed: answer what it sent, then close (a frame cut short by
        the half-close is answered with a 400)."""
        self._peer_eof = True
        if self._lingering:      # it has read our half-close and closed too
            return False
        if not self.ending:
            pending = self.decoder.buffered_bytes
            if pending:
                self.send(_packb(error_message(
                    None, 400, f"truncated frame: the connection was half-closed with "
                    f"{pending} bytes of an incomplete message buffered (a message must "
                    f"be complete before the half-close)")))
            self.end()
        return True              # keep our side open to write the answers

    def fail(self, err: ProtocolError, request_id: Any = None) -> None:
        """Answer a framing error (the stream cannot be trusted past it) and end the
        connection: requests already in flight are still answered, then it closes."""
        self.send(_packb(error_message(request_id, err.code, err.message)))
        self.end()

    def end(self) -> None:
        """Read no more requests; close gracefully once every request in flight is answered."""
        if self.ending:
            return
        self.ending = True
        self.frame_start_s = None
        self._discarded = 0
        if self.in_flight <= 0:
            self._loop.call_soon(self._close_gracefully)

    def finished(self) -> None:
        """One request in flight got its final answer (done or error)."""
        self.in_flight -= 1
        if self.ending and self.in_flight <= 0:
            self._loop.call_soon(self._close_gracefully)  # after this turn's answers

    def _discard(self, n: int) -> None:
        self._discarded += n
        if self._discarded > self.fd.config.close_linger_bytes:
            if self._lingering:
                self._linger_over()
            elif self.transport is not None and not self.closed:
                self.transport.pause_reading()  # answers still due: stop taking input

    def _close_gracefully(self) -> None:
        if self.closed or self._lingering or self.transport is None:
            return
        self._flush()
        transport, linger_s = self.transport, self.fd.config.close_linger_s
        if self._peer_eof:       # nothing more will arrive: a plain close sends FIN
            self.closed = True
            transport.close()
            self._linger = self._loop.call_later(linger_s, transport.abort)  # peer not reading
            return
        self.closed = True       # nothing more is sent
        self._lingering = True
        self._discarded = 0
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()
        self._linger = self._loop.call_later(linger_s, self._linger_over)

    def _linger_over(self) -> None:
        """Drained long enough (or enough bytes): close; abort if the answers are still
        unsent after ``close_linger_s`` (a peer that does not read)."""
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size():
            transport.abort()
        else:
            transport.close()

    def pause_writing(self) -> None:   # the client does not read: stop reading it too
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._out.clear()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
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
