"""The front door: one asyncio TCP server that routes, queues or refuses each request.

State machine of one ``generate`` request::

    arrive ──validate/auth──► 400/401/404 (answered)
       │
       ├─ warm replica with headroom, nobody queued ─► DISPATCHED ─► tokens…, done
       │
       └─ else ─► QUEUED (per-model deadline heap) ─┬─ replica warm/freed ─► DISPATCHED
                   │ full / wait too long: 429      ├─ deadline passed: 504 (never sent)
                   └─ asks for a restore (capped)   └─ every restore failed: 503

Routing and admission are the pure :class:`~agent.frontdoor.router.Router` and
:class:`~agent.frontdoor.admission.AdmissionQueue`; this module only wires them to sockets.
The registry is read off the request path (a watcher thread: Consul blocking queries, or
polling) into the router's cached view.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from agent.clock import Clock, SystemClock
from agent.cluster.base import Registry, ServiceInstance
from agent.errors import ConfigError, Overloaded, ProtocolError, RewarmError, Unauthorized
from agent.frontdoor.admission import AdmissionQueue, Pending
from agent.frontdoor.announce import FRONTDOOR_SERVICE, Announcer, RegistryAnnouncer
from agent.frontdoor.auth import TokenAuth
from agent.frontdoor.capacity import CapacityRequester, RestoreGate, RestoreTimes
from agent.frontdoor.links import ClientConn, ReplicaLink, packb
from agent.frontdoor.router import ReplicaLoad, Router
from agent.frontdoor.watch import RegistryWatcher
from agent.protocol import (DEFAULT_LIMITS, PROTOCOL_VERSION, Limits, error_message, reply_id,
                            validate_request)
from agent.telemetry import Telemetry

log = logging.getLogger(__name__)
REPLICA_SERVICE = "rewarm-replica"


@dataclass
class FrontDoorConfig:
    """Knobs, with units in their names.  ``models``: model -> default deadline (ms).  Models
    not listed (seen in the registry) get ``default_deadline_ms`` until restores are measured,
    then ``max(default_deadline_ms, deadline_per_restore_p99 x restore p99)``: deadlines
    follow the restore latency's p99 (design document, "Deadline-Aware Admission Control")."""

    host: str = "127.0.0.1"
    port: int = 0
    models: dict[str, float] = field(default_factory=dict)
    default_deadline_ms: float = 30_000.0
    deadline_per_restore_p99: float = 1.5  # unconfigured models: max(default, this x p99)
    max_queue_depth: int = 1024
    max_wait_s: float = 60.0
    max_connections: int = 4096
    idle_timeout_s: float = 300.0
    frame_deadline_s: float = 30.0  # per frame: from its first byte to its last
    close_linger_s: float = 2.0     # closing: drain unread input this long (no reset) ...
    close_linger_bytes: int = 4 << 20  # ... or this many bytes, whichever comes first
    tick_s: float = 0.005          # queue expiry resolution
    sweep_s: float = 0.25          # idle / slow-frame checks
    registry_poll_s: float = 0.5   # polling period (registries without blocking queries)
    registry_wait_s: float = 5.0   # longest blocking query (Consul)
    restores_per_model: int = 2
    restores_overall: int = 8
    at_capacity_backoff_s: float = 0.25  # a restore answered by an existing replica: ask again after
    limits: Limits = DEFAULT_LIMITS
    replica_limits: Limits = DEFAULT_LIMITS
    announce: bool = False         # register as rewarm-frontdoor (see announce.py)

    def __post_init__(self) -> None:
        """Refuse values that make no sense with :class:`ConfigError` naming the knob, the
        value and the limit (the CLI builds this too, so its flags are checked here)."""
        if not isinstance(self.port, int) or isinstance(self.port, bool) \
                or not 0 <= self.port <= 65535:
            raise ConfigError(f"FrontDoorConfig port={self.port!r} must be an int within "
                              f"0..65535", name="port", value=self.port, limit=(0, 65535))
        for name in ("max_queue_depth", "max_connections", "restores_per_model",
                     "restores_overall", "close_linger_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"FrontDoorConfig {name}={value!r} must be an int >= 1",
                                  name=name, value=value, limit=1)
        for name in ("default_deadline_ms", "deadline_per_restore_p99", "max_wait_s",
                     "idle_timeout_s", "frame_deadline_s", "close_linger_s", "tick_s",
                     "sweep_s", "registry_poll_s", "registry_wait_s"):
            value = getattr(self, name)
            if not _positive(value):
                raise ConfigError(f"FrontDoorConfig {name}={value!r} must be a number > 0",
                                  name=name, value=value, limit=0)
        if not _number(self.at_capacity_backoff_s) or not self.at_capacity_backoff_s >= 0:
            raise ConfigError(f"FrontDoorConfig at_capacity_backoff_s="
                              f"{self.at_capacity_backoff_s!r} must be a number >= 0",
                              name="at_capacity_backoff_s", value=self.at_capacity_backoff_s,
                              limit=0)
        top = self.limits.max_deadline_ms
        for model, deadline_ms in self.models.items():
            if not isinstance(model, str) or not model:
                raise ConfigError(f"FrontDoorConfig models: model name {model!r} must be a "
                                  f"non-empty string", name="models", value=model,
                                  limit="non-empty str")
            if not _positive(deadline_ms) or deadline_ms > top:
                raise ConfigError(f"FrontDoorConfig models[{model!r}] deadline "
                                  f"{deadline_ms!r} ms must be within (0, {top}] ms "
                                  f"(max_deadline_ms)", name=f"models[{model!r}]",
                                  value=deadline_ms, limit=top)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    """A number > 0 (not NaN, not a bool)."""
    return _number(value) and value > 0


@dataclass(eq=False, slots=True)
class Request:
    """One generate request inside the front door (its connection, ids, clock times)."""

    conn: ClientConn
    client_id: Any
    message: dict
    model: str
    arrival_s: float
    deadline_s: float
    need_tokens: int
    path: str = "warm_hit"
    restore_ms: float | None = None
    queue_wait_ms: float = 0.0
    replica_id: str = ""
    replica_rid: int = 0
    ttft_s: float | None = None


class FrontDoor:
    """Owns the router, the admission queues, the replica links and the listening socket."""

    def __init__(self, config: FrontDoorConfig, *, registry: Registry,
                 capacity: CapacityRequester | None = None, clock: Clock | None = None,
                 telemetry: Telemetry | None = None, auth: TokenAuth | None = None,
                 announcer: Announcer | None = None) -> None:
        self.config = config
        self.registry = registry
        self.capacity = capacity
        self.clock = clock or SystemClock()
        self.telemetry = telemetry or Telemetry()
        self.auth = auth or TokenAuth()
        if announcer is None and config.announce:
            announcer = RegistryAnnouncer(registry, ttl_s=max(3 * config.registry_poll_s, 5.0))
        self.announcer = announcer
        self.router = Router()
        self.gate = RestoreGate(per_model=config.restores_per_model,
                                overall=config.restores_overall)
        self.queues: dict[str, AdmissionQueue] = {}
        self.links: dict[str, ReplicaLink] = {}
        self.conns: set[ClientConn] = set()
        self.known_models: set[str] = set(config.models)
        self.last_restore: dict[str, tuple[float, str, float | None]] = {}
        self.came_up: dict[str, tuple[float, str, float | None]] = {}  # replica -> restore
        self._capped_until: dict[str, float] = {}  # model -> clock time to ask for capacity again
        self.restore_times = RestoreTimes()
        self._deadline_ms = dict(config.models)  # model -> default deadline (ms)
        self.counts = {"requests": 0, "dispatched": 0, "done": 0, "errors": 0}
        self.arrivals: dict[str, int] = {}  # generate requests per model (predictor input)
        self.instance_id = f"frontdoor-{uuid.uuid4().hex[:12]}"
        self._server: asyncio.base_events.Server | None = None
        self._tasks: list[asyncio.Task] = []
        self._queued_models: set[str] = set()
        self._watcher: RegistryWatcher | None = None
        self._last_beat_s = float("-inf")
        self._upserted: dict[str, float] = {}  # replica id -> when a restore reported it
        self._stopping = False

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> tuple[str, int]:
        """Listen and start the background loops; returns the bound ``(host, port)``."""
        loop = asyncio.get_running_loop()
        await self.refresh_replicas()
        self._watcher = RegistryWatcher(
            self.registry, REPLICA_SERVICE, poll_s=self.config.registry_poll_s,
            wait_s=self.config.registry_wait_s, on_change=self.apply_replicas, loop=loop,
            on_tick=self._heartbeat).start()
        self._server = await loop.create_server(
            lambda: ClientConn(self), self.config.host, self.config.port,
            backlog=1024, reuse_address=True)
        self._tasks = [loop.create_task(self._ticker()), loop.create_task(self._sweeper())]
        if self.announcer is not None:
            host, port = self.address
            await asyncio.to_thread(self.announcer.announce, ServiceInstance(
                FRONTDOOR_SERVICE, self.instance_id, host, port, tags=["protocol=msgpack"]))
        return self.address

    @property
    def address(self) -> tuple[str, int]:
        sock = self._server.sockets[0]
        return sock.getsockname()[:2]

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop listening; answer queued requests 503 at once; let dispatched requests
        finish within ``grace_s``, answer those still running 503; then close every
        connection gracefully (answers flushed first; at most ``close_linger_s`` more)."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        if self._watcher is not None:
            self._watcher.stop()
        for model in self.queues:  # never sent to a replica: say so now
            self._refuse_queued(model, f"front door shutting down: request for model "
                                       f"{model!r} was queued and never sent to a replica")
        self._queued_models.clear()
        deadline = self.clock.now() + grace_s
        while any(link.in_flight for link in self.links.values()) and self.clock.now() < deadline:
            await asyncio.sleep(0.01)
        for task in self._tasks:
            task.cancel()
        for link in list(self.links.values()):
            self.replica_failed(link, f"front door shutting down: replica {link.replica_id} "
                                      f"did not finish within grace_s({grace_s})")
        for conn in list(self.conns):
            conn.end()
        loop = asyncio.get_running_loop()
        closing_until = loop.time() + self.config.close_linger_s + 0.1
        while self.conns and loop.time() < closing_until:
            await asyncio.sleep(0.01)
        for conn in list(self.conns):  # past every bound: drop what is left
            if conn.transport is not None:
                conn.transport.abort()
        if self.announcer is not None:
            await asyncio.to_thread(self.announcer.withdraw, self.instance_id)
        self.telemetry.flush()

    # --- connections -----------------------------------------------------------------

    def accept(self, conn: ClientConn) -> bool:
        if len(self.conns) >= self.config.max_connections:
            return False
        self.conns.add(conn)
        return True

    def forget(self, conn: ClientConn) -> None:
        """The connection closed: its queued requests leave their queues (no one to answer)."""
        self.conns.discard(conn)
        for p in conn.queued:
            queue = self.queues[p.model]
            queue.cancel(p)
            self.telemetry.queue_depth(p.model, len(queue))
        conn.queued.clear()

    # --- requests --------------------------------------------------------------------

    def handle(self, conn: ClientConn, message: dict) -> None:
        """One decoded message from a client."""
        try:
            validate_request(message, self.config.limits)
        except ProtocolError as err:
            # One well-framed message that is wrong: answer it alone; the connection and
            # the requests in flight on it carry on.
            rid = reply_id(message.get("id"), self.config.limits)
            model = message.get("model")
            # validate_request's reasons name the value and the limit themselves
            self._refuse(conn, rid, model if type(model) is str else "", err.code, err.message)
            return
        rid = message["id"]
        if self.auth.enabled:
            token = message.get("token")
            if token is None or token != conn.token:
                try:
                    conn.tenant = self.auth.check(token)
                    conn.token = token
                except Unauthorized as err:
                    self._refuse(conn, rid, message.get("model", ""), err.code, err.message)
                    return
        op = message["op"]
        if op == "generate":
            self._generate(conn, rid, message)
        else:
            conn.send(packb({"v": PROTOCOL_VERSION, "id": rid, "type": "result",
                             "result": self._info(op)}))

    def _generate(self, conn: ClientConn, rid: Any, message: dict) -> None:
        self.counts["requests"] += 1
        model = message["model"]
        if self._stopping:
            self._refuse(conn, rid, model, 503, "front door shutting down: not taking new "
                         "requests")
            return
        if model not in self.known_models:  # (not counted by model: names are the client's)
            self._refuse(conn, rid, model, 404, f"unknown model {model!r}")
            return
        self.arrivals[model] = self.arrivals.get(model, 0) + 1
        now = self.clock.now()
        prompt = message.get("tokens")
        # KV need: prompt tokens (a text prompt counted at ~3 characters per BPE token, an
        # overestimate for English with a byte-level BPE vocabulary) + max_tokens.
        need = (len(prompt) if prompt is not None else len(message["prompt"]) // 3 + 1)
        need += message["max_tokens"]
        deadline_ms = message.get("deadline_ms") or self._deadline_ms.get(
            model, self.config.default_deadline_ms)
        req = Request(conn, rid, message, model, now, now + deadline_ms / 1000.0, need)
        queue = self.queues.get(model)
        if not queue:
            replica = self.router.choose(model, need)
            if replica is not None:
                self._dispatch(req, replica)
                return
        warm = self.router.warm(model)
        if warm and need > max(r.kv_capacity_tokens for r in warm):
            largest = max(r.kv_capacity_tokens for r in warm)
            self._refuse(conn, rid, model, 413, f"request needs {need} KV tokens; the "
                         f"largest replica of {model!r} holds {largest}")
            return
        if queue is None:
            queue = self.queues[model] = AdmissionQueue(
                model, clock=self.clock, max_depth=self.config.max_queue_depth,
                max_wait_s=self.config.max_wait_s)
        if self.capacity is None and not warm:
            self._refuse(conn, rid, model, 503, f"model {model!r}: no warm replica and no "
                         f"capacity requester configured")
            return
        p99_ms = self.restore_times.p99_ms(model)
        queue.expected_wait_s = p99_ms / 1000.0 if p99_ms and not warm else 0.0
        pending = Pending(rid, model, now, req.deadline_s, need, req)
        try:
            queue.offer(pending)
        except Overloaded as err:
            self._refuse(conn, rid, model, 429, err.message, retry_after_ms=err.retry_after_ms)
            return
        conn.in_flight += 1
        conn.queued.add(pending)
        self._queued_models.add(model)
        self.telemetry.queue_depth(model, len(queue))
        self._maybe_restore(model)

    def _dispatch(self, req: Request, replica: ReplicaLoad) -> None:
        link = self.links.get(replica.replica_id)
        if link is None or link.closed:
            link = self._connect(replica)
        req.replica_id = replica.replica_id
        self.router.on_dispatch(replica.replica_id, req.need_tokens)
        req.conn.in_flight += 1
        self.counts["dispatched"] += 1
        link.dispatch(req)

    def _connect(self, replica: ReplicaLoad) -> ReplicaLink:
        loop = asyncio.get_running_loop()
        link = ReplicaLink(self, replica.replica_id)
        self.links[replica.replica_id] = link
        host, _, port = replica.address.rpartition(":")

        async def connect() -> None:
            try:
                if host:
                    await loop.create_connection(lambda: link, host, int(port))
                else:
                    await loop.create_unix_connection(lambda: link, replica.address)
            except OSError as exc:
                link.closed = True
                self.replica_failed(link, f"cannot connect to replica {replica.address}: {exc}")
        loop.create_task(connect())
        return link

    def on_answer(self, link: ReplicaLink, req: Request, message: dict) -> None:
        """A message from a replica for ``req``: forward it with the client's id."""
        kind = message.get("type")
        now = self.clock.now()
        if req.ttft_s is None:
            req.ttft_s = now
        message["id"] = req.client_id
        if kind == "tokens":
            req.conn.send(packb(message))
            return
        del link.in_flight[req.replica_rid]
        self.router.on_complete(link.replica_id, req.need_tokens)
        req.conn.finished()
        self._settle_path(req)
        ttft_ms = (req.ttft_s - req.arrival_s) * 1000.0
        if kind == "done":
            self.counts["done"] += 1
            message["ttft_ms"] = ttft_ms
            message["total_ms"] = (now - req.arrival_s) * 1000.0
            message["path"] = req.path
            message["replica"] = link.replica_id
            message["queue_wait_ms"] = req.queue_wait_ms
            code = 200
        else:
            self.counts["errors"] += 1
            code = message.get("code", 500)
        req.conn.send(packb(message))
        self.telemetry.event(req.client_id, req.model, req.path, code, req.queue_wait_ms,
                             req.restore_ms, ttft_ms if code == 200 else None,
                             now > req.deadline_s)
        if self.queues.get(req.model):
            self._drain(req.model)

    def _settle_path(self, req: Request) -> None:
        """A request that arrived before the replica serving it was brought up waited for that
        restore: it takes the restore's path.  (The registry may show the new replica, and the
        queue dispatch to it, before the restore's answer reaches this front door.)"""
        came_up = self.came_up.get(req.replica_id)
        if req.path == "warm_hit" and came_up is not None and req.arrival_s <= came_up[0]:
            req.path, req.restore_ms = came_up[1], came_up[2]

    def replica_failed(self, link: ReplicaLink, reason: str) -> None:
        """The link broke: its requests get 503 and the replica leaves the view until the
        registry shows it again."""
        link.closed = True
        if self.links.get(link.replica_id) is link:
            del self.links[link.replica_id]
        self.router.remove(link.replica_id)
        failed, link.in_flight = list(link.in_flight.values()), {}
        for req in failed:
            self._refuse(req.conn, req.client_id, req.model, 503, reason, path=req.path)
            req.conn.finished()
        if link.transport is not None:
            link.transport.close()

    def _refuse(self, conn: ClientConn, rid: Any, model: str, code: int, reason: str,
                path: str = "refused", **extra: Any) -> None:
        self.counts["errors"] += 1
        conn.send(packb(error_message(rid, code, reason, **extra)))
        self.telemetry.event(rid, model, path, code, 0.0, None, None, code == 504,
                             reason=reason)

    # --- queues and restores ---------------------------------------------------------

    def _drain(self, model: str) -> None:
        """Dispatch queued requests earliest deadline first while a replica fits."""
        queue = self.queues[model]
        now = self.clock.now()
        restored = self.last_restore.get(model)
        while queue:
            head = queue.peek()
            req: Request = head.payload
            replica = self.router.choose(model, head.need_tokens)
            if replica is None:
                break
            queue.pop_earliest()
            req.conn.queued.discard(head)
            req.conn.in_flight -= 1
            req.queue_wait_ms = (now - req.arrival_s) * 1000.0
            if restored is not None and restored[0] >= req.arrival_s:
                req.path, req.restore_ms = restored[1], restored[2]
            self._dispatch(req, replica)
        self.telemetry.queue_depth(model, len(queue))

    def _maybe_restore(self, model: str) -> None:
        if self.capacity is None or self.clock.now() < self._capped_until.get(model, 0.0):
            return
        for _ in range(self.gate.wanted(model, len(self.queues[model]))):
            self.gate.started(model)
            asyncio.get_running_loop().create_task(self._restore(model))
        self.telemetry.restores_in_flight(self.gate.total)

    async def _restore(self, model: str) -> None:
        ok = False
        started = self.clock.now()
        try:
            result = await self.capacity.request_restore(model)
            ok = True
            self.telemetry.restore_outcome(model, True)
            now = self.clock.now()
            self.last_restore[model] = (now, result.path, result.restore_ms)
            self._restore_measured(model, result.restore_ms or (now - started) * 1000.0)
            if result.replica is not None:
                self._upsert(result.replica)
                if result.path != "warm_hit":
                    self.came_up[result.replica.replica_id] = (now, result.path, result.restore_ms)
                    while len(self.came_up) > 1024:       # oldest first out
                        del self.came_up[next(iter(self.came_up))]
                self.known_models.add(model)
                self._upserted[result.replica.replica_id] = self.clock.now()
        except Exception as exc:  # the requester's failure, whatever it is, ends this restore
            log.warning("restore of %s failed: %s", model, exc)
            reason = exc.message if isinstance(exc, RewarmError) else str(exc)
            self.telemetry.restore_outcome(model, False, reason)
        finally:
            self.gate.finished(model)
            self.telemetry.restores_in_flight(self.gate.total)
        queue = self.queues.get(model)
        if not queue:
            return
        self._drain(model)
        if ok:
            if queue and result.path == "warm_hit":
                # The node is at its replica cap and answered with a replica it already had:
                # asking again at once would spin; queued requests go as it frees slots.
                backoff_s = self.config.at_capacity_backoff_s
                self._capped_until[model] = self.clock.now() + backoff_s
                asyncio.get_running_loop().call_later(backoff_s, self._maybe_restore, model)
            elif queue:
                self._maybe_restore(model)
        elif not self.gate.in_flight.get(model) and not self.router.warm(model):
            # nothing can succeed now: say so promptly
            self._refuse_queued(model, f"model {model!r}: no capacity can be restored: {reason}")

    def _refuse_queued(self, model: str, reason: str) -> None:
        """Answer every request queued for ``model`` 503 with ``reason`` (never dispatched)."""
        for p in self.queues[model].drain():
            req: Request = p.payload
            req.conn.queued.discard(p)
            self._refuse(req.conn, req.client_id, model, 503, reason)
            req.conn.finished()
        self.telemetry.queue_depth(model, 0)

    def _restore_measured(self, model: str, restore_ms: float) -> None:
        self.restore_times.record(model, restore_ms)
        if model not in self.config.models:
            self._deadline_ms[model] = max(
                self.config.default_deadline_ms,
                self.config.deadline_per_restore_p99 * self.restore_times.p99_ms(model))

    # --- background loops ------------------------------------------------------------

    async def _ticker(self) -> None:
        """Answer queued requests past their deadline (504) or wait bound (429)."""
        while True:
            await asyncio.sleep(self.config.tick_s)
            if not self._queued_models:
                continue
            now = self.clock.now()
            for model in list(self._queued_models):
                queue = self.queues[model]
                for p in queue.expire():
                    req: Request = p.payload
                    req.conn.queued.discard(p)
                    req.conn.finished()
                    if p.deadline_s <= now:
                        self._refuse(req.conn, req.client_id, model, 504,
                                     f"deadline passed after {(now - p.arrival_s) * 1000:.0f} ms "
                                     f"queued for model {model!r}")
                    else:
                        self._refuse(req.conn, req.client_id, model, 429,
                                     f"waited max_wait_s({queue.max_wait_s}) for model {model!r}",
                                     retry_after_ms=queue.retry_after_ms())
                if not queue:
                    self._queued_models.discard(model)
                self.telemetry.queue_depth(model, len(queue))

    async def _sweeper(self) -> None:
        """Close idle connections and cut off frames that take too long to arrive."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.sweep_s)
            now = self.clock.now()
            for conn in list(self.conns):
                if conn.frame_start_s is not None and now - conn.frame_start_s > cfg.frame_deadline_s:
                    conn.fail(ProtocolError(
                        f"frame not complete within frame_deadline_s({cfg.frame_deadline_s})",
                        field="frame", value=now - conn.frame_start_s, limit=cfg.frame_deadline_s))
                elif conn.in_flight <= 0 and now - conn.last_active_s > cfg.idle_timeout_s:
                    conn.end()
            self.telemetry.flush()

    def _heartbeat(self) -> None:
        """Keep a TTL announcement passing (called from the watcher thread)."""
        now = self.clock.now()
        if self.announcer is not None and now - self._last_beat_s >= self.config.registry_poll_s:
            self._last_beat_s = now
            try:
                self.announcer.heartbeat(self.instance_id)
            except Exception as exc:
                log.warning("front door heartbeat failed: %s", exc)

    async def refresh_replicas(self) -> None:
        """Read the registry now (startup, tests) and apply it."""
        self.apply_replicas(await asyncio.to_thread(self.registry.healthy, REPLICA_SERVICE))

    def _upsert(self, load: ReplicaLoad) -> None:
        """Put a reported load in the router, raised to at least what this front door has
        dispatched to the replica and not yet seen answered (a report may predate them)."""
        link = self.links.get(load.replica_id)
        if link is not None:
            ours = link.in_flight.values()
            load.active_seqs = max(load.active_seqs, len(link.in_flight))
            load.kv_used_tokens = max(load.kv_used_tokens, sum(r.need_tokens for r in ours))
        self.router.upsert(load)

    def apply_replicas(self, instances: list[ServiceInstance]) -> None:
        """Replace the router's view with these passing replicas.  A replica's reported use
        is raised to at least what this front door has dispatched to it; one missing from
        the list leaves the view unless a restore reported it within the last
        3 x ``registry_poll_s`` (it may not be registered yet)."""
        seen = set()
        for inst in instances:
            try:
                load = ReplicaLoad.from_instance(inst)
            except ValueError as exc:
                log.warning("ignoring replica: %s", exc)
                continue
            seen.add(load.replica_id)
            self.known_models.add(load.model)
            self._upsert(load)
        now = self.clock.now()
        grace_s = 3 * self.config.registry_poll_s
        for model in self.router.models():
            for load in self.router.warm(model):
                if load.replica_id not in seen and now - self._upserted.get(
                        load.replica_id, -grace_s) >= grace_s:
                    self.router.remove(load.replica_id)
                    self._upserted.pop(load.replica_id, None)
        for rid, link in list(self.links.items()):  # gone and idle: hang up
            if rid not in seen and not link.in_flight and self.router.get(rid) is None:
                del self.links[rid]
                link.closed = True
                if link.transport is not None:
                    link.transport.close()
        for model in list(self._queued_models):
            if self.queues[model]:
                self._drain(model)

    def _info(self, op: str) -> dict:
        if op == "health":
            return {"status": "ok", "connections": len(self.conns)}
        if op == "models":
            return {m: {"warm": len(self.router.warm(m)),
                        "queued": len(self.queues.get(m) or ())}
                    for m in sorted(self.known_models)}
        return {**self.counts, "arrivals": dict(self.arrivals), "connections": len(self.conns),
                "restores_in_flight": self.gate.total,
                "queued": {m: len(q) for m, q in self.queues.items() if q},
                "replicas": {r.replica_id: {"model": r.model, "active_seqs": r.active_seqs,
                                            "kv_used_tokens": r.kv_used_tokens,
                                            "kv_capacity_tokens": r.kv_capacity_tokens}
                             for m in self.router.models() for r in self.router.warm(m)}}
