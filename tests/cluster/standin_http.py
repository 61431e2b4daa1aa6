"""A tiny threaded HTTP server base for the Consul and Nomad stand-ins (tests only)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

MAX_BODY_BYTES = 1 << 20


class Reply(Exception):
    """Raise from a route to answer with ``status`` and a JSON (or text) body."""

    def __init__(self, status: int, body=None, headers: dict[str, str] | None = None):
        super().__init__(status)
        self.status, self.body, self.headers = status, body, headers or {}


class StandIn:
    """Runs ``self.route(method, path, query, body, headers) -> (status, body, headers)``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.requests: list[tuple[str, str, dict]] = []
        self.peers: list[tuple[str, str]] = []          # (client address, path) per request
        self.failures: list[tuple[int, str, str, dict]] = []   # (status, prefix, body, headers)
        self.delay_s = 0.0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True   # one reply, not a 40 ms delayed-ACK stall

            def log_message(self, *args):  # quiet
                pass

            def _handle(self, method):
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    status, body, headers = 413, "request body too large", {}
                else:
                    raw = self.rfile.read(length) if length else b""
                    with owner.lock:
                        owner.peers.append((self.client_address[0], url.path))
                    status, body, headers = owner.dispatch(method, url.path, query, raw,
                                                           dict(self.headers))
                data = body if isinstance(body, bytes) else (
                    body.encode() if isinstance(body, str) else json.dumps(body).encode())
                self.send_response(status)
                ctype = "text/plain" if isinstance(body, (str, bytes)) else "application/json"
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._handle("GET")

            def do_PUT(self):
                self._handle("PUT")

            def do_POST(self):
                self._handle("POST")

            def do_DELETE(self):
                self._handle("DELETE")

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                import sys

                if isinstance(sys.exc_info()[1], ConnectionError):
                    return          # the client went away (a timeout, a killed task)
                super().handle_error(request, client_address)

        self.server = Server((host, port), Handler)
        self.server.daemon_threads = True
        self.host, self.port = self.server.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail_next(self, status: int, path_prefix: str = "/", times: int = 1,
                  body: str = "injected failure", headers: dict[str, str] | None = None) -> None:
        """Answer the next ``times`` requests under ``path_prefix`` with ``status`` (and
        ``headers``, e.g. ``Retry-After``)."""
        with self.lock:
            self.failures.extend([(status, path_prefix, body, dict(headers or {}))] * times)

    def dispatch(self, method, path, query, raw, headers):
        if self.delay_s:
            import time

            time.sleep(self.delay_s)        # a slow server (client timeouts)
        with self.lock:
            self.requests.append((method, path, query))
            for i, (status, prefix, body, extra) in enumerate(self.failures):
                if path.startswith(prefix):
                    del self.failures[i]
                    return status, body, extra
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return 400, "request body is not JSON", {}
        try:
            result = self.route(method, path, query, body, headers)
        except Reply as r:
            return r.status, r.body if r.body is not None else "", r.headers
        if isinstance(result, tuple):
            return result
        return 200, result, {}

    def route(self, method, path, query, body, headers):  # pragma: no cover - overridden
        raise Reply(404, "no route")
