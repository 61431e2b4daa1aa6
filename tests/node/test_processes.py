"""The agent with replicas in their own processes (``rewarm replica``): cold boot, capture,
restore into a zygote process, suspend/resume through the (fake) CUDA checkpoint driver, a
failed resume falling back to a snapshot restore, and a zygote killed mid-restore."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from agent.clock import ManualClock
from agent.cluster.local import LocalRegistry
from agent.node.agent import AgentConfig, NodeAgent
from agent.node.backend import ModelSpec
from agent.node.lifecycle import IllegalTransition
from agent.node.cuda_checkpoint import CudaCheckpointDriver
from agent.node.inventory import Inventory
from agent.node.priority import thread_nices
from agent.node.processes import ProcessBackend
from agent.node.suspend import Suspender
from agent.snapshot.catalog import Catalog
from agent.snapshot.store import LocalStore

C_RESTORE = 4
PROMPTS = [[5, 6, 7, 8, 9]]


@pytest.mark.slow
def test_process_replicas_end_to_end(tmp_path, tiny_dir, cuda_ffi, fake_libcuda_path, fake):
    clock = ManualClock()
    backend = ProcessBackend(tmp_path / "run", buffer_mib=8, threads=1, ready_timeout_s=120,
                             request_timeout_s=120)
    suspender = Suspender(CudaCheckpointDriver(str(fake_libcuda_path), ffi=cuda_ffi), clock=clock)
    registry = LocalRegistry(clock)
    agent = NodeAgent(AgentConfig(node_id="p1", zygotes_per_device=1), models=[ModelSpec(tiny_dir)],
                      backend=backend, catalog=Catalog(tmp_path / "c.db", clock=clock),
                      store=LocalStore(tmp_path / "nvme", 1 << 30, clock=clock), registry=registry,
                      inventory=Inventory([], "test"), clock=clock, suspender=suspender,
                      executor=ThreadPoolExecutor(2), sleep=clock.advance)
    try:
        first = agent.restore("tiny")
        assert first["path"] == "cold_boot" and first["address"].startswith("unix:")
        row = agent.captures[agent.models["tiny"].key].result(timeout=300)
        assert row.status == "ready"
        cold_pid = agent.replicas[first["replica"]].handle.pid
        want = agent.replicas[first["replica"]].handle.generate(PROMPTS, 5, seed=1)

        # a waiting zygote runs at background priority; restored, it serves at nice 0
        agent.refill_pool()
        waiting = agent.pool["cpu"][0]      # warmed for the snapshot it will restore
        assert waiting.worker.proc.args[-4:-2] == ["--warm", str(agent.store.path(row.snapshot_id))]
        assert set(thread_nices(waiting.pid).values()) == {backend.zygote_nice} != {0}
        second = agent.restore("tiny")
        assert (second["path"], second["snapshot"]) == ("restore", row.snapshot_id)
        handle = agent.replicas[second["replica"]].handle
        assert handle.pid == waiting.pid != cold_pid
        assert set(thread_nices(handle.pid).values()) == {0}
        assert handle.generate(PROMPTS, 5, seed=1) == want

        # suspend/resume with the fake driver: the registry stops routing while suspended
        sus = agent.suspend(second["replica"])
        assert sus["state"] == "suspended" and list(sus["steps_s"]) == ["lock", "checkpoint"]
        assert second["replica"] not in [i.id for i in registry.healthy("rewarm-replica")]
        res = agent.resume(second["replica"])
        assert res["state"] == "warm"
        with pytest.raises(IllegalTransition):
            agent.resume(second["replica"])           # warm now: nothing to resume
        assert second["replica"] in [i.id for i in registry.healthy("rewarm-replica")]

        # a failed resume (out of device memory): kill the process, restore from the snapshot
        agent.suspend(second["replica"])
        fake.fake_set_result(C_RESTORE, 2)
        again = agent.resume(second["replica"])
        assert "CUDA_ERROR_OUT_OF_MEMORY" in again["resume_failed"]
        assert again["path"] == "restore" and again["replica"] != second["replica"]
        assert agent.replicas[second["replica"]].lifecycle.state.value == "dead"
        handle.worker.proc.wait(timeout=10)
        assert handle.worker.proc.returncode == -signal.SIGKILL
        assert agent.replicas[again["replica"]].handle.generate(PROMPTS, 5, seed=1) == want

        # a zygote killed mid-restore: fails closed, the next rung serves the right tokens
        agent.refill_pool()
        zygote = agent.pool["cpu"][0]
        original = zygote.restore

        def restore_then_die(snapshot, replica_id):
            threading.Timer(0.0, os.kill, (zygote.pid, signal.SIGKILL)).start()
            return original(snapshot, replica_id)

        zygote.restore = restore_then_die
        third = agent.restore("tiny")
        assert third["attempts"] and third["attempts"][0]["path"] == "restore"
        assert third["path"] == "cold_boot"
        assert agent.replicas[third["replica"]].handle.generate(PROMPTS, 5, seed=1) == want

        # Workers are in their own process group (a terminal's Ctrl-C reaches the agent only);
        # one that exits on its own reads as 0 in flight, not as a missing socket.
        exiting = agent.replicas[third["replica"]].handle
        assert os.getpgid(exiting.pid) == exiting.pid != os.getpgid(0)
        os.kill(exiting.pid, signal.SIGTERM)
        seen = []
        while exiting.alive() and len(seen) < 10_000:   # every read while it exits: no raise
            seen.append(exiting.in_flight())
        assert set(seen) <= {0} and not exiting.alive()
        assert exiting.in_flight() == 0

        # A replica killed outright: the agent loop marks it dead and removes its socket file.
        killed = agent.replicas[again["replica"]].handle
        os.kill(killed.pid, signal.SIGKILL)
        killed.worker.proc.wait(timeout=10)
        assert killed.worker.socket_path.exists()
        agent.tick()
        assert agent.replicas[again["replica"]].lifecycle.state.value == "dead"
        assert not killed.worker.socket_path.exists()
        log = killed.worker.log_path
        assert not log.exists() or log.stat().st_size > 0     # empty logs are not left behind
    finally:
        agent.close()


def test_device_env_pins_one_gpu():
    from agent.node.processes import device_env

    assert device_env("cuda:3") == {"CUDA_VISIBLE_DEVICES": "3"}
    assert device_env("cuda") == {"CUDA_VISIBLE_DEVICES": "0"}
    assert device_env("cpu") == {"CUDA_VISIBLE_DEVICES": ""}
