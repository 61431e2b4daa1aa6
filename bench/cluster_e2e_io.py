"""Helpers of bench/cluster_e2e.py: the run's timeline, HTTP access to Consul and Nomad, and
the traffic that the scenario sends to the front door (rewarm's own client)."""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import requests  # noqa: E402

MODEL = "tiny"
PROMPT = [1, 2, 3, 4, 5]


class StepFailed(AssertionError):
    pass


@dataclass
class Run:
    t0: float = field(default_factory=time.monotonic)
    steps: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    results: dict = field(default_factory=dict)

    def at(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def step(self, name: str, ok: bool, detail: str = "") -> None:
        self.steps.append({"name": name, "ok": bool(ok), "at_s": self.at(), "detail": detail})
        print(f"[{self.at():7.2f}s] {'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            raise StepFailed(f"{name}: {detail}")


def wait_for(what: str, cond, timeout_s: float, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise StepFailed(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)


class Cluster:
    """HTTP access to Consul and Nomad (stand-ins or real), as the scenario needs it."""

    def __init__(self, consul_url: str, nomad_url: str, consul_token: str | None = None,
                 nomad_token: str | None = None) -> None:
        self.consul_url, self.nomad_url = consul_url.rstrip("/"), nomad_url.rstrip("/")
        self.ch = {"X-Consul-Token": consul_token} if consul_token else {}
        self.nh = {"X-Nomad-Token": nomad_token} if nomad_token else {}

    def nomad(self, method: str, path: str, **kw):
        r = requests.request(method, self.nomad_url + path, headers=self.nh, timeout=10, **kw)
        r.raise_for_status()
        return r.json() if r.text else None

    def consul(self, method: str, path: str, **kw):
        r = requests.request(method, self.consul_url + path, headers=self.ch, timeout=10, **kw)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json() if r.text else None

    def passing(self, service: str) -> list[dict]:
        return [e["Service"] for e in self.consul("GET", f"/v1/health/service/{service}",
                                                   params={"passing": ""}) or []]

    def kv(self, key: str) -> dict | None:
        import base64

        entries = self.consul("GET", f"/v1/kv/{key}")
        if not entries:
            return None
        entry = entries[0]
        raw = base64.b64decode(entry["Value"]) if entry.get("Value") else b""
        return {**entry, "Value": raw}

    def allocs(self, job: str) -> list[dict]:
        try:
            return self.nomad("GET", f"/v1/job/{job}/allocations")
        except requests.HTTPError:
            return []

    def count(self, job: str) -> int | None:
        """The job's first task group's count (GET /v1/job/:id), None if it cannot be read."""
        try:
            return int(self.nomad("GET", f"/v1/job/{job}")["TaskGroups"][0]["Count"])
        except (requests.HTTPError, KeyError, IndexError, TypeError, ValueError):
            return None

    def running(self, job: str) -> list[dict]:
        return [a for a in self.allocs(job) if a["ClientStatus"] == "running"
                and a["DesiredStatus"] == "run"]

    def register(self, file: str, variables: dict) -> None:
        from agent.cluster.jobs import register_job
        from agent.cluster.nomad_http import nomad_client

        register_job(nomad_client(address=self.nomad_url, token=self.nh.get("X-Nomad-Token")),
                     (REPO / "jobs" / file).read_text(), variables)


class Traffic:
    """Clients sending generate requests to the front door: every request ends in tokens
    and ``done`` (served), a clean error answer (``refused``), or counts as ``lost`` (a
    broken connection, a timeout: no answer)."""

    def __init__(self, address: tuple[str, int], token: str, *, clients: int = 2,
                 timeout_s: float = 60.0) -> None:
        self.address, self.token, self.timeout_s = address, token, timeout_s
        self.served = self.refused = self.lost = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(clients)]

    def start(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            kind, detail = one_request(self.address, self.token, self.timeout_s)
            with self._lock:
                setattr(self, kind, getattr(self, kind) + 1)
                if kind != "served":
                    self.errors.append(detail)
            self._stop.wait(0.2)


def one_request(address, token, timeout_s) -> tuple[str, str]:
    """("served" | "refused" | "lost", detail)."""
    from agent.client import Client
    from agent.errors import RewarmError

    try:
        client = Client(*address, token=token, timeout_s=timeout_s, max_retries=0)
    except (RewarmError, OSError) as exc:
        return "refused", f"connect: {exc}"     # nothing was sent: not a lost request
    try:
        out = client.generate(MODEL, tokens=PROMPT, max_tokens=4, seed=1)
        return ("served", "") if out.tokens else ("lost", "done without tokens")
    except RewarmError as exc:
        return "refused", f"{getattr(exc, 'code', '?')}: {exc}"
    except (OSError, TimeoutError) as exc:
        return "lost", f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


def timed_request(address, token, timeout_s: float = 120.0) -> dict:
    """One request as rewarm's client sends it; seconds to its first token and to done (from
    the first attempt), and its ``done`` message.  The client retries a 429 after its
    ``retry_after_ms`` (agent/client.py): a front door refuses at once a request that no
    capacity can start within its TTFT SLO and starts that capacity for the retry."""
    from agent.client import Client

    start = time.monotonic()
    client = Client(*address, token=token, timeout_s=timeout_s)
    first = None
    done = {}
    try:
        for msg in client.stream(MODEL, tokens=PROMPT, max_tokens=4, seed=1):
            if msg["type"] == "tokens" and first is None:
                first = time.monotonic() - start
            elif msg["type"] == "done":
                done = msg
    finally:
        client.close()
    return {"first_token_s": first, "total_s": time.monotonic() - start, "done": done}


def hold_lines(standin, job: str) -> list[dict]:
    """The JSON lines ``rewarm hold`` printed, per allocation of ``job`` (stand-in mode)."""
    out = []
    for alloc in standin.job_allocs(job):
        log = standin.data_dir / alloc["ID"] / "replica" / "stdout.log"
        if log.exists():
            for line in log.read_text().splitlines():
                try:
                    out.append({**json.loads(line), "node": alloc["NodeName"],
                                "alloc_id": alloc["ID"], "status": alloc["ClientStatus"]})
                except ValueError:
                    pass
    return out
