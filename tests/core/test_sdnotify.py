"""agent/sdnotify.py against a real datagram socket standing in for systemd's."""

import os
import socket

from agent import sdnotify


def test_ready_stopping_watchdog_are_datagrams(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert sdnotify.ready("serving on :7733")
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving on :7733"
        assert sdnotify.watchdog() and sock.recv(4096) == b"WATCHDOG=1"
        assert sdnotify.stopping() and sock.recv(4096) == b"STOPPING=1"


def test_abstract_socket(monkeypatch):
    name = f"rewarm-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready() and sock.recv(4096) == b"READY=1"


def test_not_under_systemd_or_manager_gone(tmp_path, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert sdnotify.ready() is False


def test_watchdog_interval(monkeypatch):
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "20000000")
    assert sdnotify.watchdog_interval_s() == 10.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert sdnotify.watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval_s() == 10.0
    monkeypatch.setenv("WATCHDOG_USEC", "0")
    assert sdnotify.watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert sdnotify.watchdog_interval_s() is None
