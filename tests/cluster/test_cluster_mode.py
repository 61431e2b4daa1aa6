"""Cluster-mode wiring of the front door: the Nomad scaler it chooses registers a missing job
through Nomad's parser and scales it; catalog models reach the front door's known models on
its loop."""

import asyncio
import types

from agent.cluster import ClusterChoice, choose


def test_nomad_scaler_registers_from_jobs_and_scales(nomad_standin, monkeypatch):
    monkeypatch.setenv("NOMAD_ADDR", nomad_standin.url)
    scaler = choose("scaler", ClusterChoice(scaler="nomad", max_replicas=3))
    assert scaler.target("tiny") == 0
    scaler.set_target("tiny", 1, reason="front door: requests queued")
    job = nomad_standin.job("rewarm-replica-tiny")
    assert job["TaskGroups"][0]["Count"] == 1 and job["TaskGroups"][0]["Scaling"]["Max"] == 3
    assert "model = \"tiny\"" in nomad_standin.parse_requests[-1]["Variables"]


def test_catalog_models_are_learned_on_the_loop():
    from agent.frontdoor.cli import _learn_models

    fd = types.SimpleNamespace(known_models={"given"}, config=types.SimpleNamespace(
        models={"given": 1000.0}), _deadline_ms={"given": 1000.0})

    async def main():
        on_change = _learn_models(fd, asyncio.get_running_loop())
        on_change({"given": {"deadline_ms": 5.0}, "tiny": {"deadline_ms": 20000.0}, "b": {}})
        await asyncio.sleep(0.01)
    asyncio.run(main())
    assert fd.known_models == {"given", "tiny", "b"}
    assert fd._deadline_ms == {"given": 1000.0, "tiny": 20000.0}   # --model wins over the catalog
