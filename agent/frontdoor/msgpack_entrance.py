"""The msgpack/TCP entrance: client connections, framing and connection limits.

A thin adapter over :class:`~agent.frontdoor.request_path.RequestPath`: each decoded
``generate`` is validated (agent/protocol.py), authenticated, turned into a
:class:`~agent.frontdoor.request_path.GenerateRequest` and submitted with a
:class:`MsgpackSink` that packs the answers back onto the connection with the client's id.
A connection that goes away cancels its requests (queued ones leave their queues,
dispatched ones are cancelled at the replica).

Slots are shared fairly (:meth:`MsgpackEntrance.accept`): one remote address holds at most
``max_connections_per_peer``; ``component_reserve`` of ``max_connections`` are kept for
the node's own components (``component_peers``: the predictor reads the door's stats over
it, so a flood of clients must not lock it out); a connection with no request in flight is
closed after ``idle_timeout_s`` without a byte, and a frame begun on one must be complete
within ``idle_frame_deadline_s`` (a client dripping a byte at a time cannot hold a slot for
``frame_deadline_s``); TCP keepalive is tuned so that a vanished peer's slot is freed in
about ``keepalive_idle_s + keepalive_interval_s * keepalive_count`` seconds.  ``health``, ``models`` and ``stats`` are
answered from the request path's view.
"""

from __future__ import annotations

import asyncio
from typing import Any

from agent.clock import Clock
from agent.errors import ProtocolError, Unauthorized
from agent.frontdoor.auth import TokenAuth
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.links import Batched, nodelay, packb
from agent.frontdoor.listener import Listener, tune_keepalive
from agent.frontdoor.request import Flight, GenerateRequest
from agent.frontdoor.request_path import RequestPath
from agent.protocol import PROTOCOL_VERSION, Decoder, error_message, reply_id, validate_request
from agent.wire import refusals


class MsgpackSink:
    """A request's answers as msgpack maps on its connection, with the client's id."""

    __slots__ = ("conn", "rid", "flight")

    def __init__(self, conn: ClientConn, rid: Any) -> None:
        self.conn, self.rid = conn, rid
        self.flight: Flight | None = None

    def tokens(self, message: dict) -> None:
        message["id"] = self.rid
        self.conn.send(packb(message))

    def done(self, message: dict) -> None:
        message["id"] = self.rid
        self.conn.send(packb(message))
        self.conn.finished(self)

    def error(self, code: int, reason: str, retry_after_ms: int | None = None,
              refusal: str | None = None) -> None:
        msg = error_message(self.rid, code, reason, refusal=refusal)
        if retry_after_ms is not None:
            msg["retry_after_ms"] = retry_after_ms
        self.conn.send(packb(msg))
        self.conn.finished(self)


class MsgpackEntrance:
    """The msgpack door: its connections and what it does with each decoded message."""

    def __init__(self, path: RequestPath, config: FrontDoorConfig, *, clock: Clock,
                 auth: TokenAuth) -> None:
        self.path, self.config, self.clock, self.auth = path, config, clock, auth
        self.conns: set[ClientConn] = set()
        self.per_peer: dict[str, int] = {}   # accepted connections per remote address
        self.refused_per_peer = 0            # connections refused by the per-peer cap
        self._listener: Listener | None = None
        self._starting = 0  # accepted sockets whose connection is being set up

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        """Start listening (:class:`~agent.frontdoor.listener.Listener`: a connection past
        the cap, or at the descriptor limit, is answered 429 and closed); returns the bound
        ``(host, port)``."""
        self._listener = Listener(
            host, port, max_connections=self.config.max_connections,
            reserve=self.config.fd_reserve, clock=self.clock,
            refusal=packb(error_message(None, 429, "too many connections: the front door is "
                                        "at its descriptor limit", retry_after_ms=1000,
                                        refusal=refusals.FD_RESERVE)),
            on_socket=self._on_socket, in_use=self._in_use,
            log_interval_s=self.config.accept_log_interval_s)
        return self._listener.start()

    def _in_use(self) -> int:
        """Descriptors counted against the connection cap: client connections (and those
        being set up) and replica links."""
        return len(self.conns) + self._starting + len(self.path.links)

    def _on_socket(self, sock, over_cap: bool) -> None:
        self._starting += 1

        async def start() -> None:
            try:
                await asyncio.get_running_loop().connect_accepted_socket(
                    lambda: ClientConn(self, over_cap), sock)
            except OSError:
                sock.close()
            finally:
                self._starting -= 1
        asyncio.get_running_loop().create_task(start())

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise RuntimeError("msgpack entrance used before start()")
        return self._listener.address

    def close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    # --- connections -----------------------------------------------------------------

    def accept(self, conn: ClientConn, over_cap: bool = False) -> str | None:
        """Take ``conn`` into the set; else the reason it is refused (it is answered 429):
        past the descriptor cap (``over_cap``) or ``max_connections``; a peer that is not
        a component past ``max_connections - component_reserve`` or past
        ``max_connections_per_peer`` of its own."""
        cfg = self.config
        if over_cap or len(self.conns) >= cfg.max_connections:
            return "too many connections"
        peer = conn.peer
        if peer not in cfg.component_peers:
            if len(self.conns) >= cfg.max_connections - cfg.reserved_slots:
                return (f"too many connections: the last {cfg.reserved_slots} of "
                        f"max_connections({cfg.max_connections}) are kept for the node's own "
                        f"components")
            if self.per_peer.get(peer, 0) >= cfg.max_connections_per_peer:
                self.refused_per_peer += 1
                return (f"too many connections from {peer}: max_connections_per_peer"
                        f"({cfg.max_connections_per_peer})")
        self.conns.add(conn)
        self.per_peer[peer] = self.per_peer.get(peer, 0) + 1
        conn.accepted = True
        return None

    def forget(self, conn: ClientConn) -> None:
        """The connection closed: its requests are cancelled (no one to answer)."""
        self.conns.discard(conn)
        if conn.accepted:
            conn.accepted = False
            left = self.per_peer.get(conn.peer, 1) - 1
            if left > 0:
                self.per_peer[conn.peer] = left
            else:
                self.per_peer.pop(conn.peer, None)
        sinks, conn.sinks = list(conn.sinks), set()
        for sink in sinks:
            if sink.flight is not None:
                sink.flight.cancel()

    def sweep(self) -> None:
        """Close idle connections and cut off frames that take too long to arrive."""
        if self._listener is not None:
            self._listener.tick()
        cfg = self.config
        now = self.clock.now()
        for conn in list(self.conns):
            # with nothing in flight a slow frame holds a slot for nothing: the shorter bound
            name, bound = ("frame_deadline_s", cfg.frame_deadline_s)
            if not conn.sinks and cfg.idle_frame_deadline_s < bound:
                name, bound = "idle_frame_deadline_s", cfg.idle_frame_deadline_s
            if conn.frame_start_s is not None and now - conn.frame_start_s > bound:
                conn.fail(ProtocolError(
                    f"frame not complete within {name}({bound})",
                    field="frame", value=now - conn.frame_start_s, limit=bound))
            elif not conn.sinks and now - conn.last_active_s > cfg.idle_timeout_s:
                conn.end()

    async def close_all(self) -> None:
        """End every connection gracefully (answers flushed first; at most
        ``close_linger_s`` more), then drop what is left."""
        for conn in list(self.conns):
            conn.end()
        loop = asyncio.get_running_loop()
        closing_until = loop.time() + self.config.close_linger_s + 0.1
        while self.conns and loop.time() < closing_until:
            await asyncio.sleep(0.01)
        for conn in list(self.conns):  # past every bound: drop what is left
            if conn.transport is not None:
                conn.transport.abort()

    # --- requests --------------------------------------------------------------------

    def handle(self, conn: ClientConn, message: dict) -> None:
        """One decoded message from a client."""
        try:
            validate_request(message, self.config.limits)
        except ProtocolError as err:
            # One well-framed message that is wrong: answer it alone; the connection and
            # the requests in flight on it carry on.
            rid = reply_id(message.get("id"), self.config.limits)
            model = message.get("model")
            # validate_request's reasons name the value and the limit themselves
            self._refuse(conn, rid, model if type(model) is str else "", err.code, err.message)
            return
        rid = message["id"]
        if self.auth.enabled:
            token = message.get("token")
            if token is None or token != conn.token:
                try:
                    conn.tenant = self.auth.check(token)
                    conn.token = token
                except Unauthorized as err:
                    self._refuse(conn, rid, message.get("model", ""), err.code, err.message)
                    return
        op = message["op"]
        if op == "generate":
            sink = MsgpackSink(conn, rid)
            conn.sinks.add(sink)
            flight = self.path.submit(GenerateRequest.from_message(message, conn.tenant), sink)
            if not flight.over:
                sink.flight = flight
        else:
            conn.send(packb({"v": PROTOCOL_VERSION, "id": rid, "type": "result",
                             "result": self.path.info(op, len(self.conns))}))

    def _refuse(self, conn: ClientConn, rid: Any, model: str, code: int, reason: str) -> None:
        self.path.refused(rid, model, code)
        conn.send(packb(error_message(rid, code, reason)))


class ClientConn(Batched):
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

    def __init__(self, door: MsgpackEntrance, over_cap: bool = False) -> None:
        super().__init__()
        self.door = door
        self.over_cap = over_cap
        self.decoder = Decoder(door.config.limits)
        self.last_active_s = door.clock.now()
        self.frame_start_s: float | None = None  # when the current partial frame began
        self.sinks: set[MsgpackSink] = set()  # requests not yet finally answered
        self.tenant: str | None = None
        self.token: str | None = None  # the last token that checked out
        self.ending = False       # read no more requests; close once in_flight is 0
        self._peer_eof = False    # the client half-closed (sends nothing more)
        self._lingering = False   # our side is half-closed; draining input until close
        self._discarded = 0       # input bytes thrown away since ending (or lingering)
        self._linger: asyncio.TimerHandle | None = None
        self.peer = ""            # the remote address (no port): the per-peer cap's key
        self.accepted = False     # counted in the door's set and per-peer counts

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        nodelay(transport)
        cfg = self.door.config
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_keepalive(sock, idle_s=cfg.keepalive_idle_s,
                           interval_s=cfg.keepalive_interval_s, count=cfg.keepalive_count)
        peername = transport.get_extra_info("peername")
        self.peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        refused = self.door.accept(self, self.over_cap)
        if refused is not None:
            code = refusals.FD_RESERVE if self.over_cap else refusals.MAX_CONNECTIONS
            self.send(packb(error_message(None, 429, refused, retry_after_ms=1000,
                                          refusal=code)))
            self.end()

    def data_received(self, data: bytes) -> None:
        if self.ending:
            self._discard(len(data))
            return
        if self.closed:
            return
        now = self.door.clock.now()
        self.last_active_s = now
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as err:
            # Messages complete before the bad bytes (when the decoder hands them over)
            # are still served; then the connection ends.
            for message in getattr(err, "decoded", None) or ():
                if self.closed:
                    return
                self.door.handle(self, message)
            self.fail(err)
            return
        if not self.decoder.buffered_bytes:
            self.frame_start_s = None
        elif messages or self.frame_start_s is None:
            # A new partial frame began in this read: its deadline counts from now.
            self.frame_start_s = now
        handle = self.door.handle
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
                self.send(packb(error_message(
                    None, 400, f"truncated frame: the connection was half-closed with "
                    f"{pending} bytes of an incomplete message buffered (a message must "
                    f"be complete before the half-close)")))
            self.end()
        return True              # keep our side open to write the answers

    def fail(self, err: ProtocolError, request_id: Any = None) -> None:
        """Answer a framing error (the stream cannot be trusted past it) and end the
        connection: requests already in flight are still answered, then it closes."""
        self.send(packb(error_message(request_id, err.code, err.message)))
        self.end()

    def end(self) -> None:
        """Read no more requests; close gracefully once every request in flight is answered."""
        if self.ending:
            return
        self.ending = True
        self.frame_start_s = None
        self._discarded = 0
        if not self.sinks:
            self._loop.call_soon(self._close_gracefully)

    @property
    def in_flight(self) -> int:
        """Requests on this connection not yet finally answered (queued or dispatched)."""
        return len(self.sinks)

    def finished(self, sink: MsgpackSink) -> None:
        """One request in flight got its final answer (done or error)."""
        self.sinks.discard(sink)
        sink.flight = None   # the flight holds the sink: no cycle left for the collector
        if self.ending and not self.sinks:
            self._loop.call_soon(self._close_gracefully)  # after this turn's answers

    def _discard(self, n: int) -> None:
        self._discarded += n
        if self._discarded > self.door.config.close_linger_bytes:
            if self._lingering:
                self._linger_over()
            elif self.transport is not None and not self.closed:
                self.transport.pause_reading()  # answers still due: stop taking input

    def _close_gracefully(self) -> None:
        if self.closed or self._lingering or self.transport is None:
            return
        self._flush()
        transport, linger_s = self.transport, self.door.config.close_linger_s
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
        self.door.forget(self)
