"""The front door's knobs (:class:`FrontDoorConfig`), checked when built.

Shared by both entrances and the request path; the CLI builds it from its flags, so a bad
flag fails here at start with a :class:`~agent.errors.ConfigError` naming knob, value and limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.errors import ConfigError
from agent.frontdoor.router import DEFAULT_PRIOR
from agent.protocol import DEFAULT_LIMITS, Limits
from agent.slo import DEADLINE_FACTOR
from agent.speed import SpeedProfile


@dataclass
class FrontDoorConfig:
    """Knobs, with units in their names.

    TTFT SLOs are per model (docs/architecture.md, "Admission"): ``slos`` maps a model to its
    ``(warm_ms, restore_ms)``; others get ``warm_slo_ms`` / ``restore_slo_ms`` (warm-hit
    p99 2,000 ms and restore-path p99 4,000 ms), plus, with ``slo_counts_prefill``, the
    request's own prefill at its replicas' measured speed: the SLO is what attainment
    counts.  The deadline is what admission refuses against: a request with no
    ``deadline_ms`` of its own must get its first token within ``deadline_factor`` (1:
    agent/slo.py's default, the deadline is the SLO) times its path's SLO, counted from arrival (and within ``models[model]``, the model's default
    deadline, when that is shorter); a request's own ``deadline_ms`` replaces both, and one
    whose prefill alone exceeds it is refused at arrival.  Models not listed (seen in the
    registry) have a default deadline of ``default_deadline_ms`` until restores are
    measured, then ``max(default_deadline_ms, deadline_per_restore_p99 x restore p99)``
    (admission plans with restore p99s: docs/architecture.md, "Admission").

    ``drain_grace_s``: on stop, how long streams in flight may take to finish (new requests
    are answered 503 meanwhile).  ``fd_reserve``: descriptors kept back from connections
    (replica links, files, the emergency 429 of a connection accepted at the limit).
    ``prior_speed``: the speed assumed when no replica has reported one
    (:data:`agent.frontdoor.router.DEFAULT_PRIOR`); ``default_max_seqs``: the sequence slots
    assumed for a model none of whose replicas has been seen yet (agent/replica's default
    ``--max-seqs``)."""

    host: str = "127.0.0.1"
    port: int = 0
    models: dict[str, float] = field(default_factory=dict)
    default_deadline_ms: float = 30_000.0
    deadline_per_restore_p99: float = 1.5  # unconfigured models: max(default, this x p99)
    # a request with no deadline of its own may wait this many times its SLO (1: the deadline
    # is the SLO), and its SLO counts its own prefill at the replicas' measured speed
    deadline_factor: float = DEADLINE_FACTOR
    slo_counts_prefill: bool = True
    max_queue_depth: int = 1024
    max_wait_s: float = 60.0
    max_connections: int = 4096
    # a connection with no request in flight: closed after this long without a byte, and
    # a frame begun on it must be complete within idle_frame_deadline_s (a client that drips
    # one byte at a time holds a slot that long, not frame_deadline_s)
    idle_timeout_s: float = 30.0
    idle_frame_deadline_s: float = 10.0
    frame_deadline_s: float = 30.0  # per frame with requests in flight: first byte to last
    max_connections_per_peer: int = 64   # per remote address, except component peers
    # the node's own components (predictor, node agent, operator tools) connect from these
    # addresses; component_reserve slots of max_connections are theirs alone, and the
    # per-peer cap does not apply to them (None: max_connections // 64, 64 at the default)
    component_peers: tuple[str, ...] = ("127.0.0.1", "::1")
    component_reserve: int | None = None
    keepalive_idle_s: float = 60.0       # TCP keepalive (tcp(7)): idle before the first probe
    keepalive_interval_s: float = 10.0   # ... between probes
    keepalive_count: int = 5             # ... unanswered probes before the connection drops
    close_linger_s: float = 2.0     # closing: drain unread input this long (no reset) ...
    close_linger_bytes: int = 4 << 20  # ... or this many bytes, whichever comes first
    tick_s: float = 0.005          # queue expiry resolution
    recheck_s: float = 0.02        # queued requests' predictions re-checked this often
    sweep_s: float = 0.25          # idle / slow-frame checks
    registry_poll_s: float = 0.5   # polling period (registries without blocking queries)
    registry_wait_s: float = 5.0   # longest blocking query (Consul)
    restores_per_model: int = 2
    restores_overall: int = 8
    at_capacity_backoff_s: float = 0.25  # a restore answered by an existing replica: ask again after
    limits: Limits = DEFAULT_LIMITS
    replica_limits: Limits = DEFAULT_LIMITS
    announce: bool = False         # register as rewarm-frontdoor (see announce.py)
    warm_slo_ms: float = 2000.0    # TTFT SLO of a warm hit (p99 2 s)
    restore_slo_ms: float = 4000.0  # TTFT SLO of the restore path (p99 4 s)
    slos: dict[str, tuple[float, float]] = field(default_factory=dict)  # model -> (warm, restore) ms
    drain_grace_s: float = 30.0    # stop: streams in flight finish within this
    fd_reserve: int = 32           # descriptors never given to client connections
    accept_log_interval_s: float = 10.0  # accept errors: one log line per interval, with a count
    prior_speed: SpeedProfile = DEFAULT_PRIOR
    default_max_seqs: int = 8      # slots of a replica not seen yet (the replica's --max-seqs default)

    @property
    def reserved_slots(self) -> int:
        """Connection slots only ``component_peers`` may take."""
        if self.component_reserve is None:
            return self.max_connections // 64
        return self.component_reserve

    def slo_s(self, model: str) -> tuple[float, float]:
        """``model``'s (warm, restore) TTFT SLOs in seconds."""
        warm_ms, restore_ms = self.slos.get(model, (self.warm_slo_ms, self.restore_slo_ms))
        return warm_ms / 1000.0, restore_ms / 1000.0

    def __post_init__(self) -> None:
        """Refuse values that make no sense with :class:`ConfigError` naming the knob, the
        value and the limit (the CLI builds this too, so its flags are checked here)."""
        if not isinstance(self.port, int) or isinstance(self.port, bool) \
                or not 0 <= self.port <= 65535:
            raise ConfigError(f"FrontDoorConfig port={self.port!r} must be an int within "
                              f"0..65535", name="port", value=self.port, limit=(0, 65535))
        for name in ("max_queue_depth", "max_connections", "restores_per_model",
                     "restores_overall", "close_linger_bytes", "fd_reserve", "default_max_seqs",
                     "max_connections_per_peer", "keepalive_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"FrontDoorConfig {name}={value!r} must be an int >= 1",
                                  name=name, value=value, limit=1)
        if not (_positive(self.deadline_factor) and self.deadline_factor >= 1.0):
            raise ConfigError(f"FrontDoorConfig deadline_factor={self.deadline_factor!r} must be "
                              f"a number >= 1 (a deadline inside the SLO refuses what it counts "
                              f"as met)", name="deadline_factor", value=self.deadline_factor,
                              limit=1)
        for name in ("default_deadline_ms", "deadline_per_restore_p99", "max_wait_s",
                     "idle_timeout_s", "frame_deadline_s", "close_linger_s", "tick_s", "recheck_s",
                     "sweep_s", "registry_poll_s", "registry_wait_s", "warm_slo_ms",
                     "idle_frame_deadline_s", "keepalive_idle_s", "keepalive_interval_s",
                     "restore_slo_ms", "drain_grace_s", "accept_log_interval_s"):
            value = getattr(self, name)
            if not _positive(value):
                raise ConfigError(f"FrontDoorConfig {name}={value!r} must be a number > 0",
                                  name=name, value=value, limit=0)
        if not _number(self.at_capacity_backoff_s) or not self.at_capacity_backoff_s >= 0:
            raise ConfigError(f"FrontDoorConfig at_capacity_backoff_s="
                              f"{self.at_capacity_backoff_s!r} must be a number >= 0",
                              name="at_capacity_backoff_s", value=self.at_capacity_backoff_s,
                              limit=0)
        if self.component_reserve is not None and not (
                isinstance(self.component_reserve, int)
                and not isinstance(self.component_reserve, bool)
                and 0 <= self.component_reserve < self.max_connections):
            raise ConfigError(f"FrontDoorConfig component_reserve={self.component_reserve!r} "
                              f"must be an int within 0..max_connections-1 "
                              f"({self.max_connections - 1})", name="component_reserve",
                              value=self.component_reserve, limit=self.max_connections - 1)
        if not (isinstance(self.component_peers, tuple)
                and all(isinstance(a, str) for a in self.component_peers)):
            raise ConfigError(f"FrontDoorConfig component_peers={self.component_peers!r} must "
                              f"be a tuple of addresses", name="component_peers",
                              value=self.component_peers, limit="tuple of str")
        top = self.limits.max_deadline_ms
        for model, pair in self.slos.items():
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(
                    _positive(v) and v <= top for v in pair)):
                raise ConfigError(f"FrontDoorConfig slos[{model!r}]={pair!r} must be (warm_ms, "
                                  f"restore_ms), each within (0, {top}] ms",
                                  name=f"slos[{model!r}]", value=pair, limit=top)
        if not isinstance(self.prior_speed, SpeedProfile):
            raise ConfigError(f"FrontDoorConfig prior_speed={self.prior_speed!r} must be a "
                              f"SpeedProfile", name="prior_speed", value=self.prior_speed,
                              limit="SpeedProfile")
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
