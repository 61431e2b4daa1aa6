"""Optional shared-secret tokens per tenant, compared in constant time.

Without tokens the front door is open, and so listens on loopback unless told otherwise
(see :func:`check_bind`).
"""

from __future__ import annotations

import hmac
from pathlib import Path

from agent.argtypes import is_loopback  # noqa: F401  (moved there; re-exported)
from agent.errors import ConfigError, Unauthorized


class TokenAuth:
    """``tokens``: tenant -> secret.  :meth:`check` returns the tenant or raises
    :class:`Unauthorized` (401).  Every configured secret is compared (hmac.compare_digest),
    so the time taken does not depend on which tenant, or how much of a secret, matched."""

    def __init__(self, tokens: dict[str, str] | None = None) -> None:
        self._tokens = [(tenant, secret.encode()) for tenant, secret in (tokens or {}).items()]
        for tenant, secret in self._tokens:
            if len(secret) < 16:
                raise ConfigError(f"tenant {tenant!r}: token of {len(secret)} bytes is "
                                  f"shorter than 16", name="token", value=len(secret), limit=16)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def check(self, token: str | None) -> str | None:
        if not self._tokens:
            return None
        given = (token or "").encode()
        found = None
        for tenant, secret in self._tokens:
            if hmac.compare_digest(given, secret):
                found = tenant
        if found is None:
            raise Unauthorized("missing or wrong token", field="token", value=None,
                               limit="a configured tenant token")
        return found

    @classmethod
    def from_file(cls, path: Path | str) -> TokenAuth:
        """Lines ``tenant:token``; blank lines and ``#`` comments skipped.  Raises
        ConfigError naming the line for a malformed one."""
        tokens = {}
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            tenant, sep, secret = line.partition(":")
            if not sep or not tenant or not secret:
                raise ConfigError(f"{path}:{n}: expected tenant:token", name=str(path),
                                  value=n, limit="tenant:token")
            tokens[tenant] = secret
        return cls(tokens)


def check_bind(host: str, auth: TokenAuth, allow_open: bool) -> None:
    """Refuse to listen beyond loopback without tokens unless ``allow_open``.
    Raises ConfigError naming the host."""
    if auth.enabled or allow_open:
        return
    if not is_loopback(host):
        raise ConfigError(f"front door on {host!r} without tokens: pass --tokens or "
                          f"--allow-open", name="host", value=host, limit="loopback")
