"""The HTTP entrance's routes that are not generation: ``GET /v1/models`` (and
``/v1/models/{id}``), ``GET /health`` and ``GET /ready``.

:class:`StatusRoutes` is the collaborator an :class:`~agent.frontdoor.http_entrance.HttpEntrance`
holds for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from agent.errors import Unauthorized
from agent.frontdoor.http_answers import MODEL_STATES, error_response

if TYPE_CHECKING:   # for the checker only: the entrance imports this module
    from agent.frontdoor.http_entrance import HttpEntrance


class StatusRoutes:
    """The models, health and readiness routes of ``entrance`` (an HttpEntrance: its request
    ``path``, ``models`` (the tiers below warm), ``context_tokens()`` and tenant check)."""

    def __init__(self, entrance: HttpEntrance) -> None:
        self.entrance = entrance

    def model_rows(self) -> list[dict]:
        """One ``/v1/models`` row per model the request path knows or ``models`` reports:
        its state (warm, suspended, snapshot, cold) and ``max_model_len``."""
        entrance = self.entrance
        below = entrance.models.states() if entrance.models is not None else {}
        names = sorted(set(entrance.path.known_models) | set(below))
        rows = []
        for name in names:
            state = "warm" if entrance.path.router.warm(name) else below.get(name, "cold")
            rows.append({"id": name, "object": "model", "created": 0, "owned_by": "rewarm",
                         "max_model_len": entrance.context_tokens(name),
                         "state": state if state in MODEL_STATES else "cold"})
        return rows

    async def list_models(self, request: web.Request) -> web.Response:
        try:
            self.entrance._tenant(request)
        except Unauthorized as err:
            return error_response(401, err.message)
        return web.json_response({"object": "list", "data": self.model_rows()})

    async def get_model(self, request: web.Request) -> web.Response:
        try:
            self.entrance._tenant(request)
        except Unauthorized as err:
            return error_response(401, err.message)
        name = request.match_info["model"]
        for row in self.model_rows():
            if row["id"] == name:
                return web.json_response(row)
        return error_response(404, f"unknown model {name!r}", "model")

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def readiness(self) -> tuple[bool, dict]:
        """Ready: not shutting down, and a model is warm or capacity can be restored."""
        path = self.entrance.path
        warm = sum(len(path.router.warm(m)) for m in path.router.models())
        info = {"warm_replicas": warm, "restores_in_flight": path.gate.total,
                "can_restore": path.capacity is not None}
        if path.stopping:
            return False, {**info, "reason": "front door shutting down"}
        if not warm and path.capacity is None:
            return False, {**info, "reason": "no warm replica and no capacity requester"}
        return True, info

    async def ready(self, request: web.Request) -> web.Response:
        ready, info = self.readiness()
        return web.json_response({"status": "ready" if ready else "not ready", **info},
                                 status=200 if ready else 503)
