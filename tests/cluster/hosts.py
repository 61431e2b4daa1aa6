"""Three hosts on one machine for the cluster scenario (tests and bench/cluster_e2e.py).

Preferred: network namespaces (``ip netns``), each with a veth pair whose host end is on a
bridge in the root namespace; the bridge holds ``.1`` (where the Consul and Nomad stand-ins
listen), the hosts ``.11``, ``.12``, ``.13``.  Every name carries this process's id so that
two runs never collide, and :meth:`Hosts.close` deletes what was created.  Needs root; when a
step fails (no ``ip``, no permission, no connectivity through the bridge), what was made is
removed and the hosts fall back to distinct loopback addresses 127.0.0.11-13 with the
stand-ins on 127.0.0.1.  ``kind`` says which ran: ``"netns"`` or ``"loopback"``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
from dataclasses import dataclass, field


@dataclass
class Host:
    name: str
    address: str
    netns: str | None = None


@dataclass
class Hosts:
    kind: str
    server_address: str           # where the stand-ins listen
    hosts: list[Host] = field(default_factory=list)
    reason: str = ""              # why namespaces were not used, when they were not
    _made: list[list[str]] = field(default_factory=list)   # undo commands

    def close(self) -> None:
        for cmd in reversed(self._made):
            subprocess.run(cmd, capture_output=True, timeout=10)
        self._made.clear()


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.returncode}")


def _reachable(netns: str, address: str, port: int) -> bool:
    """Whether a TCP connection from inside ``netns`` reaches ``address:port``."""
    code = (f"import socket; socket.create_connection(({address!r}, {port}), timeout=2)")
    import sys

    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", code],
                         capture_output=True, timeout=20)
    return out.returncode == 0


def _loopback(reason: str, n: int) -> Hosts:
    return Hosts("loopback", "127.0.0.1",
                 [Host(f"h{i + 1}", f"127.0.0.{11 + i}") for i in range(n)], reason)


def make_hosts(n: int = 3, *, prefer_netns: bool = True) -> Hosts:
    """``n`` hosts as network namespaces, or loopback addresses (see the module docstring)."""
    if not prefer_netns:
        return _loopback("namespaces not asked for", n)
    if shutil.which("ip") is None:
        return _loopback("no `ip` command", n)
    if os.geteuid() != 0:
        return _loopback("not root", n)
    tag = f"{os.getpid() % 100000}"
    subnet = f"10.231.{os.getpid() % 250}"
    bridge = f"rwbr{tag}"
    hosts = Hosts("netns", f"{subnet}.1")
    try:
        _run(["ip", "link", "add", bridge, "type", "bridge"])
        hosts._made.append(["ip", "link", "del", bridge])
        _run(["ip", "addr", "add", f"{subnet}.1/24", "dev", bridge])
        _run(["ip", "link", "set", bridge, "up"])
        for i in range(n):
            ns, outside = f"rw{tag}h{i + 1}", f"rwv{tag}{i + 1}"
            _run(["ip", "netns", "add", ns])
            hosts._made.append(["ip", "netns", "del", ns])
            _run(["ip", "link", "add", outside, "type", "veth", "peer", "name", "eth0",
                  "netns", ns])
            hosts._made.append(["ip", "link", "del", outside])
            _run(["ip", "link", "set", outside, "master", bridge])
            _run(["ip", "link", "set", outside, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{subnet}.{11 + i}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "route", "add", "default", "via", f"{subnet}.1"])
            hosts.hosts.append(Host(f"h{i + 1}", f"{subnet}.{11 + i}", ns))
        # A listener on the bridge address, reached from the first namespace.
        probe = socket.socket()
        probe.bind((hosts.server_address, 0))
        probe.listen(1)
        accept = threading.Thread(target=lambda: probe.accept(), daemon=True)
        accept.start()
        ok = _reachable(hosts.hosts[0].netns, hosts.server_address, probe.getsockname()[1])
        probe.close()
        if not ok:
            raise RuntimeError("no TCP connectivity from a namespace to the bridge")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        hosts.close()
        return _loopback(f"network namespaces unavailable: {exc}", n)
    return hosts
