"""Log setup shared by every command: ``--log-format text`` or ``json``.

JSON: one object per line with ``time`` (RFC 3339, UTC, milliseconds), ``level``,
``component`` (the logger's name below ``agent.``, e.g. ``node.agent``), ``message``, and any
of :data:`FIELDS` given through ``extra=`` (``log.info("warm", extra={"model": m})``); an
exception adds ``exc`` (the formatted traceback).  Nothing is printed twice: the handler
replaces the root logger's handlers.

A command's own lines for a person (a banner such as "front door listening on ...", an
``error: ...`` line) go through :func:`say` and :func:`error`: plain text on stdout / stderr
under ``text``, a JSON log object on stderr under ``json``, so that under ``json`` every
line a process writes to stderr parses.  Results a command prints for a program (JSON
documents, generated text) stay on stdout as they are.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import TextIO

FIELDS = ("model", "replica", "request_id", "node", "snapshot", "path", "tier", "code",
          "tenant", "device", "address", "exit_code")
"""The record attributes copied into a JSON line when present (``extra=`` keys)."""

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

_state = {"format": "text"}
_SAY = logging.getLogger("agent.say")


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


def level_name(value: str) -> str:
    """``--log-level`` in any case (``debug``, ``Info``): the upper-case name.  Raises
    argparse.ArgumentTypeError, a ValueError whose message argparse's usage error shows
    (a plain ValueError's it replaces with 'invalid level_name value'), for another word."""
    name = value.strip().upper()
    if name not in LEVELS:
        raise argparse.ArgumentTypeError(
            f"log level {value!r} is not one of {', '.join(LEVELS)}")
    return name


def setup(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Configure the root logger for ``fmt`` (:data:`FORMATS`) at ``level`` (any case).
    Raises ValueError for an unknown format or level (argparse stops both before)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {FORMATS}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_name(level))
    _state["format"] = fmt


def json_format() -> bool:
    """Whether this process logs JSON (:func:`setup` was called with ``json``)."""
    return _state["format"] == "json"


def say(message: str, **fields) -> None:
    """A line for the person running the command (a banner): stdout under ``text``, an INFO
    object (``component`` ``say``, ``fields`` as in :data:`FIELDS`) under ``json``."""
    if json_format():
        _SAY.info(message, extra=fields)
    else:
        print(message, flush=True)


def error(message: str, **fields) -> None:
    """``error: <message>`` on stderr under ``text``; an ERROR object under ``json``."""
    if json_format():
        _SAY.error(message, extra=fields)
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)
