"""Names and ids that go into Consul and Nomad URLs: checked before any URL is built.

Nomad job ids, Consul service names and ids, KV key segments and session ids that rewarm
builds from a model name or is handed by a caller must be 1..``MAX_NAME_CHARS`` of
``[A-Za-z0-9._-]`` and must not be ``.`` or ``..``: a ``/`` would walk to another endpoint
(``a/../../acl/bootstrap``), a ``#`` or ``?`` would cut the path (``m#frag`` scaling another
model's job), and ``None`` would be a raw TypeError deep inside a client library.
"""

from __future__ import annotations

import re

from agent.errors import ConfigError

MAX_NAME_CHARS = 128
"""Nomad's job id limit is 128 characters (structs.go ``maxJobIDLength`` area); Consul's
service names are DNS labels of at most 63, which model names used in tags also respect."""

NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]+")


def check_name(kind: str, value: object, max_chars: int = MAX_NAME_CHARS) -> str:
    """``value`` itself when it is a safe URL segment; else ConfigError naming ``kind``, the
    value and the limit."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{kind} {value!r} is not a non-empty string", name=kind,
                          value=value, limit=f"1..{max_chars} of [A-Za-z0-9._-]")
    if len(value) > max_chars:
        raise ConfigError(f"{kind} has {len(value)} characters; limit is {max_chars}",
                          name=kind, value=value[:40] + "...", limit=max_chars)
    if not NAME_PATTERN.fullmatch(value) or value in (".", ".."):
        raise ConfigError(f"{kind} {value[:80]!r} has characters outside [A-Za-z0-9._-] "
                          "(or is '.'/'..')", name=kind, value=value[:80],
                          limit="[A-Za-z0-9._-]")
    return value
