"""What the HTTP entrance answers with: the sink a request's answers are collected in
(:class:`HttpSink`), error answers in OpenAI's shape with the refusal's code
(:func:`error_response`), the model states ``GET /v1/models`` reports, and CORS.

Used by :mod:`agent.frontdoor.http_entrance` (the routes and the connection handling).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Protocol

from aiohttp import web

from agent.frontdoor import openai_api as oa
from agent.frontdoor.request_path import Flight

MODEL_STATES = ("warm", "suspended", "snapshot", "cold")


class ModelStates(Protocol):
    """Where ``GET /v1/models`` learns the tiers below warm: model -> ``suspended``,
    ``snapshot`` or ``cold`` (a catalog, a node agent's snapshot list)."""

    def states(self) -> dict[str, str]: ...


class CatalogStates:
    """:class:`ModelStates` from a snapshot catalog (agent/snapshot/catalog.py): a model with
    a suspended replica is ``suspended``, else one with a ready snapshot is ``snapshot``, else
    ``cold`` (warm is the router's to say).  ``models``: the names to report."""

    def __init__(self, catalog, models: list[str]) -> None:
        self.catalog, self.models = catalog, list(models)

    def states(self) -> dict[str, str]:
        out = {}
        for name in self.models:
            if self.catalog.replicas(name, states=["suspended"]):
                out[name] = "suspended"
            elif self.catalog.snapshots(name, status="ready"):
                out[name] = "snapshot"
            else:
                out[name] = "cold"
        return out


class HttpSink:
    """One HTTP request's answers, collected for its handler (the request path calls these
    from the event loop; the handler awaits :meth:`wait`)."""

    __slots__ = ("parts", "final", "_event", "flight", "n_tokens", "prompt_tokens", "stream",
                 "token_ids")

    def __init__(self, stream: bool = True) -> None:
        self.stream = stream     # wake the handler per chunk (SSE), or only at the end
        self.parts: list[str] = []
        self.n_tokens = 0        # tokens received so far
        self.prompt_tokens = 0   # from the replica's first tokens message
        # ("done", message) or ("error", code, reason, retry_after_ms, refusal)
        self.final: tuple | None = None
        self._event = asyncio.Event()
        self.flight: Flight | None = None
        self.token_ids: list[int] | None = None   # kept for a token-id prompt (no text)

    def tokens(self, message: dict) -> None:
        self.parts.append(message.get("text") or "")
        ids = message.get("tokens") or ()
        self.n_tokens += len(ids)
        if self.token_ids is not None:
            self.token_ids.extend(ids)
        if "prompt_tokens" in message:
            self.prompt_tokens = int(message["prompt_tokens"])
        if self.stream:
            self._event.set()

    def done(self, message: dict) -> None:
        self.final = ("done", message)
        self._event.set()

    def error(self, code: int, reason: str, retry_after_ms: int | None = None,
              refusal: str | None = None) -> None:
        """The request's final error; ``refusal``: why it was refused, as data (one of
        agent/wire/refusals.py's REFUSALS), set where the refusal was decided."""
        self.final = ("error", code, reason, retry_after_ms, refusal)
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event.clear()


REFUSAL_HEADER = "x-rewarm-refusal"
"""The answer header that says why a request was refused (beside the body's
``error.refusal``), so a load generator that only keeps status and headers can tell."""


def error_response(status: int, message: str, param: str | None = None,
                   retry_after_ms: int | None = None, *, refusal: str | None = None,
                   headers: dict | None = None, **body_kw) -> web.Response:
    """OpenAI's error shape with ``status``; 429 and 503 carry ``Retry-After`` (whole
    seconds, rounded up) beside ``retry_after_ms``; a refusal's reason is in
    :data:`REFUSAL_HEADER` and ``error.refusal``."""
    headers = dict(headers or {})
    if retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_ms / 1000)))
    if refusal is not None:
        headers[REFUSAL_HEADER] = refusal
    return web.Response(status=status, headers=headers, content_type="application/json",
                        text=json.dumps(oa.error_body(status, message, param, retry_after_ms,
                                                      refusal=refusal, **body_kw)))


def allow_origins(app: web.Application, routes: list, origins: tuple[str, ...]) -> None:
    """CORS for ``routes`` from ``origins`` (aiohttp-cors: preflight ``OPTIONS`` answered,
    ``Access-Control-Allow-Origin`` on answers).  Credentials are not allowed (a bearer
    token is sent as a header, which ``allow_headers`` covers); the rewarm answer headers
    are exposed so a browser client can read them."""
    import aiohttp_cors

    options = aiohttp_cors.ResourceOptions(
        allow_credentials=False, allow_headers="*", allow_methods=["GET", "POST"],
        expose_headers=("Retry-After", REFUSAL_HEADER, "x-rewarm-path"), max_age=600)
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in origins})
    for route in routes:
        cors.add(route)
