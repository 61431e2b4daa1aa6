"""A blocking request/answer client over the wire's framing (CLI, node agent, predictor,
tests): one connection, one request, every answer up to the final one."""

from __future__ import annotations

from typing import Any

from agent.errors import ConfigError, Unreachable
from agent.wire.framing import Decoder, pack

def unreachable(service: str, address: str, exc: OSError, hint: str = "") -> Unreachable:
    """The :class:`Unreachable` for a failed connect to ``service`` at ``address``: the
    message names both, the OS error's text and, when given, ``hint`` (what to do)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return Unreachable(f"cannot reach {service} at {address}: {reason}"
                       + (f" ({hint})" if hint else ""), service=service, address=address,
                       reason=reason, errno=exc.errno, status=None)


def request(address: str, message: dict[str, Any], *, timeout_s: float = 120.0,
            service: str = "server", hint: str = "") -> list[dict[str, Any]]:
    """Blocking one-request client shared by the CLI, the node agent, the predictor and tests.

    ``address`` is ``host:port`` or ``unix:PATH``.  Sends ``message`` and returns every answer
    up to and including the final one (type ``done``, ``error`` or ``result``).
    Raises ConfigError for an address of neither form, :class:`~agent.errors.Unreachable` (a
    ConnectionError naming ``service``, the address and ``hint``) when nothing answers there,
    TimeoutError (after ``timeout_s`` without progress), ConnectionError (closed before a
    final answer), ProtocolError for a malformed answer.
    """
    import socket

    target: str | tuple[str, int]
    if address.startswith("unix:"):
        family, target = socket.AF_UNIX, address[len("unix:"):]
    else:
        host, _, port = address.rpartition(":")
        if not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"{service} address {address!r} is not HOST:PORT (port 1..65535) "
                              "or unix:PATH", name="address", value=address,
                              limit="HOST:PORT or unix:PATH")
        family, target = socket.AF_INET, (host or "127.0.0.1", int(port))
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    decoder, answers = Decoder(), []
    with sock:
        try:
            sock.connect(target)
        except TimeoutError:
            raise
        except OSError as exc:
            raise unreachable(service, address, exc, hint) from exc
        sock.sendall(pack(message))
        while True:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError(f"{address} closed the connection before answering")
            for answer in decoder.feed(data):
                answers.append(answer)
                if answer.get("type") in ("done", "error", "result"):
                    return answers
