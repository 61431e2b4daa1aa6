"""The agent's control API server: msgpack over TCP or a Unix socket (agent/protocol.py framing).

Requests ``{"op", "id", ...}``; every answer is one ``result`` (``{"result": {...}}``) or one
``error`` (``code``, ``reason``).  Ops and their fields:

================  ==============================================  ============================
op                fields                                          result
================  ==============================================  ============================
restore           ``model``, ``device``?                          the replica's description
drain             ``replica``, ``timeout_s``?, ``force``?         the replica, ``in_flight_at_stop``
suspend, resume   ``replica``                                     the replica, ``steps_s``
status            —                                               node, replicas, zygotes, ...
snapshot_list     ``model``?                                      ``{"snapshots": [...]}``
snapshot_verify   ``snapshot``                                    ``ok``, ``bytes`` or ``reason``
snapshot_evict    ``snapshot``                                    ``evicted``
================  ==============================================  ============================

Agent calls block (a restore takes seconds), so each runs on a thread; the event loop keeps
answering.  Bad input is an ``error`` answer, never a dropped connection except after a
framing error: 400 for a malformed request, 404 for a model or replica the node does not have
(ModelNotFound, ReplicaNotFound), 409 for a request this node's configuration or state refuses
(ConfigError: suspend/resume without CUDA checkpoint support, a device it lacks; ScaleInBlocked:
draining the last replica before its snapshot is durable), the error's own code otherwise;
500 only for a bug.  Its clients (the token, ``control_call``) live in
:mod:`agent.wire.control`, so the front door and the predictor need nothing from here.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from pathlib import Path
from typing import Any

from agent.argtypes import is_loopback
from agent.wire.control import TOKEN_ENV
from agent.errors import ConfigError, ProtocolError, RewarmError, Unauthorized
from agent.node.agent import NodeAgent
from agent.protocol import Decoder, error_message, pack, read_messages, reply_id

log = logging.getLogger(__name__)

_FIELDS: dict[str, tuple[tuple[str, type | tuple[type, ...], bool], ...]] = {   # (name, type, required)
    "restore": (("model", str, True), ("device", str, False)),
    "drain": (("replica", str, True), ("timeout_s", (int, float), False), ("force", bool, False)),
    "suspend": (("replica", str, True),),
    "resume": (("replica", str, True),),
    "status": (),
    "snapshot_list": (("model", str, False),),
    "snapshot_verify": (("snapshot", str, True),),
    "snapshot_evict": (("snapshot", str, True),),
}


def _args(msg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    op = msg.get("op")
    if op not in _FIELDS:
        raise ProtocolError(f"unknown op {op!r}", field="op", value=op, limit=sorted(_FIELDS))
    out = {}
    for name, kind, required in _FIELDS[op]:
        if name not in msg or msg[name] is None:
            if required:
                raise ProtocolError(f"{op} needs {name}", field=name, value=None, limit="present")
            continue
        if not isinstance(msg[name], kind) or (kind is not bool and isinstance(msg[name], bool)):
            raise ProtocolError(f"{op}: {name}={msg[name]!r} has the wrong type", field=name,
                                value=type(msg[name]).__name__, limit=str(kind))
        out[name] = msg[name]
    return op, out


def dispatch(agent: NodeAgent, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run one control op on ``agent`` (blocking). Raises what the agent raises
    (ReplicaNotFound for a replica op naming an unknown replica)."""
    if op == "restore":
        return agent.restore(args["model"], args.get("device"))
    if op == "drain":
        return agent.drain(args["replica"], args.get("timeout_s"), args.get("force", False))
    if op == "suspend":
        return agent.suspend(args["replica"])
    if op == "resume":
        return agent.resume(args["replica"])
    if op == "status":
        return agent.status()
    if op == "snapshot_list":
        return {"snapshots": agent.snapshot_list(args.get("model"))}
    if op == "snapshot_verify":
        return agent.snapshot_verify(args["snapshot"])
    return agent.snapshot_evict(args["snapshot"])


def check_control_bind(listen: str, token: str | None, allow_open: bool = False) -> None:
    """Refuse a control API beyond loopback without a token (it drains and restores
    replicas) unless ``allow_open``.  Raises ConfigError naming the address."""
    if token or allow_open or listen.startswith("unix:"):
        return
    if not is_loopback(listen.rpartition(":")[0]):
        raise ConfigError(f"node agent control API on {listen!r} without a token: set "
                          f"{TOKEN_ENV} (every client sends it) or pass --allow-open",
                          name="listen", value=listen, limit="loopback, or a token")


class ControlServer:
    """Serves ``agent`` on ``HOST:PORT`` or ``unix:PATH``; ``address`` is set once listening.
    With ``token`` every op must carry ``"token": <it>`` (compared in constant time) or is
    answered 401."""

    def __init__(self, agent: NodeAgent, listen: str, token: str | None = None) -> None:
        self.agent, self.listen, self.token = agent, listen, token
        self.address: str | None = None
        self._server: asyncio.base_events.Server | None = None

    def _authorise(self, msg: dict[str, Any]) -> None:
        if self.token is None:
            return
        given = msg.get("token")
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(),
                                                                 self.token.encode()):
            raise Unauthorized(f"control API: token {'missing' if given is None else 'wrong'} "
                               f"(clients send ${TOKEN_ENV})", field="token")

    async def start(self) -> str:
        if self.listen.startswith("unix:"):
            self._server = await asyncio.start_unix_server(self._connection, path=self.listen[5:])
            self.address = self.listen
        else:
            host, _, port = self.listen.rpartition(":")
            self._server = await asyncio.start_server(self._connection, host or "127.0.0.1",
                                                      int(port))
            bound = self._server.sockets[0].getsockname()
            self.address = f"{bound[0]}:{bound[1]}"
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self.listen.startswith("unix:"):
            Path(self.listen[5:]).unlink(missing_ok=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for msg in read_messages(reader, Decoder()):
                rid = reply_id(msg.get("id"))
                try:
                    self._authorise(msg)
                    op, args = _args(msg)
                    result = await loop.run_in_executor(None, dispatch, self.agent, op, args)
                    writer.write(pack({"id": rid, "type": "result", "result": result}))
                except RewarmError as exc:
                    writer.write(pack(error_message(rid, exc.code, exc.message)))
                except Exception as exc:  # a bug: answer it, keep serving
                    log.exception("control op failed")
                    writer.write(pack(error_message(rid, 500, f"{type(exc).__name__}: {exc}")))
                await writer.drain()
        except ProtocolError as exc:
            writer.write(pack(error_message(None, exc.code, exc.message)))
        except ConnectionError:
            pass
        except asyncio.CancelledError:
            # The server is stopping with this op in flight (rewarm up interrupted mid-restore):
            # the client sees the connection close.  Ending quietly matters on Python 3.11,
            # whose streams callback calls task.exception() on a cancelled handler task and
            # prints that as an "Exception in callback" traceback.
            pass
        finally:
            writer.close()
