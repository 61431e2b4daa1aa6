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


class ReplicaLink(Batched):
    """The front door's connection to one replica; requests multiplex over it by id.

    ``in_flight`` maps the link's own request id to the owner's object for that request
    (whatever it passed to :meth:`dispatch`)."""

    def __init__(self, owner: LinkOwner, replica_id: str, limits: Limits) -> None:
        super().__init__()
        self.owner = owner
        self.replica_id = replica_id
        self.decoder = Decoder(limits)
        self.in_flight: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self.ready = False
        self._waiting: list[bytes] = []  # packed before the connection was made

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

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:  # closed on purpose (replica gone from the registry, shutdown)
            return
        self.closed = True
        self.owner.replica_failed(self, f"connection to replica lost ({exc or 'closed'})")


Connector = Callable[[ReplicaLink, str], Awaitable[None]]
"""Connects a new :class:`ReplicaLink` to the replica at an address (raises OSError when it
cannot): :func:`open_socket` in production; the simulator (agent/sim/) gives its own."""


async def open_socket(link: ReplicaLink, address: str) -> None:
    """Connect ``link`` over TCP (``host:port``) or a Unix socket (a path)."""
    loop = asyncio.get_running_loop()
    host, _, port = address.rpartition(":")
    if host:
        await loop.create_connection(lambda: link, host, int(port))
    else:
        await loop.create_unix_connection(lambda: link, address)
