"""The HTTP entrance's connections: its limits (:class:`HttpConfig`) and the guard that
times each request's head and the idle time between requests, which aiohttp does not bound.

:class:`ConnGuard` wraps aiohttp's per-connection protocol (``AppRunner.server()``, aiohttp's
documented low-level protocol factory): it passes every event through, stamps the first byte
of a request's head and the last activity, and refuses connections over the cap with a
canned 503.  The owner (:class:`~agent.frontdoor.http_entrance.HttpEntrance`) sweeps them.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Protocol

from agent.clock import Clock
from agent.errors import ConfigError
from agent.frontdoor import openai_api as oa
from agent.wire import refusals

HTTP_PORT_ENV = "REWARM_HTTP_PORT"
DEFAULT_HTTP_PORT = 8000


@dataclass
class HttpConfig:
    """The HTTP entrance's address and limits (units in the names)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_HTTP_PORT      # 0 picks a free port
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 8190       # the request line, and each header line
    max_headers: int = 64
    header_timeout_s: float = 10.0     # from a request's first byte to the end of its head
    body_timeout_s: float = 30.0       # to read the whole body
    idle_timeout_s: float = 75.0       # keep-alive: no request for this long closes
    write_timeout_s: float = 30.0      # a client not reading its answer for this long is cut
    close_linger_s: float = 2.0        # after an answer, read (and drop) an unread body this long
    max_connections: int = 4096
    sweep_s: float = 0.25              # header / idle timeout resolution
    # A chat without max_tokens is sized for admission as a whole context: the replicas'
    # (kv_capacity_tokens / max_seqs) once one was seen, else this (the replica's default
    # --max-seq-len); the replica itself caps the generation to what its context leaves.
    assumed_context_tokens: int = 512
    # Origins allowed to call from a browser (CORS); empty: no CORS headers, no preflight.
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or isinstance(self.port, bool) \
                or not 0 <= self.port <= 65535:
            raise ConfigError(f"HttpConfig port={self.port!r} must be an int within 0..65535",
                              name="http_port", value=self.port, limit=(0, 65535))
        for name in ("max_body_bytes", "max_header_bytes", "max_headers", "max_connections",
                     "assumed_context_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"HttpConfig {name}={value!r} must be an int >= 1",
                                  name=name, value=value, limit=1)
        for origin in self.allowed_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ConfigError(f"allowed origin {origin!r} must be '*' or scheme://host[:port]"
                                  " (RFC 6454 serialisation, no path)", name="allowed_origins",
                                  value=origin, limit="scheme://host[:port]")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s",
                     "write_timeout_s", "close_linger_s", "sweep_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not value > 0 or math.isinf(value):
                raise ConfigError(f"HttpConfig {name}={value!r} must be a finite number > 0",
                                  name=name, value=value, limit=0)


_CANNED = {408: b"request head not complete within header_timeout_s",
           503: b"too many connections"}


def canned(status: int, reason: str, refusal: str | None = None) -> bytes:
    """A complete HTTP/1.1 error answer for a connection no request object exists for yet
    (a head too slow, over the connection cap): written, then the connection closes.
    ``refusal`` (agent/wire/refusals.py) goes in ``x-rewarm-refusal`` and ``error.refusal``."""
    body = json.dumps(oa.error_body(status, _CANNED[status].decode(),
                                    refusal=refusal)).encode()
    header = f"x-rewarm-refusal: {refusal}\r\n" if refusal is not None else ""
    return (f"HTTP/1.1 {status} {reason}\r\n{header}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class GuardOwner(Protocol):
    """What a :class:`ConnGuard` reports to."""

    clock: Clock

    def accept(self, guard: ConnGuard) -> bool: ...
    def forget(self, guard: ConnGuard) -> None: ...


class ConnGuard(asyncio.Protocol):
    """Wraps aiohttp's per-connection protocol to time each request's head (slowloris) and
    the idle time between requests, which aiohttp does not bound itself."""

    __slots__ = ("entrance", "inner", "transport", "head_start_s", "busy", "last_s",
                 "accepted")

    def __init__(self, entrance: GuardOwner, inner: asyncio.Protocol) -> None:
        self.entrance, self.inner = entrance, inner
        self.transport: asyncio.Transport | None = None
        self.head_start_s: float | None = None
        self.busy = 0            # requests being handled on this connection
        self.last_s = entrance.clock.now()
        self.accepted = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.entrance.accept(self):
            transport.write(canned(503, "Service Unavailable", refusals.MAX_CONNECTIONS))
            transport.close()
            return
        self.accepted = True
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.accepted:
            return
        self.last_s = now = self.entrance.clock.now()
        if not self.busy and self.head_start_s is None:
            self.head_start_s = now
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.accepted else None

    def connection_lost(self, exc) -> None:
        if self.accepted:
            self.entrance.forget(self)
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def http_port_from_env(environ=None) -> int:
    """The HTTP port: ``$REWARM_HTTP_PORT`` when set (0 picks a free one), else 8000.
    Raises ConfigError naming the variable for a value that is not a port."""
    import os

    raw = (environ if environ is not None else os.environ).get(HTTP_PORT_ENV)
    if raw is None or raw == "":
        return DEFAULT_HTTP_PORT
    if not raw.strip().isdigit() or not 0 <= int(raw) <= 65535:
        raise ConfigError(f"{HTTP_PORT_ENV}={raw[:20]!r} is not a port within 0..65535",
                          name=HTTP_PORT_ENV, value=raw[:20], limit=(0, 65535))
    return int(raw)
