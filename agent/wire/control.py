"""The client side of the node agent's control API: the shared token, one blocking call,
the default address.

The control API is msgpack over TCP or a Unix socket in :mod:`agent.wire.framing`'s frames;
the server is :mod:`agent.node.control` (ops and their fields are listed there), which reads
:data:`TOKEN_ENV` from here, so both ends name one secret.  Its clients are the front door
(a restore on a node agent), the predictor, the local scaler (agent/cluster/local_scaler.py),
``rewarm up`` and ``rewarm agent ...``: it lives in the wire's room, below all of them, and
none of them needs the node agent's package or a cluster implementation to reach it.
"""

from __future__ import annotations

import os
from typing import Any

from agent.errors import ERROR_BY_CODE, ConfigError, ReplicaNotFound, RewarmError
from agent.protocol import request

DEFAULT_AGENT = "127.0.0.1:7733"
"""The node agent's default control address: ``rewarm agent run`` and ``rewarm up`` listen
here, and every client of it (``rewarm agent ...``, ``rewarm predictor``) looks here."""


def default_agent() -> str:
    """Where clients look for the node agent: ``$REWARM_AGENT`` when set, else DEFAULT_AGENT."""
    return os.environ.get("REWARM_AGENT") or DEFAULT_AGENT


TOKEN_ENV = "REWARM_CONTROL_TOKEN"
"""The shared secret of the control API: servers require it when set, clients send it."""


MIN_TOKEN_BYTES = 16   # as the front door's tenant tokens (agent/frontdoor/auth.py)


def control_token() -> str | None:
    """The control API token from ``$REWARM_CONTROL_TOKEN`` (None when unset or empty).
    Raises ConfigError when it is not UTF-8 or shorter than :data:`MIN_TOKEN_BYTES`."""
    token = os.environ.get(TOKEN_ENV) or None
    if token is None:
        return None
    try:
        size = len(token.strip().encode())
    except UnicodeEncodeError:
        raise ConfigError(f"{TOKEN_ENV} is not valid UTF-8", name=TOKEN_ENV, value="(hidden)",
                          limit="UTF-8 text") from None
    if size < MIN_TOKEN_BYTES:
        raise ConfigError(f"{TOKEN_ENV} has {size} bytes (blanks aside); at least "
                          f"{MIN_TOKEN_BYTES} are required", name=TOKEN_ENV, value=size,
                          limit=MIN_TOKEN_BYTES)
    return token


class ControlError(RewarmError, RuntimeError):
    """The agent answered an error. Attributes: ``status`` (wire code), ``reason``, ``op``."""


AGENT_HINT = ("is `rewarm agent run` or `rewarm up` running there? pass --agent or set "
              "REWARM_AGENT")
"""What to do when no node agent answers (the end of :class:`Unreachable`'s message)."""


def control_call(address: str, op: str, *, timeout_s: float = 600.0, hint: str = AGENT_HINT,
                 fields: dict[str, Any] | None = None, **more: Any) -> dict[str, Any]:
    """Blocking client: send one control op, return its result.

    The op's fields are ``fields`` and ``more`` (``fields`` carries the names this function
    takes itself: drain's own ``timeout_s``).

    Sends ``$REWARM_CONTROL_TOKEN`` when set.  Raises ControlError (or the typed error for the
    wire code: 401 Unauthorized, 404 ModelNotFound, or
    ReplicaNotFound for an op on a replica, ...),
    Unreachable (a ConnectionError naming ``address`` and ``hint``) when no agent answers
    there, ConnectionError, TimeoutError.
    """
    fields = {**(fields or {}), **more}
    message = {"op": op, "id": 1, **fields}
    if control_token() is not None:
        message["token"] = control_token()
    answer = request(address, message, timeout_s=timeout_s, service="node agent", hint=hint)[-1]
    if answer.get("type") == "error":
        code: Any = answer.get("code")
        reason = answer.get("reason", "")
        cls = ReplicaNotFound if code == 404 and "replica" in fields else ERROR_BY_CODE.get(code)
        if cls is not None:
            raise cls(f"agent: {reason}", op=op, status=code, reason=reason)
        raise ControlError(f"agent: {op} failed ({code}): {reason}", op=op,
                           status=code, reason=reason)
    if answer.get("type") != "result":
        raise ControlError(f"agent: {op} answered {answer.get('type')!r}, expected a result",
                           op=op, status=None, reason="unexpected answer")
    return answer["result"]
