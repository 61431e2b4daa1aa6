"""A TCP listener that keeps answering at the descriptor limit: its own accept loop, a
reserve descriptor for the emergency refusal, and accept errors logged once per interval.

asyncio's own server, out of descriptors (EMFILE), logs every failed ``accept`` and stops
accepting for a second while the backlog fills, so clients hang and the log floods.  Here:

- the connection cap in force is ``min(max_connections, RLIMIT_NOFILE soft - reserve -
  descriptors in use at start - replica links)``; a connection past it is handed to the
  entrance as over the cap (it answers 429 and closes gracefully);
- when ``accept`` fails with EMFILE/ENFILE anyway, the reserve descriptor (``/dev/null``,
  opened at start) is closed, the waiting connection accepted, sent ``refusal`` and closed
  at once, and the reserve reopened: a client at the limit gets its 429, never a hang (the
  classic "idle descriptor" technique, as libev and nginx users apply it);
- accept errors are counted and logged at most once per ``log_interval_s`` with the count.

The descriptor arithmetic follows getrlimit(2): descriptors are numbered below the soft
``RLIMIT_NOFILE``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import socket
from collections.abc import Callable

from agent.clock import Clock

log = logging.getLogger(__name__)

_OUT_OF_FDS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_TRANSIENT = {errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN}
ACCEPTS_PER_WAKEUP = 64


def tune_keepalive(sock: socket.socket, *, idle_s: float, interval_s: float,
                   count: int) -> None:
    """TCP keepalive on ``sock`` with its timers set (tcp(7): ``TCP_KEEPIDLE`` seconds idle
    before the first probe, ``TCP_KEEPINTVL`` seconds between probes, ``TCP_KEEPCNT`` probes
    unanswered before the kernel drops the connection).  A peer that vanished (its host
    powered off, a NAT forgot the flow) is then found after ``idle_s + interval_s * count``
    seconds, not the kernel default of 7,200 s + 9 x 75 s.  Platforms without the options
    (they are Linux's; macOS spells the first TCP_KEEPALIVE) keep their defaults; a Unix
    socket is left as it is."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s),
                        ("TCP_KEEPCNT", count)):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, max(1, int(value)))


def open_descriptors() -> int:
    """Descriptors open in this process now (Linux: /proc/self/fd; elsewhere 0)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir holds
    except OSError:
        return 0


class Listener:
    """Accepts on ``host:port`` and hands each accepted socket to ``on_socket(sock,
    over_cap)``; ``refusal`` is what a connection accepted on the reserve descriptor is sent.
    ``in_use()`` gives the connections (and other descriptors, such as replica links) held
    now, counted against the cap."""

    def __init__(self, host: str, port: int, *, max_connections: int, reserve: int,
                 clock: Clock, refusal: bytes,
                 on_socket: Callable[[socket.socket, bool], None],
                 in_use: Callable[[], int], log_interval_s: float = 10.0) -> None:
        self.host, self.port = host, port
        self.max_connections, self.reserve = max_connections, reserve
        self.clock, self.refusal = clock, refusal
        self.on_socket, self.in_use = on_socket, in_use
        self.log_interval_s = log_interval_s
        self.sock: socket.socket | None = None
        self.cap = max_connections
        self.shed_at_limit = 0     # connections answered on the reserve descriptor
        self._spare: int | None = None
        self._errors = 0
        self._last_error = ""
        self._logged_s = float("-inf")
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> tuple[str, int]:
        """Bind, listen and start accepting; returns the bound ``(host, port)``."""
        self._loop = asyncio.get_running_loop()
        self.sock = socket.create_server((self.host, self.port), backlog=1024,
                                         family=socket.AF_INET6 if ":" in self.host
                                         else socket.AF_INET)
        self.sock.setblocking(False)
        self._spare = os.open(os.devnull, os.O_RDONLY)
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            room = soft - self.reserve - open_descriptors()
            self.cap = max(1, min(self.max_connections, room))
        log.info("front door: at most %d client connections (max_connections %d, "
                 "RLIMIT_NOFILE soft %s, %d descriptors reserved)", self.cap,
                 self.max_connections, "unlimited" if soft == resource.RLIM_INFINITY else soft,
                 self.reserve)
        self._loop.add_reader(self.sock.fileno(), self._accept)
        return self.address

    def _started(self) -> tuple[socket.socket, asyncio.AbstractEventLoop]:
        """The listening socket and its loop; RuntimeError before :meth:`start`."""
        if self.sock is None or self._loop is None:
            raise RuntimeError("front door listener used before start()")
        return self.sock, self._loop

    @property
    def address(self) -> tuple[str, int]:
        sock, _ = self._started()
        return sock.getsockname()[:2]

    def close(self) -> None:
        if self.sock is not None and self._loop is not None:
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None
        self._flush_errors(force=True)

    def _accept(self) -> None:
        sock, _ = self._started()
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                conn, _addr = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._error(exc)
                if exc.errno in _OUT_OF_FDS:
                    if self._spare is None:      # nothing to answer with: pause, not spin
                        self._pause(0.05)
                    self._shed_on_reserve()
                    return
                if exc.errno in _TRANSIENT:
                    continue
                return
            conn.setblocking(False)
            self.on_socket(conn, self.in_use() >= self.cap)

    def _shed_on_reserve(self) -> None:
        """Out of descriptors: answer one waiting connection on the reserve descriptor."""
        if self._spare is None:
            return
        sock, loop = self._started()
        os.close(self._spare)
        self._spare = None
        conn: socket.socket | None
        try:
            conn, _addr = sock.accept()
        except OSError:
            conn = None
        if conn is not None:
            self.shed_at_limit += 1
            try:
                conn.setblocking(False)
                try:
                    conn.recv(65536)        # what it sent already: read, so close sends FIN
                except OSError:
                    pass
                conn.send(self.refusal)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            finally:
                conn.close()
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY)
        except OSError:
            self._spare = None           # reopened on the next call that finds one free
            loop.call_later(0.05, self._reopen_spare)

    def _pause(self, delay_s: float) -> None:
        sock, loop = self._started()
        fd = sock.fileno()
        loop.remove_reader(fd)
        loop.call_later(delay_s, lambda: sock.fileno() == fd and
                        loop.add_reader(fd, self._accept))

    def _reopen_spare(self) -> None:
        if self._spare is None:
            try:
                self._spare = os.open(os.devnull, os.O_RDONLY)
            except OSError:
                self._started()[1].call_later(0.05, self._reopen_spare)

    def _error(self, exc: OSError) -> None:
        self._errors += 1
        self._last_error = f"{type(exc).__name__}: {exc}"
        self._flush_errors()

    def _flush_errors(self, force: bool = False) -> None:
        """One log line per ``log_interval_s`` with the count since the last one."""
        now = self.clock.now()
        if self._errors and (force or now - self._logged_s >= self.log_interval_s):
            log.warning("accept failed %d time(s) in the last %.1f s (last: %s); "
                        "%d answered 429 on the reserve descriptor", self._errors,
                        min(now - self._logged_s, self.log_interval_s) if self._logged_s
                        > float("-inf") else 0.0, self._last_error, self.shed_at_limit)
            self._errors = 0
            self._logged_s = now

    def tick(self) -> None:
        """Flush a pending accept-error count once its interval is over (the sweeper)."""
        self._flush_errors()
