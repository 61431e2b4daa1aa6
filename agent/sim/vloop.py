"""An asyncio event loop on virtual time: when nothing is ready it jumps to the next timer.

The simulator runs production asyncio code (the front door's
:class:`~agent.frontdoor.request_path.RequestPath`: its restore tasks, ``call_later``
back-offs, link write batching) unchanged, on the standard library's own loop: only the
loop's clock and its selector are replaced.  :meth:`VirtualLoop.time` reads a virtual clock;
the selector never blocks: asked to wait ``timeout`` seconds for I/O (there is none in a
simulation) it moves the clock on by ``timeout`` and returns, so the loop runs the timer
that was due then.  Ready callbacks run at the current virtual time, in the order asyncio
runs them.  ``select(None)`` (nothing scheduled, nothing ready, yet something awaited)
would wait forever: it raises :class:`~agent.errors.ConfigError` naming the virtual time
(a simulation that deadlocked), never hangs.

Why not a library: ``looptime`` (PyPI) fast-forwards loop time too, but it is built as a
pytest plugin around test fixtures and markers; the simulator is production code (``rewarm
simulate``, bench/trace_replay.py), and this is the few lines of it we need.

:class:`LoopClock` is the :class:`~agent.clock.Clock` to inject everywhere (request path,
predictor, scaler): it reads the running loop's virtual time.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any, TypeVar
from collections.abc import Awaitable

from agent.errors import ConfigError

T = TypeVar("T")


class _VirtualSelector(selectors.BaseSelector):
    """Keeps registrations (the loop's self-pipe) and never reports one ready; a wait of
    ``timeout`` seconds moves the virtual clock on by that much instead of blocking."""

    def __init__(self, loop_time: list[float]) -> None:
        self._now = loop_time          # one-element list shared with the loop: [seconds]
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj, events, data=None):
        key = selectors.SelectorKey(fileobj, selectors._fileobj_to_fd(fileobj), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj):
        return self._keys.pop(fileobj)

    def modify(self, fileobj, events, data=None):
        self.unregister(fileobj)
        return self.register(fileobj, events, data)

    def select(self, timeout=None):
        if timeout is None:
            raise ConfigError(f"virtual loop: nothing scheduled and nothing ready at "
                              f"t={self._now[0]:.6f} s, yet a task waits (a deadlock)",
                              name="virtual_time_s", value=self._now[0], limit="a timer")
        if timeout > 0:
            self._now[0] += timeout
        return []

    def get_map(self):
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    """The standard selector loop with a virtual :meth:`time` starting at ``start_s``."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._vnow = [float(start_s)]
        super().__init__(_VirtualSelector(self._vnow))
        # timers are due at the virtual time the selector moved to: no resolution slack
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._vnow[0]


class LoopClock:
    """:class:`~agent.clock.Clock` on ``loop``'s (virtual) time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def now(self) -> float:
        return self._loop.time()


def run_virtual(main: Awaitable[T], start_s: float = 0.0) -> T:
    """Run coroutine ``main`` to its end on a fresh :class:`VirtualLoop` (closed after; the
    tasks it left are cancelled first, as :func:`asyncio.run` does)."""
    loop = VirtualLoop(start_s)
    try:
        return loop.run_until_complete(main)
    finally:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
