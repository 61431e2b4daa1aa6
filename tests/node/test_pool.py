"""The zygote pool (agent/node/pool.py) against a backend that fails: one device's failing
zygote start does not stop the others' refill, and is logged with the device and the error."""

from __future__ import annotations

from agent.errors import RewarmError
from agent.node.pool import ZygotePool


class _Zygote:
    pid = None

    def __init__(self, device, warm):
        self.device, self.warm, self.killed = device, warm, False

    def kill(self):
        self.killed = True

    def alive(self):
        return not self.killed


class _Backend:
    """Starts zygotes, except on the devices in ``broken`` (the worker never got ready)."""

    def __init__(self, broken=()):
        self.broken, self.started = set(broken), []

    def zygote(self, device, *, warm=None, background=True):
        if device in self.broken:
            raise RewarmError(f"zygote on {device}: worker exited before ready (rc 1)")
        self.started.append(device)
        return _Zygote(device, warm)


def test_one_device_failing_does_not_stop_the_others(caplog):
    backend = _Backend(broken={"cuda:0"})
    pool = ZygotePool(backend, ["cuda:0", "cuda:1"], target=lambda d: 2, warm_for=lambda d: None)
    assert pool.refill() == 2
    assert pool.counts() == {"cuda:0": 0, "cuda:1": 2}
    assert "cuda:0" in caplog.text and "worker exited before ready" in caplog.text
    backend.broken.clear()                   # the device recovers: the next refill fills it
    assert pool.refill() == 2 and pool.counts() == {"cuda:0": 2, "cuda:1": 2}
    ready = [*pool.ready["cuda:0"], *pool.ready["cuda:1"]]
    pool.close()
    assert all(z.killed for z in ready) and pool.counts() == {"cuda:0": 0, "cuda:1": 0}


def test_a_target_of_zero_starts_nothing():
    backend = _Backend()
    pool = ZygotePool(backend, ["cpu"], target=lambda d: 0, warm_for=lambda d: None)
    assert pool.refill() == 0 and backend.started == []
    taken = pool.take("cpu", "m")             # a restore still gets one, started for it
    assert taken.device == "cpu" and pool.counts() == {"cpu": 0}


def test_a_refill_after_close_starts_nothing_and_one_under_way_kills_what_it_made():
    backend = _Backend()
    pool = ZygotePool(backend, ["cpu"], target=lambda d: 2, warm_for=lambda d: None)
    pool.close()
    assert pool.refill() == 0 and backend.started == []      # nobody would kill them
    made = []

    class Closing(_Backend):        # close() runs while the refill's zygote starts
        def zygote(self, device, *, warm=None, background=True):
            made.append(_Zygote(device, warm))
            pool2.close()
            return made[-1]
    pool2 = ZygotePool(Closing(), ["cpu"], target=lambda d: 2, warm_for=lambda d: None)
    assert pool2.refill() == 0
    assert [z.killed for z in made] == [True] and pool2.counts() == {"cpu": 0}
