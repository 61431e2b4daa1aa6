"""The node agent's restore into a zygote's device buffer, and its fallback, as the agent
reports them (answer, log, metrics).  The fake kvikio writes into host tensors standing in for
device memory, so the agent's real ladder, restore and golden check run here."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from agent.clock import ManualClock
from agent.node.agent import AgentConfig, NodeAgent
from agent.node.backend import InProcessBackend, InProcessZygote, ModelSpec
from agent.node.inventory import Inventory
from agent.snapshot import gpu
from agent.snapshot.catalog import Catalog
from agent.snapshot.store import LocalStore
from tests.fake_kvikio import FakeKvikio
from tests.node.conftest import DownableRegistry


class DeviceBufferBackend(InProcessBackend):
    """Zygotes whose buffer is a DeviceBuffer on "cpu" read through ``kvikio``."""

    def zygote(self, device, *, warm=None, background=True):
        z = InProcessZygote(device, 0)
        z.buffer = gpu.DeviceBuffer.allocate(1 << 20, "cpu", kvikio=self.kvikio)
        z.warm = warm
        return z


@pytest.fixture
def make(tmp_path, tiny_dir):
    made = []

    def build(kvikio):
        clock = ManualClock(1000.0)
        a = NodeAgent(AgentConfig(node_id="n1"), models=[ModelSpec(tiny_dir)],
                      backend=DeviceBufferBackend(kvikio=kvikio),
                      catalog=Catalog(tmp_path / f"c{len(made)}.db", clock=clock),
                      store=LocalStore(tmp_path / f"nvme{len(made)}", 1 << 30, clock=clock),
                      registry=DownableRegistry(clock), inventory=Inventory([], "test: cpu"),
                      clock=clock, executor=ThreadPoolExecutor(2), sleep=clock.advance)
        made.append(a)
        return a
    yield build
    for a in made:
        a.executor.shutdown(wait=True)


def _reads(agent, io, fallback):
    return agent.metrics.registry.get_sample_value(
        "rewarm_node_restore_reads_total", {"node": "n1", "io": io, "fallback": fallback}) or 0


def _scale_to_zero_and_back(agent):
    first = agent.restore("tiny")
    agent.captures[agent.models["tiny"].key].result(timeout=120)
    agent.drain(first["replica"])
    return agent.restore("tiny")


def test_restore_reads_into_device_memory_and_says_how(make):
    fake = FakeKvikio()
    agent = make(fake)
    info = _scale_to_zero_and_back(agent)
    assert (info["path"], info["restore_io"]) == ("restore", "compat")
    assert "fallback" not in info and fake.reads
    assert _reads(agent, "compat", "none") == 1


def test_a_failed_device_read_falls_back_to_the_host_path_logged_and_counted(make, caplog):
    agent = make(FakeKvikio(fail_at=0))
    info = _scale_to_zero_and_back(agent)
    assert (info["path"], info["restore_io"]) == ("restore", "host")
    assert info["fallback"].startswith("RuntimeError: POSIX error")
    assert info["attempts"] == []                  # the snapshot was fine: no rung failed
    assert "read through host memory: the device read failed" in caplog.text
    assert _reads(agent, "host", "io") == 1 and _reads(agent, "compat", "none") == 0


def test_a_snapshot_bad_on_disk_goes_on_to_a_cold_boot(make):
    agent = make(FakeKvikio())
    first = agent.restore("tiny")
    row = agent.captures[agent.models["tiny"].key].result(timeout=120)
    agent.drain(first["replica"])
    data = agent.store.path(row.snapshot_id) / "data-00000.bin"
    with open(data, "r+b") as f:
        f.seek(64)
        b = f.read(1)
        f.seek(64)
        f.write(bytes([b[0] ^ 1]))
    info = agent.restore("tiny")
    assert info["path"] == "cold_boot"
    assert [a["status"] for a in info["attempts"]] == ["corrupt"]


def test_a_restore_without_a_device_goes_to_the_least_busy_gpu(tmp_path, tiny_dir):
    from agent.node.agent import ReplicaRecord
    from agent.node.inventory import Gpu
    from agent.node.lifecycle import Lifecycle, ReplicaState

    gpus = [Gpu(i, "NVIDIA H200", f"GPU-{i}", 141 << 30, "580.65", "9.0") for i in range(2)]
    clock = ManualClock(1000.0)
    agent = NodeAgent(AgentConfig(node_id="n1"), models=[ModelSpec(tiny_dir)],
                      backend=InProcessBackend(), catalog=Catalog(tmp_path / "c.db", clock=clock),
                      store=LocalStore(tmp_path / "nvme", 1 << 30, clock=clock),
                      registry=DownableRegistry(clock), inventory=Inventory(gpus), clock=clock,
                      executor=ThreadPoolExecutor(1), sleep=clock.advance)
    try:
        assert agent.ladder._device(None) == "cuda:0"
        rec = ReplicaRecord(Lifecycle("r1", clock=clock), agent.spec("tiny"), "cuda:0")
        rec.lifecycle.move(ReplicaState.WARM, "test")
        agent.replicas["r1"] = rec
        assert agent.ladder._device(None) == "cuda:1"
        rec.lifecycle.move(ReplicaState.DEAD, "test")
        assert agent.ladder._device(None) == "cuda:0"
        assert sorted(agent.pool) == ["cuda:0", "cuda:1"]    # zygotes kept per device
        assert agent.pool_target("cuda:1") == 1
    finally:
        agent.executor.shutdown(wait=True)
