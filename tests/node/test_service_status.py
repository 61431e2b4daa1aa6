"""agent/node/service.py's serve(): the status port with the agent's own metrics, READY=1 and
STOPPING=1 to systemd's socket, and a clean stop."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import urllib.error
import urllib.request

import pytest

from agent.errors import ConfigError
from agent.node.service import serve


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_serve_with_status_port_and_notify(make_agent, tmp_path, monkeypatch, capsys):
    agent = make_agent()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(30)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    done = threading.Event()

    def run():
        try:
            loop.run_until_complete(serve(agent, f"unix:{tmp_path}/agent.sock", stop,
                                          metrics_listen="127.0.0.1:0"))
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert notify.recv(4096).startswith(b"READY=1\nSTATUS=control API on unix:")
        line = capsys.readouterr().out
        url = re.search(r"metrics on (http://\S+)/metrics", line).group(1)
        agent.tick()
        assert _get(url + "/readyz") == (200, "ready\n")
        code, body = _get(url + "/metrics")
        assert code == 200 and 'rewarm_node_zygotes_ready{node="n1"}' in body
        assert _get(url + "/x")[0] == 404
    finally:
        loop.call_soon_threadsafe(stop.set)
        assert done.wait(60)
    assert notify.recv(4096).startswith(b"STOPPING=1")
    notify.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/healthz", timeout=2)


def test_metrics_port_in_use_is_a_config_error(make_agent, tmp_path):
    agent = make_agent()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
        asyncio.run(serve(agent, f"unix:{tmp_path}/a.sock", asyncio.Event(),
                          metrics_listen=f"127.0.0.1:{port}"))
    taken.close()
