"""Write batching shared by both sides of the front door, and the link to one replica.

Both sides batch their writes: messages are packed once and joined into one
``transport.write`` per event-loop turn.  Neither logs per request.  A :class:`ReplicaLink`
knows nothing of the request path above it: it reports answers and failures to a
:class:`LinkOwner` (the request path), so the imports point one way.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from typing import Any, Protocol
from collections.abc import Awaitable, Callable

import msgpack

from agent.errors import ProtocolError
from agent.protocol import PROTOCOL_VERSION, Decoder, Limits

packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack


class Batched(asyncio.Protocol):
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


def nodelay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY and keepalive on a TCP transport (a Unix socket is left as it is)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class LinkOwner(Protocol):
    """What a :class:`ReplicaLink` reports to (the request path)."""

    def on_answer(self, link: ReplicaLink, flight: Any, message: dict) -> None:
        """A message from the replica for ``flight`` (tokens, done or error)."""
        ...

    def replica_failed(self, link: ReplicaLink, reason: str) -> None:
        """The link broke or the replica answered garbage."""
        ...

    def replica_answered(self, link: ReplicaLink, message: dict) -> None:
        """The replica answered a :meth:`ReplicaLink.probe` with ``message``."""
        ...


class ReplicaLink(Batched):
    """The front door's connection to one replica; requests multiplex over it by id.

    ``in_flight`` maps the link's own request id to the owner's object for that request
    (whatever it passed to :meth:`dispatch`); :meth:`probe` asks the replica for ``health``
    (its answer goes to :meth:`LinkOwner.replica_answered`)."""

    def __init__(self, owner: LinkOwner, replica_id: str, limits: Limits) -> None:
        super().__init__()
        self.owner = owner
        self.replica_id = replica_id
        self.decoder = Decoder(limits)
        self.in_flight: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self.ready = False
        self._waiting: list[bytes] = []  # packed before the connection was made
        self._probes: set[int] = set()    # ids of health probes not answered yet
        self.heard_s = float("-inf")      # owner's clock time of the last answer (its owner sets it)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        nodelay(transport)
        self.ready = True
        for data in self._waiting:
            self.send(data)
        self._waiting.clear()

    def dispatch(self, flight: Any, message: dict) -> int:
        """Send ``message`` (a ``generate`` map; its ``id`` is set here) for ``flight``;
        returns the link's id for it."""
        rid = next(self._ids)
        self.in_flight[rid] = flight
        message["id"] = rid
        data = packb(message)
        if self.ready:
            self.send(data)
        else:
            self._waiting.append(data)
        return rid

    def cancel(self, rid: int) -> None:
        """Forget request ``rid`` and tell the replica (``{"op": "cancel", "id": rid}``) so
        that it frees the sequence's KV slot; any later answer for ``rid`` is dropped."""
        if self.in_flight.pop(rid, None) is None:
            return
        data = packb({"v": PROTOCOL_VERSION, "op": "cancel", "id": rid})
        if self.ready:
            self.send(data)
        else:
            self._waiting.append(data)

    def probe(self) -> None:
        """Send ``{"op": "health"}``; any answer to it (a result or an error: the replica's
        event loop runs) is reported to the owner.  At most a few probes are outstanding."""
        if len(self._probes) >= 4:
            return
        rid = next(self._ids)
        self._probes.add(rid)
        data = packb({"v": PROTOCOL_VERSION, "op": "health", "id": rid})
        if self.ready:
            self.send(data)
        else:
            self._waiting.append(data)

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as err:
            self.owner.replica_failed(self, f"bad answer from replica: {err.message}")
            return
        on_answer, in_flight = self.owner.on_answer, self.in_flight
        for message in messages:
            rid: Any = message.get("id")   # whatever the replica sent; unknown ids are dropped
            flight = in_flight.get(rid)
            if flight is not None:
                on_answer(self, flight, message)
            elif self._probes and rid in self._probes:
                self._probes.clear()
                self.owner.replica_answered(self, message)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:  # closed on purpose (replica gone from the registry, shutdown)
            return
        self.closed = True
        self.owner.replica_failed(self, f"connection to replica lost ({exc or 'closed'})")


Connector = Callable[[ReplicaLink, str], Awaitable[None]]
"""Connects a new :class:`ReplicaLink` to the replica at an address (raises OSError when it
cannot): :func:`open_socket` in production; the simulator (agent/sim/) gives its own.  The
caller bounds it (:func:`connect_timeout_s`): a replica address that drops SYNs would
otherwise hold it for the kernel's SYN retries (``tcp_syn_retries``, about two minutes)."""

CONNECT_MIN_S = 0.1
"""The shortest connect timeout: a connection on a loaded host's loopback can take tens of
milliseconds; a request with less time left than this is answered by its deadline anyway."""
CONNECT_MAX_S = 5.0
"""The longest connect timeout (a request held for its model's start has no deadline at the
replica): a replica that accepts no connection within it is failed and its requests placed
again."""


def connect_timeout_s(left_s: float | None) -> float:
    """The connect timeout for a link opened for a request with ``left_s`` seconds left to its
    deadline (None: none): ``left_s`` within [``CONNECT_MIN_S``, ``CONNECT_MAX_S``]."""
    if left_s is None:
        return CONNECT_MAX_S
    return min(CONNECT_MAX_S, max(CONNECT_MIN_S, left_s))


async def open_socket(link: ReplicaLink, address: str) -> None:
    """Connect ``link`` over TCP (``host:port``) or a Unix socket (a path).  Raises OSError
    (TimeoutError after ``CONNECT_MAX_S``, when the caller bounds it no tighter)."""
    loop = asyncio.get_running_loop()
    host, _, port = address.rpartition(":")
    if host:
        connect = loop.create_connection(lambda: link, host, int(port))
    else:
        connect = loop.create_unix_connection(lambda: link, address)
    await asyncio.wait_for(connect, CONNECT_MAX_S)
