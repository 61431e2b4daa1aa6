"""py-consul, configured from Consul's own environment variables, and its failures typed.

:func:`consul_client` honours (Consul "Commands: Environment Variables"):
``CONSUL_HTTP_ADDR`` (``host:port`` or ``scheme://host:port``), ``CONSUL_HTTP_SSL``
(``true``: https when the address names no scheme), ``CONSUL_HTTP_SSL_VERIFY`` (``false``:
no certificate check), ``CONSUL_CACERT`` (CA bundle to verify with), ``CONSUL_CLIENT_CERT``
and ``CONSUL_CLIENT_KEY`` (mutual TLS) and ``CONSUL_HTTP_TOKEN``.  ``CONSUL_CAPATH`` (a
directory of CAs) is passed to requests as the verify path too.

py-consul raises from a status code alone, so the client's HTTP layer keeps the headers of
the last failed response on the calling thread; :func:`cluster_error` reads its
``Retry-After`` (bounded by :data:`RETRY_AFTER_MAX_S`).  401 and 403 are
:class:`~agent.errors.AclDenied`; a transport failure keeps its cause (``ReadTimeout`` after
N s, ``Connection refused``).
"""

from __future__ import annotations

import email.utils
import os
import re
import threading
import time

import consul
import consul.exceptions
import consul.std

from agent.cluster.nomad_http import RETRY_AFTER_MAX_S
from agent.errors import AclDenied, ClusterError

TIMEOUT_S = 10.0
_last = threading.local()


class _HTTPClient(consul.std.HTTPClient):
    """py-consul's requests client, remembering a failed response's headers per thread."""

    def response(self, response, raw: bool = False):
        _last.headers = dict(response.headers) if response.status_code >= 400 else {}
        return super().response(response, raw=raw)


class _Consul(consul.Consul):
    def http_connect(self, host, port, scheme, verify=True, cert=None):
        return _HTTPClient(host, port, scheme, verify, cert, connections_timeout=TIMEOUT_S)


def _true(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value is None or value == "" else value.strip().lower() in ("1", "true")


def consul_client(address: str | None = None, token: str | None = None) -> consul.Consul:
    """A py-consul client for ``address`` (default ``CONSUL_HTTP_ADDR`` or 127.0.0.1:8500)."""
    address = address or os.environ.get("CONSUL_HTTP_ADDR") or "127.0.0.1:8500"
    scheme = "https" if _true("CONSUL_HTTP_SSL") else "http"
    if "://" in address:
        scheme, address = address.split("://", 1)
    host, _, port = address.rpartition(":")
    verify: bool | str = _true("CONSUL_HTTP_SSL_VERIFY") is not False
    if verify and (os.environ.get("CONSUL_CACERT") or os.environ.get("CONSUL_CAPATH")):
        verify = os.environ.get("CONSUL_CACERT") or os.environ["CONSUL_CAPATH"]
    cert = None
    if os.environ.get("CONSUL_CLIENT_CERT") and os.environ.get("CONSUL_CLIENT_KEY"):
        cert = (os.environ["CONSUL_CLIENT_CERT"], os.environ["CONSUL_CLIENT_KEY"])
    return _Consul(host=host or address, port=int(port or 8500), scheme=scheme,
                   token=token or os.environ.get("CONSUL_HTTP_TOKEN"), verify=verify, cert=cert)


def retry_after_s() -> float | None:
    """``Retry-After`` of the last failed response on this thread (seconds, bounded)."""
    value = (getattr(_last, "headers", None) or {}).get("Retry-After")
    if not value:
        return None
    try:
        wait = float(value)
    except ValueError:   # RFC 9110 10.2.3: delay-seconds or an HTTP-date
        try:
            wait = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    if wait != wait:     # NaN: max(0.0, nan) would be 0.0, "retry at once"
        return None
    return min(RETRY_AFTER_MAX_S, max(0.0, wait))


def cluster_error(exc: Exception, endpoint: str) -> ClusterError:
    """Translate a py-consul or transport exception into rewarm's typed error."""
    if isinstance(exc, (consul.exceptions.ACLPermissionDenied, consul.exceptions.ACLDisabled)):
        denied = 401 if isinstance(exc, consul.exceptions.ACLDisabled) else 403
        return AclDenied(f"consul: ACL token (CONSUL_HTTP_TOKEN) denied {endpoint} ({denied}):"
                         f" {exc}", service="consul", endpoint=endpoint, status=denied)
    status: int | None = None
    m = re.match(r"(\d{3}) ", str(exc))
    if m:
        status = int(m[1])
    retryable = status is None or status == 429 or status >= 500
    return ClusterError(f"consul: {endpoint} failed: {_reason(exc)}", service="consul",
                        endpoint=endpoint, status=status, retryable=retryable,
                        retry_after_s=retry_after_s() if status else None)


def _reason(exc: Exception) -> str:
    """The short reason of a failure, its cause kept: urllib3's "Max retries exceeded ...
    (Caused by NewConnectionError(...: [Errno 111] Connection refused))" becomes "cannot
    connect to HOST:PORT: [Errno 111] Connection refused"; a timeout names itself."""
    text = " ".join(str(exc).split())
    pool = re.search(r"host='([^']*)', port=(\d+)", text)
    cause = re.search(r"(\[Errno -?\d+\][^)'\"]*)", text)
    if pool and cause:
        return f"cannot connect to {pool[1]}:{pool[2]}: {cause[1].strip()}"
    if not isinstance(exc, consul.exceptions.ConsulException):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 300 else text[:297] + "..."


def next_index(sent: int | None, got: object) -> int:
    """The index to send with the next blocking read (Consul "Blocking Queries",
    implementation details): 0 (or garbage) becomes 1, so that the next read blocks; a
    positive index lower than ``sent`` resets the watch (0: a plain read next)."""
    try:
        value = int(got)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        value = 0
    if value <= 0:
        return 1
    if sent is not None and value < sent:
        return 0
    return value
