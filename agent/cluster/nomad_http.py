"""python-nomad, configured once, and its failures as rewarm's typed errors.

``nomad_client`` honours ``NOMAD_ADDR``, ``NOMAD_TOKEN``, ``NOMAD_NAMESPACE``,
``NOMAD_REGION`` (python-nomad reads them itself) and the TLS variables ``NOMAD_CACERT``,
``NOMAD_CLIENT_CERT``, ``NOMAD_CLIENT_KEY`` and ``NOMAD_SKIP_VERIFY`` (Nomad's "Environment
Variables" for its CLI and API clients; python-nomad takes ``verify`` and ``cert``).  In a
Nomad task, ``NOMAD_TOKEN`` is the workload identity token (``identity { env = true }``).

:func:`nomad_error` turns an exception from python-nomad into:

- :class:`~agent.errors.AclDenied` for 401 and 403 (naming the endpoint and the capability);
- :class:`~agent.errors.ClusterError` otherwise, ``status`` set, the cause's text in the
  message (a timeout says it was a timeout, and after how long), ``retryable`` for 429, 5xx
  and transport failures, ``retry_after_s`` from a ``Retry-After`` header (seconds or an
  HTTP date) capped at :data:`RETRY_AFTER_MAX_S`.
"""

from __future__ import annotations

import email.utils
import os
import time

import nomad
import nomad.api.exceptions as nexc

from agent.errors import AclDenied, ClusterError

RETRY_AFTER_MAX_S = 60.0
"""The longest ``Retry-After`` honoured: a server asking for more gets this (a misconfigured
proxy must not park the predictor for an hour)."""
TIMEOUT_S = 5.0


def nomad_client(address: str | None = None, token: str | None = None,
                 namespace: str | None = None, region: str | None = None,
                 timeout_s: float = TIMEOUT_S) -> nomad.Nomad:
    """A python-nomad client; unset arguments fall back to the NOMAD_* variables."""
    verify: bool | str = os.environ.get("NOMAD_SKIP_VERIFY", "").lower() not in ("1", "true")
    if verify and os.environ.get("NOMAD_CACERT"):
        verify = os.environ["NOMAD_CACERT"]
    cert: tuple[str, str] | tuple[()] = ()
    if os.environ.get("NOMAD_CLIENT_CERT") and os.environ.get("NOMAD_CLIENT_KEY"):
        cert = (os.environ["NOMAD_CLIENT_CERT"], os.environ["NOMAD_CLIENT_KEY"])
    return nomad.Nomad(address=address, token=token, namespace=namespace, region=region,
                       timeout=timeout_s, verify=verify, cert=cert)


def status_of(exc: BaseException) -> int | None:
    return getattr(getattr(exc, "nomad_resp", None), "status_code", None)


def cause_of(exc: BaseException) -> str:
    """The response text, or the transport error with its own cause (``ReadTimeout(...)``)."""
    resp = getattr(exc, "nomad_resp", None)
    text = getattr(resp, "text", None)
    if text is None:
        inner = resp if isinstance(resp, BaseException) else exc
        text = f"{type(inner).__name__}: {inner}"
    text = " ".join(str(text).split())
    return text if len(text) <= 300 else text[:297] + "..."


def retry_after_s(exc: BaseException, now_unix: float | None = None) -> float | None:
    """``Retry-After`` of the failed response in seconds (bounded), or None."""
    headers = getattr(getattr(exc, "nomad_resp", None), "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    if not value:
        return None
    try:
        wait = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value).timestamp()
        except (TypeError, ValueError):
            return None
        wait = when - (time.time() if now_unix is None else now_unix)
    if wait != wait:   # NaN
        return None
    return min(RETRY_AFTER_MAX_S, max(0.0, wait))


def nomad_error(exc: BaseException, endpoint: str, needs: str) -> ClusterError:
    """The typed error for ``exc`` raised on ``endpoint`` (``needs``: the ACL capability)."""
    status = status_of(exc)
    if status in (401, 403) or isinstance(exc, nexc.URLNotAuthorizedNomadException):
        return AclDenied(f"nomad: ACL token (NOMAD_TOKEN) denied {endpoint} ({status}); it "
                         f"needs {needs}: {cause_of(exc)}", service="nomad", status=status,
                         endpoint=endpoint)
    retryable = status is None or status == 429 or status >= 500
    return ClusterError(f"nomad: {endpoint} failed ({status or 'no response'}): "
                        f"{cause_of(exc)}", service="nomad", status=status, endpoint=endpoint,
                        retryable=retryable, retry_after_s=retry_after_s(exc))
