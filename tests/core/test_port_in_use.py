"""Every command that listens exits 78 (EX_CONFIG) when its port is taken: what the README's
exit-code table says and what the systemd units' RestartPreventExitStatus=78 stops a restart
loop on.  Under --log-format json the refusal is one JSON object on stderr."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from agent import exitcodes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def busy():
    """A port held by a listening socket for the test's length."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def _rewarm(*argv: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "REWARM_HTTP_PORT": "0", "REWARM_LOG_FORMAT": ""}
    return subprocess.run([sys.executable, "-m", "agent.cli", "--log-format", "json", *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


COMMANDS = {
    "frontdoor --port": lambda p: ["frontdoor", "--model", "m", "--port", str(p),
                                   "--no-http"],
    "frontdoor --http-port": lambda p: ["frontdoor", "--model", "m", "--port", "0",
                                        "--http-port", str(p)],
    "frontdoor --metrics-port": lambda p: ["frontdoor", "--model", "m", "--port", "0",
                                           "--no-http", "--metrics-port", str(p)],
    "predictor --metrics-port": lambda p: ["predictor", "--model", "m", "--metrics-port",
                                           str(p), "--ticks", "1"],
    "up --port": lambda p: ["up", "--port", str(p)],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_port_in_use_exits_78_with_one_json_line(command, busy, tmp_path):
    proc = _rewarm(*COMMANDS[command](busy), tmp_path=tmp_path)
    assert proc.returncode == exitcodes.EX_CONFIG == 78, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stderr.splitlines() if line.strip()]
    errors = [r for r in lines if r["level"] == "ERROR"]
    assert len(errors) == 1 and str(busy) in errors[0]["message"]
    assert errors[0]["exit_code"] == 78


def test_exit_code_maps_an_address_in_use_to_ex_config():
    import errno

    assert exitcodes.exit_code(OSError(errno.EADDRINUSE, "address already in use")) == 78
    assert exitcodes.exit_code(OSError(errno.EADDRNOTAVAIL, "cannot assign")) == 78
    assert exitcodes.exit_code(OSError(errno.EIO, "i/o error")) == exitcodes.EX_IOERR


def test_units_prevent_restart_on_78():
    for unit in sorted((REPO / "jobs" / "systemd").glob("*.service")):
        text = unit.read_text()
        if "ExecStart" in text:
            assert "RestartPreventExitStatus=78" in text, unit.name


def test_a_bad_allowed_origin_is_a_configuration_error(tmp_path):
    proc = _rewarm("frontdoor", "--model", "m", "--port", "0", "--http-port", "0",
                   "--allowed-origins", "ui.example/path", tmp_path=tmp_path)
    assert proc.returncode == exitcodes.EX_CONFIG, proc.stderr[-2000:]
    errors = [json.loads(line) for line in proc.stderr.splitlines()
              if line.strip() and json.loads(line)["level"] == "ERROR"]
    assert len(errors) == 1 and "ui.example/path" in errors[0]["message"]
