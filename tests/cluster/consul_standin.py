"""An in-process Consul HTTP API stand-in, written from Consul's documented HTTP API.

Covers what rewarm uses: agent service register/deregister with a TTL check and
``/v1/agent/check/pass/:check_id`` (check id ``service:<service id>``), the health endpoint
``/v1/health/service/:service`` (``passing``, ``tag``, blocking queries with ``index`` and
``wait`` and the ``X-Consul-Index`` header), KV (``cas``, ``acquire``, ``release``, base64
values, ``LockIndex``, ``Session``), and sessions with a TTL (create, renew, destroy, info;
``LockDelay``; behaviour ``release``/``delete``; ``Checks``/``NodeChecks``/``ServiceChecks``).
TTLs run on an injected clock so that tests can expire a session without sleeping.
``down = True`` answers 500 to everything (Consul unreachable).

Sessions as Consul's servers keep them:

- a session with a TTL is invalidated ``2 x TTL`` after its creation or last renew
  (``agent/consul/session_ttl.go``, ``createSessionTimer``: ``ttl * SessionTTLMultiplier``,
  which is 2: "the contract is that a session is not expired before the TTL, but there is
  no explicit promise about the upper bound");
- a session is tied to health checks (default ``serfHealth``, the node's; ``Checks`` or
  ``NodeChecks``/``ServiceChecks`` replace it): creating one with a check that is missing or
  critical fails ("Missing check 'X' registration", "Check 'X' is in critical state";
  ``agent/consul/state/session.go``, ``validateSessionChecksTxn``), and the session is
  invalidated as soon as one of them goes critical or is deregistered
  (``agent/consul/state/catalog.go``, ``ensureCheckTxn``/``deleteCheckTxn``);
- a TTL check goes critical once its TTL passes without an update
  (``agent/checks/check.go``, ``CheckTTL``).

ACL (``consul_acl.py``): ``acl_token`` is the management token; ``add_token(secret, rules)``
adds a token with rules; each endpoint checks its resource (service, key, session, node)
and health results are filtered by node:read and service:read.

TCP and HTTP checks ("Health Checks": TCP passes when a connection is accepted, HTTP when the
answer is 2xx, each every ``interval`` with its ``timeout``) are run by a checker thread.
KV reads take ``recurse`` and blocking ``index``/``wait`` ("KV Store HTTP API").
``index_zero = True`` makes every blocking read answer at once with ``X-Consul-Index: 0``
(an edge case of real servers, which clients must not turn into a busy loop).

Simplifications: one datacenter, one node ("standin", whose ``serfHealth`` always passes);
no anti-entropy, no blocking on session endpoints, no ACL tokens API (tokens are added by the
test).
"""

from __future__ import annotations

import base64
import re
import socket
import threading
import time
import uuid

from agent.clock import Clock, SystemClock

from tests.cluster.consul_acl import ConsulAcl
from tests.cluster.standin_http import Reply, StandIn

SESSION_TTL_MULTIPLIER = 2      # agent/structs/structs.go SessionTTLMultiplier
NODE = "standin"
SERF_HEALTH = "serfHealth"

_DURATION = re.compile(r"([\d.]+)(ns|us|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    parts = _DURATION.findall(str(text))
    if not parts:
        raise Reply(400, f"invalid duration {text!r}")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _lower(d: dict | None) -> dict:
    return {k.lower(): v for k, v in (d or {}).items()}


class ConsulStandIn(StandIn):
    def __init__(self, clock: Clock | None = None, acl_token: str | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        super().__init__(host=host, port=port)
        self.clock = clock or SystemClock()
        self.acl = ConsulAcl(acl_token)
        self.down = False
        self.index = 1
        self.services: dict[str, dict] = {}     # id -> service + check state
        self.kv: dict[str, dict] = {}
        self.sessions: dict[str, dict] = {}
        self.lock_delays: dict[str, float] = {}  # key -> time until which acquire is refused
        self.index_zero = False
        self._checker = threading.Thread(target=self._check_loop, daemon=True,
                                         name="consul-standin-checks")
        self._halt = threading.Event()

    @property
    def acl_token(self) -> str | None:
        return self.acl.management_token

    @acl_token.setter
    def acl_token(self, token: str | None) -> None:
        self.acl.management_token = token

    def add_token(self, secret: str, rules: str) -> None:
        with self.lock:
            self.acl.add_token(secret, rules)

    def start(self):
        super().start()
        self._checker.start()
        return self

    def stop(self) -> None:
        self._halt.set()
        super().stop()

    def _check_loop(self) -> None:
        while not self._halt.wait(0.1):
            now = time.monotonic()
            with self.lock:
                self._expire()
                due = [(sid, dict(svc["check"])) for sid, svc in self.services.items()
                       if svc.get("check") and now >= svc["check"]["next_s"]]
                for sid, _ in due:
                    c = self.services[sid]["check"]
                    c["next_s"] = now + c["interval_s"]
            for sid, check in due:
                ok = _probe(check)
                with self.lock:
                    svc = self.services.get(sid)
                    status = "passing" if ok else "critical"
                    if svc is not None and svc["status"] != status:
                        svc["status"] = status
                        self._check_changed(f"service:{sid}", status)
                        self._bump()

    # -- helpers ---------------------------------------------------------------------------
    def _bump(self) -> int:
        self.index += 1
        self.changed.notify_all()
        return self.index

    def _expire(self) -> None:
        now = self.clock.now()
        for sid, s in list(self.sessions.items()):
            if s["ttl_s"] and now >= s["expires_s"]:
                self._invalidate(sid)
        for svc_id, svc in list(self.services.items()):
            status = "passing" if now - svc["last_pass_s"] < svc["ttl_s"] else "critical"
            if svc["ttl_s"] and status != svc["status"]:
                svc["status"] = status
                self._check_changed(f"service:{svc_id}", status)
                self._bump()

    def _check_status(self, check_id: str) -> str | None:
        if check_id == SERF_HEALTH:
            return "passing"
        if check_id.startswith("service:") and check_id[len("service:"):] in self.services:
            return self.services[check_id[len("service:"):]]["status"]
        return None

    def _check_changed(self, check_id: str, status: str | None) -> None:
        """A check went critical or away: the sessions tied to it are invalidated."""
        if status == "passing":
            return
        for sid, session in list(self.sessions.items()):
            if check_id in session["checks"]:
                self._invalidate(sid)

    def _invalidate(self, sid: str) -> None:
        session = self.sessions.pop(sid)
        now = self.clock.now()
        for key, entry in list(self.kv.items()):
            if entry.get("Session") == sid:
                if session["behavior"] == "delete":
                    del self.kv[key]
                else:
                    entry.pop("Session")
                    entry["ModifyIndex"] = self.index + 1
                self.lock_delays[key] = now + session["lock_delay_s"]
        self._bump()

    # -- routing ---------------------------------------------------------------------------
    def route(self, method, path, query, body, headers):
        if self.down:
            raise Reply(500, "rpc error: No cluster leader")
        token = headers.get("X-Consul-Token") or query.get("token")
        if self.acl.management_token is not None and token != self.acl.management_token \
                and token not in self.acl.tokens:
            raise Reply(403, "ACL not found")

        def need(kind: str, name: str, write: bool) -> None:
            denied = self.acl.check(token, kind, name, write)
            if denied:
                raise Reply(403, denied)
        with self.lock:
            self._expire()
        if path.startswith("/v1/kv/"):
            key = path[len("/v1/kv/"):]
            if method != "GET" or "recurse" not in query:
                need("key", key, write=method != "GET")
            return self._kv(method, key, query, body, token)
        if path.startswith("/v1/session/"):
            need("session", NODE, write=method == "PUT")
            return self._session(method, path[len("/v1/session/"):], body)
        if path.startswith("/v1/health/service/") and method == "GET":
            service = path[len("/v1/health/service/"):]
            status, out, hdrs = self._health(service, query)
            if self.acl.check(token, "node", NODE, False) or \
                    self.acl.check(token, "service", service, False):
                out = []                # filtered, not refused (filterCheckServiceNodes)
            return status, out, hdrs
        if path.startswith("/v1/agent/"):
            return self._agent(method, path[len("/v1/agent/"):], body, need)
        raise Reply(404, f"no route for {method} {path}")

    def _agent(self, method, rest, body, need):
        with self.lock:
            if rest == "service/register" and method == "PUT":
                b = _lower(body)
                if not b.get("name"):
                    raise Reply(400, "Missing service name")
                need("service", b["name"], write=True)
                checks = b.get("checks") or ([b["check"]] if b.get("check") else [])
                ttl_s = 0.0
                probe = None
                for c in checks:
                    c = _lower(c)
                    if c.get("ttl"):
                        ttl_s = parse_duration(c["ttl"])
                    elif c.get("tcp") or c.get("http"):
                        probe = {"tcp": c.get("tcp"), "http": c.get("http"),
                                 "interval_s": parse_duration(c.get("interval", "10s")),
                                 "timeout_s": parse_duration(c.get("timeout", "10s")),
                                 "next_s": 0.0}
                sid = b.get("id") or b["name"]
                was = self.services.get(sid, {}).get("status")
                self.services[sid] = {
                    "ID": sid, "Service": b["name"], "Address": b.get("address", ""),
                    "Port": int(b.get("port") or 0), "Tags": list(b.get("tags") or []),
                    "Meta": dict(b.get("meta") or {}), "ttl_s": ttl_s,
                    # A TTL check starts critical until its first pass (Consul's default).
                    "status": "critical" if ttl_s or probe else "passing",
                    "last_pass_s": -float("inf"), "check": probe,
                }
                if was == "passing" and self.services[sid]["status"] == "critical":
                    # Registering again resets a TTL check to critical; the agent syncs the
                    # change to the catalog, whose check update invalidates the sessions tied
                    # to it (agent/local/state.go syncChanges; agent/consul/state/catalog.go
                    # ensureCheckTxn -> checkSessionsTxn).
                    self._check_changed(f"service:{sid}", "critical")
                self._bump()
                return 200, "", {}
            if rest.startswith("service/deregister/") and method == "PUT":
                sid = rest[len("service/deregister/"):]
                if sid not in self.services:
                    raise Reply(404, f'Unknown service ID "{sid}"')
                need("service", self.services[sid]["Service"], write=True)
                del self.services[sid]
                self._check_changed(f"service:{sid}", None)
                self._bump()
                return 200, "", {}
            if rest.startswith("check/pass/") and method == "PUT":
                check_id = rest[len("check/pass/"):]
                sid = check_id[len("service:"):] if check_id.startswith("service:") else None
                if sid not in self.services:
                    raise Reply(404, f'Unknown check ID "{check_id}"')
                svc = self.services[sid]
                need("service", svc["Service"], write=True)
                svc["last_pass_s"] = self.clock.now()
                if svc["status"] != "passing":
                    svc["status"] = "passing"
                    self._bump()
                return 200, "", {}
        raise Reply(404, f"no agent route {rest}")

    def _health(self, service, query):
        want_index = int(query.get("index", 0) or 0)
        wait_s = min(parse_duration(query["wait"]) if "wait" in query else 300.0, 600.0)
        deadline = time.monotonic() + wait_s
        with self.lock:
            if self.index_zero:
                want_index = 0
            while want_index and self.index <= want_index:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(min(left, 0.05))
                self._expire()
            out = []
            for svc in self.services.values():
                if svc["Service"] != service:
                    continue
                if "passing" in query and svc["status"] != "passing":
                    continue
                if query.get("tag") and query["tag"] not in svc["Tags"]:
                    continue
                out.append({
                    "Node": {"Node": "standin", "Address": "127.0.0.1"},
                    "Service": {k: svc[k] for k in ("ID", "Service", "Address", "Port", "Tags",
                                                    "Meta")},
                    "Checks": [{"CheckID": f"service:{svc['ID']}", "ServiceID": svc["ID"],
                                "Status": svc["status"]}],
                })
            return 200, out, {"X-Consul-Index": "0" if self.index_zero else str(self.index)}

    def _kv(self, method, key, query, body_json, token=None):
        with self.lock:
            entry = self.kv.get(key)
            if method == "GET":
                want_index = 0 if self.index_zero else int(query.get("index", 0) or 0)
                wait_s = min(parse_duration(query["wait"]) if "wait" in query else 300.0, 600.0)
                deadline = time.monotonic() + wait_s
                while want_index and self.index <= want_index:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.changed.wait(min(left, 0.05))
                    self._expire()
                header = {"X-Consul-Index": "0" if self.index_zero else str(self.index)}
                if "recurse" in query:
                    found = [dict(e) for k, e in sorted(self.kv.items()) if k.startswith(key)
                             and not self.acl.check(token, "key", k, False)]
                    if not found:
                        raise Reply(404, "", header)
                    return 200, found, header
                entry = self.kv.get(key)
                if entry is None:
                    raise Reply(404, "", header)
                return 200, [dict(entry)], header
            if method == "DELETE":
                if "cas" in query and (entry or {}).get("ModifyIndex", 0) != int(query["cas"]):
                    return 200, False, {}
                self.kv.pop(key, None)
                self._bump()
                return 200, True, {}
            if method != "PUT":
                raise Reply(405, "method not allowed")
            raw = self._last_raw
            if "cas" in query:
                cas = int(query["cas"])
                if (cas == 0 and entry is not None) or (cas and (entry is None or
                                                                 entry["ModifyIndex"] != cas)):
                    return 200, False, {}
            if "acquire" in query:
                sid = query["acquire"]
                if sid not in self.sessions:
                    raise Reply(500, f"invalid session {sid!r}")
                if entry is not None and entry.get("Session") not in (None, sid):
                    return 200, False, {}
                if self.clock.now() < self.lock_delays.get(key, -float("inf")):
                    return 200, False, {}
            if "release" in query:
                if entry is None or entry.get("Session") != query["release"]:
                    return 200, False, {}
            new_index = self.index + 1
            new = dict(entry or {"Key": key, "CreateIndex": new_index, "LockIndex": 0, "Flags": 0})
            new["Value"] = base64.b64encode(raw).decode() if raw else None
            new["ModifyIndex"] = new_index
            if "acquire" in query:
                if new.get("Session") != query["acquire"]:
                    new["LockIndex"] += 1
                new["Session"] = query["acquire"]
            if "release" in query:
                new.pop("Session", None)
            self.kv[key] = new
            self._bump()
            return 200, True, {}

    def _session(self, method, rest, body):
        with self.lock:
            if rest == "create" and method == "PUT":
                b = _lower(body)
                ttl_s = parse_duration(b["ttl"]) if b.get("ttl") else 0.0
                if ttl_s and not 10.0 <= ttl_s <= 86400.0:
                    raise Reply(400, f"Invalid Session TTL '{b['ttl']}', must be between [10s=24h0m0s]")
                checks = list(b.get("checks") or []) + list(b.get("nodechecks") or []) + [
                    _lower(c).get("id") for c in b.get("servicechecks") or []]
                if not any(k in b for k in ("checks", "nodechecks", "servicechecks")):
                    checks = [SERF_HEALTH]
                for check in checks:
                    status = self._check_status(check)
                    if status is None:
                        raise Reply(500, f"Missing check '{check}' registration")
                    if status == "critical":
                        raise Reply(500, f"Check '{check}' is in critical state")
                sid = str(uuid.uuid4())
                self.sessions[sid] = {
                    "ID": sid, "Name": b.get("name", ""), "ttl_s": ttl_s, "checks": checks,
                    "expires_s": self.clock.now() + SESSION_TTL_MULTIPLIER * ttl_s,
                    "behavior": b.get("behavior", "release"),
                    "lock_delay_s": parse_duration(b["lockdelay"]) if "lockdelay" in b else 15.0,
                }
                self._bump()
                return 200, {"ID": sid}, {}
            verb, _, sid = rest.partition("/")
            session = self.sessions.get(sid)
            if verb == "renew" and method == "PUT":
                if session is None:
                    raise Reply(404, f"Session id '{sid}' not found")
                session["expires_s"] = self.clock.now() + SESSION_TTL_MULTIPLIER * session["ttl_s"]
                return 200, [self._session_view(session)], {}
            if verb == "destroy" and method == "PUT":
                if session is not None:
                    self._invalidate(sid)
                return 200, True, {}
            if verb == "info" and method == "GET":
                return 200, [self._session_view(session)] if session else [], \
                    {"X-Consul-Index": str(self.index)}
        raise Reply(404, f"no session route {rest}")

    @staticmethod
    def _session_view(s: dict) -> dict:
        return {"ID": s["ID"], "Name": s["Name"], "TTL": f"{s['ttl_s']:g}s",
                "NodeChecks": [c for c in s["checks"] if not c.startswith("service:")],
                "ServiceChecks": [{"ID": c} for c in s["checks"] if c.startswith("service:")],
                "Behavior": s["behavior"], "LockDelay": int(s["lock_delay_s"] * 1e9)}

    def dispatch(self, method, path, query, raw, headers):
        # KV values are raw bytes, not JSON: keep them aside for _kv.
        if path.startswith("/v1/kv/"):
            with self.lock:
                self._last_raw = raw
                return super().dispatch(method, path, query, b"", headers)
        return super().dispatch(method, path, query, raw, headers)


def _probe(check: dict) -> bool:
    """One TCP or HTTP check ("Health Checks": TCP connects; HTTP expects a 2xx)."""
    timeout = check["timeout_s"]
    try:
        if check.get("tcp"):
            host, _, port = check["tcp"].rpartition(":")
            with socket.create_connection((host, int(port)), timeout=timeout):
                return True
        import urllib.request

        with urllib.request.urlopen(check["http"], timeout=timeout) as r:
            return 200 <= r.status < 300
    except (OSError, ValueError):
        return False
