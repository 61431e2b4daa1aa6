"""When the zygote pool is refilled around a restore: at once on the CPU (the next zygote warms
at background priority beside the restore), only after it on a GPU (a new zygote's CUDA
context, buffer zeroing and warm-up kernels would share the device with the restore's reads,
golden check and first token); and a restore takes the zygote warmed for its snapshot."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from agent.clock import ManualClock
from agent.node import ladder as ladder_mod
from agent.node.agent import AgentConfig, NodeAgent
from agent.node.backend import InProcessBackend, InProcessReplica, InProcessZygote, ModelSpec
from agent.node.inventory import Gpu, Inventory
from agent.replica import zygote as zygote_mod
from agent.snapshot.catalog import Catalog
from agent.snapshot.store import LocalStore
from tests.node.conftest import DownableRegistry

H200 = Gpu(0, "NVIDIA H200", "GPU-0", 141 << 30, "580.65.06", "9.0")


class Recording(InProcessBackend):
    """In-process zygotes and boots that run on the CPU whatever device they are given, and
    note when a zygote's restore starts and ends."""

    def __init__(self, events: list[str]) -> None:
        super().__init__(buffer_bytes=1 << 20)
        self.events = events

    def zygote(self, device, *, warm=None, background=True):
        events = self.events

        class Z(InProcessZygote):
            def restore(self, snapshot, replica_id):
                events.append("restore")
                return super().restore(snapshot, replica_id)
        z = Z("cpu", self.buffer_bytes)
        z.warm = warm
        return z

    def cold_boot(self, spec, device, replica_id):
        return InProcessReplica(replica_id, zygote_mod.boot(spec.model_dir, device="cpu"))


@pytest.fixture
def make(tmp_path, tiny_dir, monkeypatch):
    made = []
    # the captures pin the CPU they ran on; the node's device here is a (stand-in) GPU
    monkeypatch.setattr(ladder_mod, "check_pins", lambda *args: None)

    def build(gpus):
        events: list[str] = []
        clock = ManualClock(1000.0)
        agent = NodeAgent(AgentConfig(node_id="n1"), models=[ModelSpec(tiny_dir)],
                          backend=Recording(events),
                          catalog=Catalog(tmp_path / f"c{len(made)}.db", clock=clock),
                          store=LocalStore(tmp_path / f"nvme{len(made)}", 1 << 30, clock=clock),
                          registry=DownableRegistry(clock),
                          inventory=Inventory(gpus, None if gpus else "test: cpu"),
                          clock=clock, executor=ThreadPoolExecutor(2), sleep=clock.advance)
        made.append(agent)
        return agent, events
    yield build
    for agent in made:
        agent.executor.shutdown(wait=True)


@pytest.mark.parametrize("gpus, device, order", [
    ([], "cpu", ["refill", "restore", "refill"]),
    ([H200], "cuda:0", ["restore", "refill"]),
])
def test_the_pool_is_refilled_beside_a_cpu_restore_and_after_a_gpu_one(make, gpus, device,
                                                                        order):
    agent, events = make(gpus)
    first = agent.restore("tiny")                       # cold boot, then the capture
    agent.captures[agent.models["tiny"].key].result(timeout=120)
    agent.drain(first["replica"])
    events.clear()
    agent.ladder._refill = lambda: events.append("refill")
    info = agent.restore("tiny", device)
    assert info["path"] == "restore" and info["device"] == device
    assert events == order


def test_a_restore_takes_the_zygote_warmed_for_its_snapshot(make):
    agent, _ = make([])
    first = agent.restore("tiny")
    row = agent.captures[agent.models["tiny"].key].result(timeout=120)
    agent.drain(first["replica"])
    snap = agent.store.path(row.snapshot_id)
    agent.executor.submit(lambda: None).result()        # the capture's own refill is done
    cold, warm = InProcessZygote("cpu", 1 << 20), InProcessZygote("cpu", 1 << 20)
    warm.warm = snap
    agent.pool["cpu"][:] = [cold, warm]                 # the unwarmed one is older
    assert agent.warm_for("cpu") == snap
    assert agent.zygotes.take("cpu", "tiny") is warm
    assert agent.zygotes.take("cpu", "tiny") is cold     # none warmed for it: the oldest
