"""The suspended tier through the node agent, with the fake libcuda at the driver boundary.

Replicas are in-process (real restores, real golden checks on a tiny model) but carry the pid
of a child process this test starts, which is what the CUDA checkpoint calls act on; the fake
driver keeps each pid's CUprocessState as the real one would."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent.clock import ManualClock
from agent.cluster.base import parked_replicas, resume_eta_s
from agent.errors import ConfigError
from agent.frontdoor.capacity import nodes_from_registry
from agent.node.agent import AgentConfig, NodeAgent
from agent.node.backend import InProcessBackend, InProcessReplica, ModelSpec
from agent.node.cuda_checkpoint import CudaCheckpointDriver, ProcessState
from agent.node.inventory import Inventory
from agent.node.suspend import ParkedTier, Suspender
from agent.snapshot.catalog import Catalog
from agent.snapshot.store import LocalStore
from tests.node.conftest import C_RESTORE, DownableRegistry

PROMPT = [[3, 1, 4, 1, 5]]


class PidBackend(InProcessBackend):
    """In-process replicas that report ``pid`` (a child started by the test) as their own."""

    def __init__(self, pid: int) -> None:
        super().__init__(buffer_bytes=1 << 20)
        self.pid = pid

    def cold_boot(self, spec, device, replica_id):
        rep = super().cold_boot(spec, device, replica_id)
        rep.pid = self.pid
        return rep

    def zygote(self, device, *, warm=None, background=True):
        z = super().zygote(device, warm=warm, background=background)
        restore, pid = z.restore, self.pid

        def with_pid(snapshot, replica_id) -> InProcessReplica:
            rep = restore(snapshot, replica_id)
            rep.pid = pid
            return rep
        z.restore = with_pid
        return z


@pytest.fixture
def child():
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.fixture
def agent(tmp_path, tiny_dir, cuda_ffi, fake_libcuda_path, fake, child):
    clock = ManualClock(1000.0)
    suspender = Suspender(CudaCheckpointDriver(library=str(fake_libcuda_path), ffi=cuda_ffi),
                          toggle_timeout_s=5.0, clock=clock)
    a = NodeAgent(AgentConfig(node_id="n1", drain_timeout_s=2.0, drain_poll_s=0.5),
                  models=[ModelSpec(tiny_dir)], backend=PidBackend(child.pid),
                  catalog=Catalog(tmp_path / "catalog.db", clock=clock),
                  store=LocalStore(tmp_path / "nvme", 1 << 30, clock=clock),
                  registry=DownableRegistry(clock), inventory=Inventory([], "test: cpu"),
                  clock=clock, executor=ThreadPoolExecutor(2), sleep=clock.advance,
                  suspender=suspender)
    yield a
    a.executor.shutdown(wait=True)


def _warm_up(agent):
    info = agent.restore("tiny")
    agent.captures[agent.models["tiny"].key].result(timeout=120)
    agent.tick()
    return info


def _registry_meta(agent):
    agent.tick()
    reg = agent.registrar.registry
    (me,) = [i for i in reg.healthy("rewarm-agent") if i.id == agent.agent_instance.id]
    replicas = [i.id for i in reg.healthy("rewarm-replica")]
    return me.meta, replicas


def test_parked_replica_leaves_routing_and_shows_its_tier(agent, fake, child):
    info = _warm_up(agent)
    rid = info["replica"]
    before = agent.replicas[rid].handle.generate(PROMPT, 6, seed=5)
    out = agent.suspend(rid)
    assert out["state"] == "suspended" and list(out["steps_s"]) == ["lock", "checkpoint"]
    assert agent.suspender.state(child.pid) is ProcessState.CHECKPOINTED
    meta, replicas = _registry_meta(agent)
    assert rid not in replicas                                  # answers no routed request
    assert parked_replicas(meta, "tiny") == [rid] and resume_eta_s(meta) is None
    # a restore of the model resumes the parked replica: no snapshot read, no new replica
    up = agent.restore("tiny")
    assert (up["replica"], up["path"], up["state"]) == (rid, "resume", "warm")
    assert agent.suspender.state(child.pid) is ProcessState.RUNNING
    meta, replicas = _registry_meta(agent)
    assert rid in replicas and parked_replicas(meta, "tiny") == []
    assert resume_eta_s(meta) is not None and resume_eta_s(meta) >= 0
    assert agent.replicas[rid].handle.generate(PROMPT, 6, seed=5) == before


def test_the_front_door_tries_the_node_with_a_parked_replica_first(agent):
    rid = _warm_up(agent)["replica"]
    reg = agent.registrar.registry
    from agent.cluster.base import ServiceInstance
    reg.register(ServiceInstance("rewarm-agent", "rewarm-agent-a0", "10.0.0.1", 1,
                                 meta={"snapshots": "tiny@x"}), 30.0)
    agent.agent_instance.address, agent.agent_instance.port = "10.0.0.2", 2
    agent.registrar.want(agent.agent_instance)
    agent.tick()
    nodes = nodes_from_registry(reg)
    assert nodes("tiny")[0] == ("10.0.0.1", 1)                 # "a0" sorts first otherwise
    agent.suspend(rid)
    agent.tick()
    assert nodes("tiny")[0] == ("10.0.0.2", 2)


def test_a_busy_replica_is_not_frozen_mid_request(agent, fake):
    rid = _warm_up(agent)["replica"]
    handle = agent.replicas[rid].handle
    handle._in_flight = 1                                        # a request that never ends
    with pytest.raises(ConfigError) as err:
        agent.suspend(rid)
    assert err.value.value == 1 and agent.replicas[rid].lifecycle.state.value == "warm"
    _, replicas = _registry_meta(agent)
    assert rid in replicas                                      # registered again
    handle._in_flight = 0
    assert agent.suspend(rid)["state"] == "suspended"


def test_a_failed_resume_kills_the_process_and_restores_from_the_snapshot(agent, fake, child):
    rid = _warm_up(agent)["replica"]
    agent.suspend(rid)
    fake.fake_set_result(C_RESTORE, 2)                          # CUDA_ERROR_OUT_OF_MEMORY
    out = agent.resume(rid)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in out["resume_failed"]
    assert out["replica"] != rid and out["path"] == "restore"
    assert child.wait(timeout=10) == -9
    assert agent.replicas[rid].lifecycle.state.value == "dead"


def test_parked_tier_eta_is_the_p99_of_measured_resumes():
    tier = ParkedTier(window=200)
    assert tier.eta_s() is None
    for i in range(1, 201):
        tier.record_resume(i / 100)
    assert tier.eta_s() == 1.98                                  # 198th of 200 sorted
    meta = tier.meta([("m", "v1", "r2"), ("m", "v1", "r1")])
    assert meta == {"suspended": "m@v1:r1,m@v1:r2", "resume_p99_s": "1.98"}
    assert parked_replicas(meta, "m") == ["r1", "r2"] and parked_replicas(meta, "other") == []
    with pytest.raises(ConfigError):
        ParkedTier(window=0)
    assert resume_eta_s({"resume_p99_s": "nan"}) is None
    assert resume_eta_s({"resume_p99_s": "-1"}) is None
    assert resume_eta_s({"resume_p99_s": "x"}) is None
