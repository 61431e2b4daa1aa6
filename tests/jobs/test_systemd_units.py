"""jobs/systemd/*.service: the hardening each unit must keep, drain and stop timeouts that
match, and (where systemd-analyze is installed) its offline security exposure <= 5.0."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS = sorted((Path(__file__).resolve().parents[2] / "jobs" / "systemd").glob("*.service"))
MAX_EXPOSURE = 5.0


def directives(path: Path) -> dict[str, list[str]]:
    """``{"Section.Key": [values...]}`` (repeated keys kept in order)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def test_there_are_three_units():
    assert [u.name for u in UNITS] == ["rewarm-agent.service", "rewarm-frontdoor.service",
                                       "rewarm-predictor.service"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_hardening_and_limits(unit):
    d = directives(unit)
    one = lambda key: d[f"Service.{key}"][-1]  # noqa: E731
    assert one("Type") == "notify" and one("NotifyAccess") == "main"
    for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("PrivateTmp", "yes"), ("ProtectHome", "yes"),
                       ("LimitNOFILE", "65536"), ("CapabilityBoundingSet", "")):
        assert one(key) == value, key
    assert "/var/lib/rewarm" in d["Service.ReadWritePaths"]
    assert one("User") == "rewarm"


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_stop_timeout_covers_the_drain(unit):
    d = directives(unit)
    stop_s = float(d["Service.TimeoutStopSec"][-1].removesuffix("s"))
    grace = re.search(r"--drain-grace-s (\d+)", d["Service.ExecStart"][-1])
    if grace:
        assert float(grace.group(1)) == 30.0               # the flag's default everywhere
        assert float(grace.group(1)) < stop_s <= float(grace.group(1)) + 15


def test_agent_reaches_the_gpus_and_the_others_reach_no_device():
    agent = directives(UNITS[0])
    assert "Service.PrivateDevices" not in agent
    assert agent["Service.DevicePolicy"] == ["closed"]
    allowed = " ".join(agent["Service.DeviceAllow"])
    for dev in ("char-nvidia-frontend", "char-nvidia-uvm", "/dev/nvidiactl"):
        assert dev in allowed
    assert agent["Service.WatchdogSec"] == ["30s"]
    for unit in UNITS[1:]:
        assert directives(unit)["Service.PrivateDevices"] == ["yes"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_security_exposure(unit):
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)],
                         capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: ([\d.]+)", out.stdout + out.stderr)
    assert found, out.stdout + out.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE
