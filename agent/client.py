"""Client library for the front door: sync and asyncio, streaming, typed errors, 429 retry.

``AsyncClient`` multiplexes many requests over one connection by id; ``Client`` is a
blocking one-request-at-a-time client built on a plain socket.  Both raise the typed errors
of :mod:`agent.errors` (``ERROR_BY_CODE``; :class:`~agent.errors.Unreachable`, a
ConnectionError naming the address, when nothing answers there) and retry 429 after
``retry_after_ms`` plus up to 25 % jitter, at most ``max_retries`` times and never waiting
longer than ``max_retry_wait_ms`` at once.  :func:`discover` finds front doors through Consul
(py-consul, healthy ``rewarm-frontdoor`` instances) or through any Registry.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import AsyncIterator, Iterator

from agent.errors import ERROR_BY_CODE, Overloaded, ProtocolError, RewarmError
from agent.protocol import Decoder, pack, unreachable

FRONTDOOR_SERVICE = "rewarm-frontdoor"


@dataclass
class Generation:
    """A finished generation: ``tokens`` (token ids, [n_tokens]) and the final ``done``
    message (ttft_ms, total_ms, path, replica, n_tokens)."""

    tokens: list[int] = field(default_factory=list)
    done: dict[str, Any] = field(default_factory=dict)


def error_from(message: dict) -> RewarmError:
    """The typed exception for an ``error`` message (RewarmError for unknown codes)."""
    code = message.get("code", 500)
    cls = ERROR_BY_CODE.get(code, RewarmError)
    err = cls(f"{code}: {message.get('reason', '')}", code=code,
              retry_after_ms=message.get("retry_after_ms"), reason=message.get("reason"))
    err.code = code
    return err


def _request(op: str, rid: int, token: str | None, **fields: Any) -> bytes:
    msg = {"op": op, "id": rid, **{k: v for k, v in fields.items() if v is not None}}
    if token is not None:
        msg["token"] = token
    return pack(msg)


def _backoff_s(err: Overloaded, max_retry_wait_ms: float) -> float:
    base = float(getattr(err, "retry_after_ms", None) or 100)
    return min(base * (1 + 0.25 * random.random()), max_retry_wait_ms) / 1000.0


class AsyncClient:
    """asyncio client.  ``await AsyncClient.connect(host, port)``; close with ``close()``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                 token: str | None = None, max_retries: int = 3,
                 max_retry_wait_ms: float = 5000.0) -> None:
        self._reader, self._writer = reader, writer
        self.token, self.max_retries, self.max_retry_wait_ms = token, max_retries, max_retry_wait_ms
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Queue] = {}
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, host: str, port: int, **kw: Any) -> AsyncClient:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except TimeoutError:
            raise
        except OSError as exc:
            raise unreachable("front door", f"{host}:{port}", exc) from exc
        return cls(reader, writer, **kw)

    async def _read(self) -> None:
        decoder = Decoder()
        error: BaseException = ConnectionError("front door closed the connection")
        try:
            while data := await self._reader.read(65536):
                for msg in decoder.feed(data):
                    rid: Any = msg.get("id")     # whatever the peer sent; unknown ids are dropped
                    queue = self._waiting.get(rid)
                    if queue is not None:
                        queue.put_nowait(msg)
                    elif msg.get("type") == "error":  # not tied to a request: fatal
                        error = error_from(msg)
        except (OSError, ProtocolError) as exc:
            error = exc
        for queue in self._waiting.values():
            queue.put_nowait(error)

    async def _call(self, op: str, **fields: Any) -> AsyncIterator[dict]:
        rid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._waiting[rid] = queue
        try:
            if self._task.done():
                raise ConnectionError("front door connection is closed")
            self._writer.write(_request(op, rid, self.token, **fields))
            while True:
                msg = await queue.get()
                if isinstance(msg, BaseException):
                    raise msg
                if msg.get("type") == "error":
                    raise error_from(msg)
                yield msg
                if msg.get("type") in ("done", "result"):
                    return
        finally:
            self._waiting.pop(rid, None)

    async def stream(self, model: str, prompt: str | None = None, *,
                     tokens: list[int] | None = None, max_tokens: int = 16,
                     seed: int | None = None, deadline_ms: float | None = None,
                     ) -> AsyncIterator[dict]:
        """Yield ``tokens`` messages then the ``done`` message.  429 before the first token
        is retried; every other error raises its typed exception."""
        for attempt in itertools.count():
            started = False
            try:
                async for msg in self._call("generate", model=model, prompt=prompt,
                                            tokens=tokens, max_tokens=max_tokens, seed=seed,
                                            deadline_ms=deadline_ms):
                    started = True
                    yield msg
                return
            except Overloaded as err:
                if started or attempt >= self.max_retries:
                    raise
                await asyncio.sleep(_backoff_s(err, self.max_retry_wait_ms))

    async def generate(self, model: str, prompt: str | None = None, **kw: Any) -> Generation:
        out = Generation()
        async for msg in self.stream(model, prompt, **kw):
            if msg["type"] == "tokens":
                out.tokens.extend(msg["tokens"])
            else:
                out.done = msg
        return out

    async def info(self, op: str) -> dict:
        """``op``: stats, health or models; returns the result map."""
        async for msg in self._call(op):
            return msg["result"]
        raise ConnectionError("no answer")

    async def close(self) -> None:
        self._writer.close()
        self._task.cancel()


class Client:
    """Blocking client, one request at a time over one TCP connection."""

    def __init__(self, host: str, port: int, *, token: str | None = None,
                 timeout_s: float = 300.0, max_retries: int = 3,
                 max_retry_wait_ms: float = 5000.0) -> None:
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except TimeoutError:
            raise
        except OSError as exc:
            raise unreachable("front door", f"{host}:{port}", exc) from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._decoder = Decoder()
        self._pending: list[dict] = []
        self.token, self.max_retries, self.max_retry_wait_ms = token, max_retries, max_retry_wait_ms
        self._ids = itertools.count(1)

    def _next(self) -> dict:
        while not self._pending:
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionError("front door closed the connection")
            self._pending.extend(self._decoder.feed(data))
        return self._pending.pop(0)

    def _call(self, op: str, **fields: Any) -> Iterator[dict]:
        rid = next(self._ids)
        self._sock.sendall(_request(op, rid, self.token, **fields))
        while True:
            msg = self._next()
            if msg.get("id") not in (rid, None):
                continue
            if msg.get("type") == "error":
                raise error_from(msg)
            yield msg
            if msg.get("type") in ("done", "result"):
                return

    def stream(self, model: str, prompt: str | None = None, *, tokens: list[int] | None = None,
               max_tokens: int = 16, seed: int | None = None,
               deadline_ms: float | None = None) -> Iterator[dict]:
        """Like :meth:`AsyncClient.stream`, blocking."""
        for attempt in itertools.count():
            started = False
            try:
                for msg in self._call("generate", model=model, prompt=prompt, tokens=tokens,
                                      max_tokens=max_tokens, seed=seed, deadline_ms=deadline_ms):
                    started = True
                    yield msg
                return
            except Overloaded as err:
                if started or attempt >= self.max_retries:
                    raise
                time.sleep(_backoff_s(err, self.max_retry_wait_ms))

    def generate(self, model: str, prompt: str | None = None, **kw: Any) -> Generation:
        out = Generation()
        for msg in self.stream(model, prompt, **kw):
            if msg["type"] == "tokens":
                out.tokens.extend(msg["tokens"])
            else:
                out.done = msg
        return out

    def info(self, op: str) -> dict:
        for msg in self._call(op):
            return msg["result"]
        raise ConnectionError("no answer")

    def close(self) -> None:
        self._sock.close()


def discover(*, consul_host: str | None = None, consul_port: int = 8500,
             consul_token: str | None = None, registry: Any = None) -> list[tuple[str, int]]:
    """Addresses of healthy front doors: from Consul (``/v1/health/service/rewarm-frontdoor``
    with ``passing``) or from a Registry's ``healthy``.  Raises ClusterError when Consul
    cannot be reached."""
    if registry is not None:
        return [(i.address, i.port) for i in registry.healthy(FRONTDOOR_SERVICE)]
    from agent.cluster import ClusterChoice, consul_client  # CONSUL_HTTP_SSL, CONSUL_CACERT...
    from agent.errors import ClusterError
    choice = ClusterChoice(registry="consul",
                           consul=f"{consul_host or '127.0.0.1'}:{consul_port}")
    try:
        _, entries = consul_client(choice, token=consul_token).health.service(
            FRONTDOOR_SERVICE, passing=True)
    except Exception as exc:  # requests/py-consul errors
        raise ClusterError(f"consul at {consul_host}:{consul_port}: {exc}",
                           service="consul", status=None) from exc
    return [(e["Service"]["Address"] or e["Node"]["Address"], int(e["Service"]["Port"]))
            for e in entries]
