"""The OpenAI-compatible HTTP/1.1 entrance: a thin adapter over the shared request path.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE with
``stream: true``), ``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health`` and
``GET /ready`` (aliases ``/healthz``, ``/readyz``).  A request is authenticated with the
msgpack door's per-tenant tokens (``Authorization: Bearer TOKEN``), translated by
:mod:`agent.frontdoor.openai_api` into the protocol's ``generate`` (same validation, same
limits) and submitted to :class:`~agent.frontdoor.request_path.RequestPath` with an
:class:`HttpSink`: one admission path for both doors.

Why aiohttp (bench/http_stack.py, same bare endpoint): uvicorn+httptools used 73 / 163 us of
server CPU per JSON / 16-chunk SSE request and aiohttp 80 / 187 (uvicorn+h11 153 / 300), but
aiohttp's C parser enforces the request-line, header-size and header-count limits itself
(uvicorn's httptools path has no header limits), it embeds in the front door's own event
loop through a documented API (``AppRunner`` + its ``Server`` as protocol factory), and it
cancels a handler whose client went away (``handler_cancellation``), which is how a
disconnect reaches :meth:`Flight.cancel`.  Why its own port rather than sniffing the first
bytes on the msgpack port: the msgpack hot path stays untouched, each port gets the health
check of its protocol (TCP for msgpack, HTTP ``/ready`` for this one) and its own firewall rule.

Limits, checked before anything is allocated for the request (:class:`HttpConfig`): the
request target and each header's name and value ``max_header_bytes``, at most
``max_headers`` headers (aiohttp's parser answers 400 itself, as plain text: no request
exists yet), body ``max_body_bytes`` (from Content-Length before reading, and while reading
a chunked body: 413), the request's head within ``header_timeout_s`` of its first byte and
its body within ``body_timeout_s`` (slow senders: 408), ``idle_timeout_s`` between requests,
``write_timeout_s`` for a client that stops reading its answer, ``max_connections`` (503).
``Expect: 100-continue`` with a declared body over ``max_body_bytes`` is 413 before the body
is sent.

Conventions clients of OpenAI's and vLLM's servers rely on: ``max_model_len`` in
``/v1/models``; an unknown path is 404 ``Invalid URL`` (``code`` null), a wrong method 405
with ``Allow``; CORS only for ``HttpConfig.allowed_origins`` (aiohttp-cors); a refusal's code
(agent/wire/refusals.py) in the ``x-rewarm-refusal`` header and ``error.refusal``.  The
endpoints, parameters, limits and errors for users: docs/http-api.md.

An answer is written by :mod:`agent.frontdoor.http_replies` (JSON or SSE); the models,
health and readiness routes are :mod:`agent.frontdoor.http_status`'s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from typing import Any

from aiohttp import web

from agent.clock import Clock
from agent.errors import MessageTooLarge, ProtocolError, Unauthorized
from agent.frontdoor import openai_api as oa
from agent.frontdoor.announce import Announcer
from agent.frontdoor.auth import TokenAuth
from agent.frontdoor.http_answers import (MODEL_STATES, REFUSAL_HEADER,  # noqa: F401 (re-exported)
                                          CatalogStates, HttpSink, ModelStates,
                                          allow_origins, error_response)
from agent.frontdoor.http_conn import (DEFAULT_HTTP_PORT, HTTP_PORT_ENV,  # noqa: F401 (re-exported)
                                       ConnGuard, HttpConfig, canned, http_port_from_env)
from agent.frontdoor.http_replies import refusal_response, stream_answer, whole_answer
from agent.frontdoor.http_status import StatusRoutes
from agent.frontdoor.request_path import GenerateRequest, RequestPath

log = logging.getLogger(__name__)
# aiohttp logs each malformed request (answered 400 by its parser) with a traceback: a
# client could fill the log.  Those are counted by their answers, not logged.
_PARSER_LOG = logging.getLogger(__name__ + ".parser")
_PARSER_LOG.setLevel(logging.CRITICAL)
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?", re.ASCII)


class HttpEntrance:
    """The HTTP door over ``path`` (the front door's request path) with ``auth`` (its
    tokens).  ``models``: the catalog's view of the tiers below warm (None: a model is warm
    or cold as far as this door can tell)."""

    def __init__(self, path: RequestPath, config: HttpConfig, *, clock: Clock, auth: TokenAuth,
                 models: ModelStates | None = None) -> None:
        self.path, self.config, self.clock, self.auth = path, config, clock, auth
        self.models = models
        self.guards: dict[Any, ConnGuard] = {}
        self.counts = {"requests": 0, "cancelled": 0, "timeouts": 0, "refused_conns": 0}
        self._runner: web.AppRunner | None = None
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task | None = None
        self.announcer: Announcer | None = None    # set by start_http
        self.instance_id = "frontdoor-http"
        self.contexts: dict[str, int] = {}  # model -> context (tokens) of its replicas seen
        self.status = StatusRoutes(self)    # /v1/models, /health, /ready

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> tuple[str, int]:
        """Listen; returns the bound ``(host, port)``."""
        cfg = self.config
        app = web.Application(client_max_size=cfg.max_body_bytes,
                              middlewares=[self._middleware])
        routes = [app.router.add_post("/v1/completions", self._completions,
                                      expect_handler=self._expect),
                  app.router.add_post("/v1/chat/completions", self._chat,
                                      expect_handler=self._expect),
                  app.router.add_get("/v1/models", self.status.list_models),
                  app.router.add_get("/v1/models/{model:.+}", self.status.get_model)]
        for route in ("/health", "/healthz"):
            routes.append(app.router.add_get(route, self.status.health))
        for route in ("/ready", "/readyz"):
            routes.append(app.router.add_get(route, self.status.ready))
        if cfg.allowed_origins:
            allow_origins(app, routes, cfg.allowed_origins)
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True,
            keepalive_timeout=cfg.idle_timeout_s, max_line_size=cfg.max_header_bytes,
            max_field_size=cfg.max_header_bytes, max_headers=cfg.max_headers,
            shutdown_timeout=1.0, logger=_PARSER_LOG, lingering_time=cfg.close_linger_s)
        await self._runner.setup()
        factory = self._runner.server
        assert factory is not None, "AppRunner.setup() made the server"
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: ConnGuard(self, factory()), cfg.host, cfg.port, backlog=1024,
            reuse_address=True)
        self._sweeper = loop.create_task(self._sweep_loop())
        return self.address

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("HTTP entrance used before start()")
        return self._server.sockets[0].getsockname()[:2]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def close_listener(self) -> None:
        if self._server is not None:
            self._server.close()

    async def stop(self) -> None:
        """Stop listening and close every connection (call after the front door answered
        what was queued and in flight, so that handlers have written their answers)."""
        self.close_listener()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        for guard in list(self.guards.values()):
            if guard.transport is not None:
                guard.transport.close()

    # --- connections -----------------------------------------------------------------

    def accept(self, guard: ConnGuard) -> bool:
        if len(self.guards) >= self.config.max_connections:
            self.counts["refused_conns"] += 1
            return False
        self.guards[guard.transport] = guard
        return True

    def forget(self, guard: ConnGuard) -> None:
        self.guards.pop(guard.transport, None)

    def sweep(self) -> None:
        """Cut off heads slower than ``header_timeout_s`` (408) and close connections idle
        for ``idle_timeout_s``."""
        cfg, now = self.config, self.clock.now()
        for guard in list(self.guards.values()):
            if guard.busy:
                continue
            if guard.head_start_s is not None:
                if now - guard.head_start_s > cfg.header_timeout_s and guard.transport:
                    self.counts["timeouts"] += 1
                    guard.transport.write(canned(408, "Request Timeout"))
                    guard.transport.close()
            elif now - guard.last_s > cfg.idle_timeout_s and guard.transport:
                guard.transport.close()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_s)
            self.sweep()

    # --- requests --------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """Every answer in OpenAI's error shape; the head's timer stops when it is parsed."""
        guard = self.guards.get(request.transport)
        if guard is not None:
            guard.head_start_s = None
            guard.busy += 1
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status == 413:
                return error_response(413, f"request body exceeds max_body_bytes"
                                      f"({self.config.max_body_bytes})", "body")
            if exc.status == 404:   # OpenAI's words for a path it does not serve
                return error_response(404, f"Invalid URL ({request.method} {request.path})",
                                      code=None)
            if exc.status == 405:   # RFC 9110 15.5.6: a 405 carries Allow
                return error_response(405, f"method {request.method} not allowed on "
                                      f"{request.path}", code=None,
                                      headers={"Allow": exc.headers.get("Allow", "")})
            return error_response(exc.status, exc.reason or "error")
        except Exception as exc:   # a bug: logged here, answered without its traceback
            writer = request.writer
            if writer is not None and writer.output_size > 0:
                # an answer has begun (most often a client that stopped reading: the write
                # timeout): aiohttp closes the connection; not logged, a client could flood it
                raise
            log.exception("HTTP %s %s failed", request.method, request.path)
            return error_response(500, f"internal error ({type(exc).__name__})")
        finally:
            if guard is not None:
                guard.busy -= 1
                guard.last_s = self.clock.now()

    def _tenant(self, request: web.Request) -> str | None:
        if not self.auth.enabled:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        return self.auth.check(token.strip() if scheme.lower() == "bearer" else None)

    def _deadline_ms(self, request: web.Request) -> float | None:
        raw = request.headers.get("x-rewarm-deadline-ms")
        if raw is None:
            return None
        top = self.path.config.limits.max_deadline_ms
        # ASCII decimal only: float() alone also takes "1_000", "nan" and non-ASCII digits
        value = float(raw) if _DECIMAL.fullmatch(raw.strip()) else math.nan
        if not 0 < value <= top:
            raise ProtocolError(f"x-rewarm-deadline-ms: {raw[:40]!r} must be a number within "
                                f"(0, {top}] ms", field="x-rewarm-deadline-ms", value=raw[:40],
                                limit=top)
        return value

    async def _expect(self, request: web.Request) -> web.Response | None:
        """``Expect: 100-continue`` (RFC 9110 10.1.1): a declared body over
        ``max_body_bytes`` is refused (413) before the client uploads it, and the connection
        closes (the body is not read); another expectation is 417, as aiohttp's own
        handler answers it; otherwise ``100 Continue``."""
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            return error_response(417, f"Expect: {expect[:40]!r} is not supported "
                                  "(only 100-continue)", "Expect", code=None)
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            resp = error_response(413, f"request body of {request.content_length} bytes "
                                  f"exceeds max_body_bytes({limit})", "body")
            resp.force_close()
            return resp
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0   # the answer's own bytes have not begun
        return None

    def context_tokens(self, model: str) -> int | None:
        """The context (tokens per sequence, vLLM's ``max_model_len``) of ``model``'s
        replicas: ``kv_capacity_tokens / max_seqs`` of the warm ones (a KV slot each), the
        last seen when none is warm, None before any was seen."""
        seen = [r.kv_capacity_tokens // r.max_seqs for r in self.path.router.warm(model)
                if r.max_seqs > 0]
        if seen:
            self.contexts[model] = max(seen)
        return self.contexts.get(model)

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise MessageTooLarge(f"request body of {request.content_length} bytes exceeds "
                                  f"max_body_bytes({limit})", field="body",
                                  value=request.content_length, limit=limit)
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                return await request.read()
        except TimeoutError:
            self.counts["timeouts"] += 1
            raise _Timeout(f"request body not complete within body_timeout_s"
                           f"({self.config.body_timeout_s})") from None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oa.parse_completion)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, oa.parse_chat)

    async def _generate(self, request: web.Request, parse) -> web.StreamResponse:
        self.counts["requests"] += 1
        model = ""
        try:
            tenant = self._tenant(request)
            deadline_ms = self._deadline_ms(request)
            raw = await self._read_body(request)
            body = oa.parse_body(raw)
            if type(body) is dict and type(body.get("model")) is str:
                model = body["model"]
            parsed = parse(body, self.path.config.limits)
        except _Timeout as exc:
            return error_response(408, str(exc))
        except (ProtocolError, Unauthorized) as err:
            self.path.refused(None, model, err.code)
            return error_response(err.code, err.message, getattr(err, "field", None))
        msg = parsed.message
        if msg.get("fit_context"):   # a chat without max_tokens: sized as a whole context
            msg["max_tokens"] = min(msg["max_tokens"], self.context_tokens(msg["model"])
                                    or self.config.assumed_context_tokens)
        req = GenerateRequest(oa.new_id(parsed.chat), msg["model"], msg.get("tokens"),
                              msg.get("prompt"), msg["max_tokens"], deadline_ms, tenant,
                              msg.get("seed"), msg.get("stop"), msg.get("temperature"),
                              msg.get("top_p"), msg.get("top_k"), wire=msg)
        sink = HttpSink(parsed.stream)
        if parsed.detokenize:
            sink.token_ids = []
        sink.flight = self.path.submit(req, sink)
        try:
            if parsed.stream:
                return await stream_answer(request, parsed, req.request_id, sink,
                                           self.config.write_timeout_s)
            return await whole_answer(parsed, req.request_id, sink)
        finally:
            if sink.final is None:          # the client went away (handler cancelled)
                self.counts["cancelled"] += 1
                sink.flight.cancel()
            # the flight holds its sink: without this the pair (and the request, the event,
            # the parts: 7 objects) is a cycle that only the collector frees, so each request
            # left garbage that made gen-0 collections run every ~100 requests
            sink.flight = None

    _refusal = staticmethod(refusal_response)

    def readiness(self) -> tuple[bool, dict]:
        """Ready: not shutting down, and a model is warm or capacity can be restored."""
        return self.status.readiness()


class _Timeout(Exception):
    """A request's body did not arrive within body_timeout_s (answered 408)."""


async def start_http(frontdoor, config: HttpConfig, *, models: ModelStates | None = None,
                     announcer=None) -> HttpEntrance:
    """Start the HTTP entrance over a started ``frontdoor`` (agent/frontdoor/server.py) with
    its request path, clock and tokens; with ``announcer`` (a ConsulHttpAnnouncer) its port
    is registered as ``rewarm-frontdoor-http``.  Stop it with :func:`stop_http`."""
    from agent.cluster.base import ServiceInstance
    from agent.frontdoor.announce import FRONTDOOR_HTTP_SERVICE

    entrance = HttpEntrance(frontdoor.path, config, clock=frontdoor.clock, auth=frontdoor.auth,
                            models=models)
    host, port = await entrance.start()
    entrance.announcer = announcer
    entrance.instance_id = f"{frontdoor.instance_id}-http"
    if announcer is not None:
        await asyncio.to_thread(announcer.announce, ServiceInstance(
            FRONTDOOR_HTTP_SERVICE, entrance.instance_id, host, port, tags=["protocol=http"]))
    return entrance


async def stop_http(frontdoor, entrance: HttpEntrance, grace_s: float = 1.0) -> None:
    """Stop both doors in order: the HTTP listener first (no new requests), then the front
    door (queued requests 503 at once, running ones within ``grace_s``), then the HTTP
    connections, once their handlers have written those answers."""
    entrance.close_listener()
    announcer = getattr(entrance, "announcer", None)
    if announcer is not None:
        try:
            await asyncio.to_thread(announcer.withdraw, entrance.instance_id)
        except Exception as exc:  # shutting down: say so, carry on
            log.warning("withdrawing %s failed: %s", entrance.instance_id, exc)
    await frontdoor.stop(grace_s=grace_s)
    await entrance.stop()
