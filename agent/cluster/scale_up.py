"""Scale-from-zero through a :class:`~agent.cluster.base.Scaler`, one burst at a time.

The front door in cluster mode asks for capacity here instead of calling node agents: the
scaler (Nomad's scale API on the model's job) raises the target by one, Nomad places the
allocation (preferring nodes that cache the snapshot), the allocation's task asks its node's
agent to restore, the replica registers in Consul, and the front door's watch sees it.

Calls for one model are serialised: while one scale-up is waiting for its replica, another
call for the same model joins it (one burst scales once); and when the scaler's target is
already above the warm replicas seen (one is being placed, restored, or rescheduled after a
node failure) the call waits for that one instead of raising the target again.  ``warm_count(model)`` is the
caller's cached view (the front door's router), read every ``poll_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from agent.cluster.base import Scaler
from agent.errors import ClusterError, ConfigError, NoCapacity

log = logging.getLogger(__name__)


class ScaleUp:
    def __init__(self, scaler: Scaler, warm_count: Callable[[str], int], *,
                 timeout_s: float = 120.0, poll_s: float = 0.05) -> None:
        if not timeout_s > 0 or not poll_s > 0:
            raise ConfigError(f"ScaleUp timeout_s={timeout_s}, poll_s={poll_s}: both must be "
                              "> 0", name="timeout_s", value=(timeout_s, poll_s), limit="> 0")
        self._scaler, self._warm_count = scaler, warm_count
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._pending: dict[str, asyncio.Future] = {}
        self.scale_calls = 0

    async def one_more(self, model: str) -> float:
        """Seconds from the scale request until one replica more than before was warm.
        Raises NoCapacity (the scaler refused, or nothing came within ``timeout_s``)."""
        pending = self._pending.get(model)
        if pending is not None:
            return await asyncio.shield(pending)
        future = asyncio.get_running_loop().create_future()
        self._pending[model] = future
        try:
            elapsed = await self._scale(model)
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc if isinstance(exc, Exception) else
                                     NoCapacity(f"model {model!r}: scale-up cancelled",
                                                model=model))
                future.exception()   # retrieved: no "never retrieved" warning
            raise
        else:
            future.set_result(elapsed)
            return elapsed
        finally:
            self._pending.pop(model, None)

    async def _scale(self, model: str) -> float:
        loop = asyncio.get_running_loop()
        before = self._warm_count(model)
        try:
            current = await asyncio.to_thread(self._scaler.target, model)
            if current > before:
                # A replica is already on its way (placed, restoring, or rescheduled after
                # a node failure): wait for it rather than asking for another.
                target = current
            else:
                target = before + 1
                self.scale_calls += 1
                await asyncio.to_thread(self._scaler.set_target, model, target,
                                        reason="front door: requests queued, no warm replica fits")
        except (ClusterError, ConfigError) as exc:
            raise NoCapacity(f"model {model!r}: the scaler refused one more replica: {exc}",
                             model=model) from exc
        start = loop.time()
        while loop.time() - start < self.timeout_s:
            if self._warm_count(model) > before:
                return loop.time() - start
            await asyncio.sleep(self.poll_s)
        raise NoCapacity(f"model {model!r}: scaler target {target} set but no new replica "
                         f"within timeout_s({self.timeout_s})", model=model)
