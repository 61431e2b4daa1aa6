"""Scale-from-zero through a scaler: one burst scales once; a replica on its way is waited for."""

import asyncio

import pytest

from agent.cluster.scale_up import ScaleUp
from agent.errors import ClusterError, ConfigError, NoCapacity


class FakeScaler:
    def __init__(self, target=0, refuse=None):
        self._t, self.calls, self.refuse = target, [], refuse

    def target(self, model):
        return self._t

    def set_target(self, model, count, *, reason):
        if self.refuse:
            raise self.refuse
        self.calls.append(count)
        self._t = count


def test_a_burst_scales_once_and_every_caller_gets_the_replica():
    scaler, warm = FakeScaler(), {"m": 0}

    async def main():
        up = ScaleUp(scaler, lambda m: warm[m], timeout_s=5, poll_s=0.01)
        calls = [asyncio.create_task(up.one_more("m")) for _ in range(5)]
        await asyncio.sleep(0.05)
        warm["m"] = 1
        return await asyncio.gather(*calls), up.scale_calls
    results, n = asyncio.run(main())
    assert scaler.calls == [1] and n == 1 and len(results) == 5
    assert all(r >= 0 for r in results)


def test_a_replica_already_on_its_way_is_waited_for_not_doubled():
    scaler, warm = FakeScaler(target=2), {"m": 1}           # one rescheduled, not warm yet

    async def main():
        up = ScaleUp(scaler, lambda m: warm[m], timeout_s=5, poll_s=0.01)
        task = asyncio.create_task(up.one_more("m"))
        await asyncio.sleep(0.05)
        warm["m"] = 2
        return await task
    asyncio.run(main())
    assert scaler.calls == []


def test_refusal_and_timeout_are_no_capacity():
    async def one(scaler, timeout_s=5):
        return await ScaleUp(scaler, lambda m: 0, timeout_s=timeout_s, poll_s=0.01).one_more("m")
    with pytest.raises(NoCapacity) as err:
        asyncio.run(one(FakeScaler(refuse=ClusterError("max", service="nomad", status=400))))
    assert "refused" in str(err.value)
    with pytest.raises(NoCapacity) as err:
        asyncio.run(one(FakeScaler(), timeout_s=0.05))
    assert "timeout_s" in str(err.value)


def test_bad_timings():
    with pytest.raises(ConfigError):
        ScaleUp(FakeScaler(), lambda m: 0, timeout_s=0)
