"""argparse types for the command line: numbers and addresses checked where they are typed.

A bad value becomes argparse's usage error (exit 2) naming the option, the value and the
limit, instead of a traceback from deep inside the command.
"""

from __future__ import annotations

import argparse
import ipaddress
import math


def _number(kind, text: str, low, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if value < low:
        raise argparse.ArgumentTypeError(f"{text} is below the limit {low}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (threads, counts, sizes)."""
    return _number(int, text, 1, "an integer")


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    return _number(int, text, 0, "an integer")


def nonneg_float(text: str) -> float:
    """A finite number >= 0 (rates that may be off)."""
    return _number(float, text, 0.0, "a number")


def positive_float(text: str) -> float:
    """A finite number > 0 (durations in seconds, rates, factors)."""
    value = _number(float, text, 0.0, "a number")
    if value == 0.0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def deadline_factor(text: str) -> float:
    """A finite number >= 1: a default deadline as a multiple of the TTFT SLO (agent/slo.py;
    one below 1 would refuse requests the SLO counts as met)."""
    return _number(float, text, 1.0, "a number")


def port(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port)."""
    value = _number(int, text, 0, "a port number")
    if value > 65535:
        raise argparse.ArgumentTypeError(f"port {value} is above the limit 65535")
    return value


def host_port(text: str) -> str:
    """``HOST:PORT`` with a port in 0..65535 (IPv6 hosts in brackets or bare)."""
    host, sep, number = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    try:
        port(number)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return text


def listen_address(text: str) -> str:
    """``HOST:PORT`` or ``unix:PATH`` (a replica's or agent's listening address)."""
    if text.startswith("unix:"):
        if len(text) == len("unix:"):
            raise argparse.ArgumentTypeError("unix: needs a socket path")
        return text
    try:
        return host_port(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (nor unix:PATH)") from None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address, bracketed or not, or ``localhost``) is loopback."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (torch's spelling of a device); anything else is refused
    here, before a process is started for it."""
    kind, sep, index = text.partition(":")
    if text == "cpu" or (kind == "cuda" and (not sep or index.isdigit())):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a device; expected cpu, cuda or cuda:N")
