"""Fleet-sizing policies the simulator compares, each a :class:`~agent.sim.events.Controller`.

Every policy sizes through the production code: Little's law from
:func:`agent.predictor.sizing.target_replicas`, and rewarm's own policy is the production
:class:`agent.predictor.loop.Predictor` itself (:class:`PredictorPolicy`, with the forecaster
its :class:`~agent.predictor.policy.ModelPolicy` names).  The baselines
are the alternatives a scale-to-zero fleet is compared with:

- :class:`FixedPool`: always-on, a constant number of replicas.
- :class:`Reactive`: size for the arrival rate measured over the last ``window_s`` plus the
  waiting backlog, at a utilisation (``1 / (1 + buffer)`` for the AOT document's "spare
  capacity buffer"); hold the peak for ``keepalive_s`` before scaling in.
"""

from __future__ import annotations

from collections import deque

from agent.predictor.sizing import target_replicas


class FixedPool:
    """Always ``replicas`` replicas."""

    def __init__(self, model: str, replicas: int) -> None:
        self.model = model
        self.replicas = replicas

    def tick(self, now_s: float, arrivals: int, sim) -> None:
        sim.fleet.set_target(self.model, self.replicas, reason="fixed pool")


class Reactive:
    """Scale on measured demand: ``target_replicas(rate + backlog / occupancy, ...)``.

    ``initial_rate_rps`` primes the window and the held target (a run that starts in steady
    state, with its initial replicas warm, must not scale them in on the first tick).

    ``rate`` is arrivals over the last ``window_s`` seconds of ticks; ``backlog`` the requests
    waiting in the admission queue.  The target holds its maximum over the last
    ``keepalive_s`` seconds (a fixed idle timeout before scale-in).
    """

    def __init__(self, model: str, *, seqs_per_replica: int, occupancy_s: float,
                 utilisation: float, min_replicas: int = 0, max_replicas: int = 10_000,
                 window_s: float = 10.0, keepalive_s: float = 60.0, tick_s: float = 1.0,
                 initial_rate_rps: float = 0.0) -> None:
        self.model = model
        self.seqs = seqs_per_replica
        self.occupancy_s = occupancy_s
        self.utilisation = utilisation
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.tick_s = tick_s
        window = max(1, round(window_s / tick_s))
        self._window: deque[float] = deque(maxlen=window)
        self._held: deque[int] = deque(maxlen=max(1, round(keepalive_s / tick_s)))
        # a run starts in steady state: the window has seen ``initial_rate_rps`` already
        self._window.extend([initial_rate_rps * tick_s] * window)
        self._held.append(target_replicas(initial_rate_rps, occupancy_s, seqs_per_replica,
                                          utilisation, min_replicas, max_replicas))

    def _need(self, rate_rps: float, sim) -> int:
        backlog_rps = sim.waiting / self.occupancy_s
        return target_replicas(rate_rps + backlog_rps, self.occupancy_s, self.seqs,
                               self.utilisation, self.min_replicas, self.max_replicas)

    def tick(self, now_s: float, arrivals: int, sim) -> None:
        self._window.append(arrivals)
        rate = sum(self._window) / (len(self._window) * self.tick_s)
        self._held.append(self._need(rate, sim))
        sim.fleet.set_target(self.model, max(self._held), reason="reactive")


class ConcurrencyBuffer:
    """The AOT document's autoscaler: keep ``buffer`` spare capacity over the calls in flight.

    Each tick: ``in_flight + waiting`` sequences, as a rate by Little's law, through
    ``target_replicas`` at utilisation ``1 / (1 + buffer)``; scale-in waits until the target
    has been lower for ``keepalive_s``.  Until ``floor_until_s`` it keeps at least
    ``floor_replicas`` (a run's warm-up: calls in flight build up from none).  Calls that were dropped are invisible to it, as they
    are to a real autoscaler that watches its replicas.
    """

    def __init__(self, model: str, *, seqs_per_replica: int, occupancy_s: float, buffer: float,
                 keepalive_s: float = 120.0, tick_s: float = 1.0, max_replicas: int = 10_000,
                 floor_replicas: int = 0, floor_until_s: float = 0.0) -> None:
        self.model = model
        self.floor_replicas = floor_replicas
        self.floor_until_s = floor_until_s
        self.seqs = seqs_per_replica
        self.occupancy_s = occupancy_s
        self.utilisation = 1.0 / (1.0 + buffer)
        self.max_replicas = max_replicas
        self._held: deque = deque(maxlen=max(1, round(keepalive_s / tick_s)))

    def tick(self, now_s: float, arrivals: int, sim) -> None:
        sequences = sim.in_flight + sim.waiting
        need = target_replicas(sequences / self.occupancy_s, self.occupancy_s, self.seqs,
                               self.utilisation, 0, self.max_replicas)
        if now_s < self.floor_until_s:
            need = max(need, self.floor_replicas)
        self._held.append(need)
        sim.fleet.set_target(self.model, max(self._held), reason="buffer over in-flight")


class PredictorPolicy:
    """rewarm's policy: the production :class:`~agent.predictor.loop.Predictor`, unchanged.

    Each tick feeds the tick's arrivals to ``Predictor.observe`` and calls ``Predictor.tick``,
    which calls ``Fleet.set_target`` (the fleet is its Scaler).  The decision's keep-alive
    plan says where released replicas go: ``release_tier == "suspend"`` parks them in the
    suspended tier for ``stop_s - warm_s`` seconds (when the fleet has that tier), else they
    stop.  The predictor is built by the caller so tests can hold and patch the very object.
    """

    def __init__(self, predictor, model: str) -> None:
        from agent.predictor.loop import Predictor

        if not isinstance(predictor, Predictor):
            raise TypeError(f"PredictorPolicy needs agent.predictor.loop.Predictor, "
                            f"got {type(predictor).__name__}")
        self.predictor = predictor
        self.model = model
        self.decisions = 0

    def tick(self, now_s: float, arrivals: int, sim) -> None:
        fleet = sim.fleet
        self.predictor.observe(self.model, arrivals, sim.tick_s)
        for d in self.predictor.tick():
            if d.model != self.model:
                continue
            self.decisions += 1
            plan = d.keepalive
            fleet.keep_suspended = fleet.cfg.keep_suspended and plan.release_tier == "suspend"
            fleet.suspended_ttl_s = max(0.0, plan.stop_s - plan.warm_s)
        fleet.expire_suspended()
