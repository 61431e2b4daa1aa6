"""systemd's readiness protocol, written by hand: one datagram to ``$NOTIFY_SOCKET``.

sd_notify(3): the service manager passes the path of a ``SOCK_DGRAM`` Unix socket in
``NOTIFY_SOCKET`` (a leading ``@`` means Linux's abstract namespace); a service sends
newline-separated ``KEY=VALUE`` assignments: ``READY=1`` once it serves (``Type=notify``),
``STOPPING=1`` when it starts to shut down, ``WATCHDOG=1`` at least every ``WATCHDOG_USEC``
microseconds (``WatchdogSec=``), ``STATUS=...`` free text for ``systemctl status``.
Without ``NOTIFY_SOCKET`` (not under systemd) every call is a no-op returning False.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*assignments: str) -> bool:
    """Send ``assignments`` (``"READY=1"``...) in one datagram; False when not under systemd
    or the send failed (logged at debug: a manager that went away must not stop a service)."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path or not assignments:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(assignments).encode(), address)
        return True
    except OSError as exc:
        log.debug("sd_notify to %s failed: %s", path, exc)
        return False


def ready(status: str | None = None) -> bool:
    return notify("READY=1", *([f"STATUS={status}"] if status else []))


def stopping(status: str | None = None) -> bool:
    return notify("STOPPING=1", *([f"STATUS={status}"] if status else []))


def watchdog() -> bool:
    return notify("WATCHDOG=1")


def watchdog_interval_s() -> float | None:
    """Half of ``WATCHDOG_USEC`` in seconds (sd_watchdog_enabled(3) advises pinging at half
    the timeout), or None when the watchdog is off or meant for another process
    (``WATCHDOG_PID`` names a different pid)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None
