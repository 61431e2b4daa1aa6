"""The simulator drives the production admission queue, router and predictor, not copies.

Each test patches a method of the production class and checks that the simulation's outcome
changes: a simulator with its own admission or predictor would not notice.
"""

import pytest

from agent.errors import Overloaded
from agent.frontdoor.admission import AdmissionQueue
from agent.frontdoor.router import Router
from agent.predictor.loop import Predictor
from agent.sim.policies import PredictorPolicy
from agent.sim.scenarios import CostShape, cost_policies, cost_workload, run_workload

SHAPE = CostShape(hours=0.25, burst_s=120.0, burst_period_s=600.0)


def run_rewarm(seed=0):
    cfg, make, initial = cost_policies(SHAPE)["rewarm"]
    w = cost_workload(SHAPE, seed)
    return run_workload(w, cfg, make, max_wait_s=SHAPE.sla_s - SHAPE.prefill_s,
                        sla_s=SHAPE.sla_s, initial_replicas=initial, end_s=SHAPE.hours * 3600)


def test_objects_are_the_production_classes():
    s, rec, sim = run_rewarm()
    assert type(sim.queue) is AdmissionQueue
    assert type(sim.router) is Router
    assert isinstance(sim.controller, PredictorPolicy)
    assert type(sim.controller.predictor) is Predictor
    assert sim.controller.decisions == len(rec.tick_t_s)    # it ticked every second
    # the predictor's scaler is the simulated fleet, through the Scaler protocol
    assert sim.controller.predictor._scaler is sim.fleet
    assert s["served"] > 0.99 * s["requests"]


def test_patching_router_choose_changes_outcome(monkeypatch):
    base, _, _ = run_rewarm()
    monkeypatch.setattr(Router, "choose", lambda self, model, need_tokens: None)
    s, _, _ = run_rewarm()
    assert base["served"] > 0 and s["served"] == 0
    assert s["expired"] + s["shed"] + s["unfinished"] == s["requests"]


def test_patching_admission_offer_changes_outcome(monkeypatch):
    base, _, _ = run_rewarm()

    def refuse(self, p):
        raise Overloaded("patched", model=self.model, retry_after_ms=1, depth=0, limit=0)

    monkeypatch.setattr(AdmissionQueue, "offer", refuse)
    s, _, _ = run_rewarm()
    assert s["shed"] == s["queued"] > 0
    assert s["shed"] != base["shed"]


def test_patching_predictor_tick_changes_outcome(monkeypatch):
    base, _, _ = run_rewarm()
    monkeypatch.setattr(Predictor, "tick", lambda self, act=True: [])
    s, rec, _ = run_rewarm()
    # no scaling: the initial 3 replicas stay, the burst is not covered
    assert int(rec.billed_replicas.max()) == 3
    assert s["sla_compliance"] < base["sla_compliance"]
    assert s["gpu_hours"] < base["gpu_hours"]


def test_predictor_policy_refuses_a_substitute():
    class FakePredictor:
        def observe(self, *a, **k): ...
        def tick(self): return []

    with pytest.raises(TypeError, match="agent.predictor.loop.Predictor"):
        PredictorPolicy(FakePredictor(), "m")
