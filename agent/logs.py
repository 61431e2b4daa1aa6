"""Log setup shared by every command: ``--log-format text`` (as before) or ``json``.

JSON: one object per line with ``time`` (RFC 3339, UTC, milliseconds), ``level``,
``component`` (the logger's name below ``agent.``, e.g. ``node.agent``), ``message``, and any
of :data:`FIELDS` given through ``extra=`` (``log.info("warm", extra={"model": m})``); an
exception adds ``exc`` (the formatted traceback).  Nothing is printed twice: the handler
replaces the root logger's handlers.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

FIELDS = ("model", "replica", "request_id", "node", "snapshot", "path", "tier", "code",
          "tenant", "device")
"""The record attributes copied into a JSON line when present (``extra=`` keys)."""

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object per record (module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, object] = {"time": f"{stamp}.{int(record.msecs):03d}Z", "level": record.levelname,
               "component": record.name.removeprefix("agent."),
               "message": record.getMessage()}
        for key in FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value if isinstance(value, (int, float, bool)) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Configure the root logger for ``fmt`` (:data:`FORMATS`).  Raises ValueError for an
    unknown format (argparse's ``choices`` stops it before)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {FORMATS}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
