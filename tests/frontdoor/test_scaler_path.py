"""A restore through a scaler (Nomad) learns its tier from the replica that appeared: the node
agent's ``came_up`` meta.  A cold boot through Nomad must not become a snapshot restore's ETA
(that made every request after a scale-in a 429 in the cluster scenario)."""

import asyncio

from agent.cluster.base import ServiceInstance
from agent.cluster.local import LocalRegistry
from agent.frontdoor.capacity import RestoreResult
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.router import ReplicaLoad
from agent.frontdoor.server import FrontDoor

LOAD = {"max_seqs": "4", "active_seqs": "0", "kv_capacity_tokens": "4096", "kv_used_tokens": "0"}


def replica(rid: str, came_up: str) -> ServiceInstance:
    return ServiceInstance("rewarm-replica", rid, "127.0.0.1", 1, tags=["model=m"],
                           meta={**LOAD, "came_up": came_up})


def test_came_up_meta_is_parsed_and_optional():
    assert ReplicaLoad.from_instance(replica("r", "cold_boot")).came_up == "cold_boot"
    bare = ServiceInstance("rewarm-replica", "b", "127.0.0.1", 1, tags=["model=m"], meta=LOAD)
    assert ReplicaLoad.from_instance(bare).came_up == ""


class AppearsThroughRegistry:
    """A scaler-like requester: the new replica shows up in the front door's view, the
    answer carries no replica and the default path."""

    def __init__(self, fd, came_up):
        self.fd, self.came_up, self.n = fd, came_up, 0

    async def request_restore(self, model):
        self.n += 1
        self.fd.path.apply_replicas([replica(f"r{self.n}", self.came_up)])
        return RestoreResult(None, "snapshot_restore", 8000.0)


def run_one(came_up: str):
    async def main():
        fd = FrontDoor(FrontDoorConfig(models={"m": 60_000.0}), registry=LocalRegistry())
        fd.path.capacity = AppearsThroughRegistry(fd, came_up)
        await fd.path.restores.restore("m")
        return fd.path
    return asyncio.run(main())


def test_a_cold_boot_through_the_scaler_is_not_a_snapshot_restore_eta():
    path = run_one("cold_boot")
    assert path.models.of("m").last_restore.path == "cold_boot"
    assert path.restore_times.p99_ms("m", "snapshot_restore") is None


def test_a_restore_through_the_scaler_is_measured_as_one():
    path = run_one("restore")
    assert path.models.of("m").last_restore.path == "snapshot_restore"
    assert path.restore_times.p99_ms("m", "snapshot_restore") == 8000.0
