"""The HTTP status port every listening component serves: ``/metrics``, ``/healthz``, ``/readyz``.

* ``GET /metrics``: the Prometheus text exposition of the component's registry
  (prometheus-client's ``generate_latest``; OpenMetrics when the scraper asks for it).
* ``GET /healthz``: 200 ``ok`` while the process answers at all (liveness).
* ``GET /readyz``: 200 ``ready`` when the component can serve or restore now, else 503 with
  ``not ready: <reason>`` (readiness; a load balancer or Consul HTTP check takes it out).
* any other path: 404; any other method: 405.  (prometheus-client's own ``start_http_server``
  answers every path with the metrics body, so a health check pointed at it always passed.)

Served by a ``ThreadingHTTPServer`` in a daemon thread; the readiness callable is called on
that thread and must be cheap and thread-safe (it reads state, it never waits).
"""

from __future__ import annotations

import logging
import threading
from typing import cast
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

Readiness = Callable[[], "tuple[bool, str]"]
"""``() -> (ready, reason)``; ``reason`` says why not (any text when ready)."""


def always_ready() -> tuple[bool, str]:
    return True, "ready"


class StatusServer(ThreadingHTTPServer):
    """``server_address`` is the bound (host, port); :meth:`close` stops and unbinds."""

    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        """A request that failed (most often a scraper that closed its connection while the
        answer was written): logged, never printed.  socketserver's own handler prints the
        traceback to stderr, which is no log line (and no JSON under --log-format json)."""
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            log.debug("%s status port: client %s went away: %s", self.component,
                      client_address, exc)
        else:
            log.warning("%s status port: request from %s failed", self.component,
                        client_address, exc_info=True)

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry,
                 ready: Readiness, component: str) -> None:
        self.registry, self.ready, self.component = registry, ready, component
        super().__init__(address, _Handler)
        self._thread = threading.Thread(target=self.serve_forever, daemon=True,
                                        name=f"{component}-status")

    def start(self) -> StatusServer:
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        host, port = cast(tuple[str, int], self.server_address[:2])   # a TCP server
        return f"http://{host}:{port}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: StatusServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = urlsplit(self.path).path
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._send(200, encoder(self.server.registry), content_type)
        elif path == "/healthz":
            self._send(200, b"ok\n")
        elif path == "/readyz":
            try:
                ok, reason = self.server.ready()
            except Exception as exc:  # a readiness probe that fails is an answer: not ready
                ok, reason = False, f"readiness check failed: {type(exc).__name__}: {exc}"
            self._send(200 if ok else 503, (b"ready\n" if ok else
                                            f"not ready: {reason}\n".encode()))
        else:
            self._send(404, b"not found; paths: /metrics /healthz /readyz\n")

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def _other(self) -> None:
        self._send(405, b"method not allowed\n", extra={"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _other

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
              extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, fmt: str, *args) -> None:   # scrapes every few seconds: not INFO
        log.debug("%s status port: " + fmt, self.server.component, *args)


class _Union:
    """The metric families of several registries, each name once (the first registry's
    family wins: two components in one process both collect ``process_*``)."""

    def __init__(self, registries: tuple[CollectorRegistry, ...]) -> None:
        self.registries = registries

    def collect(self):
        seen: set[str] = set()
        for registry in self.registries:
            for family in registry.collect():
                if family.name not in seen:
                    seen.add(family.name)
                    yield family


def union(*registries: CollectorRegistry) -> CollectorRegistry:
    """One registry exposing every family of ``registries`` once (components sharing a
    process, as under ``rewarm up``, share one status port)."""
    out = CollectorRegistry(auto_describe=False)
    out.register(_Union(registries))
    return out


def serve_status(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0, *,
                 ready: Readiness | None = None, component: str = "rewarm") -> StatusServer:
    """Bind ``host:port`` (0: a free port) and serve ``registry``'s families and the
    process-wide registry's (each name once) in a daemon thread.  Raises OSError (its errno
    kept, the address named) when the address cannot be bound."""
    from prometheus_client import REGISTRY

    # the process-wide families too (rewarm_cluster_acl_denied, python_info, gc): every
    # process that talks to Consul or Nomad says whether its token is refused
    served = union(registry, REGISTRY) if registry is not REGISTRY else registry
    try:
        server = StatusServer((host, port), served, ready or always_ready, component)
    except OSError as exc:
        raise OSError(exc.errno, f"{component} status port cannot listen on {host}:{port}: "
                      f"{exc.strerror or exc}") from exc
    return server.start()
