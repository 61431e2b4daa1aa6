"""docs/grafana-dashboard.json: loaded as JSON, every panel's query names metrics that rewarm
really exposes (collected from the front door's Telemetry, the node agent's NodeMetrics, a
replica's registry and the predictor's), with the labels the query groups or filters by."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.clock import ManualClock
from agent.node.lifecycle import ReplicaState
from agent.node.metrics import NodeMetrics
from agent.predictor.loop import ModelPolicy, Predictor
from agent.predictor.service import PredictorService
from agent.replica.meter import replica_registry
from agent.telemetry import Telemetry

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")
PROMQL_WORDS = {"sum", "by", "without", "rate", "increase", "histogram_quantile", "max", "min",
                "avg", "count", "irate", "label_values", "on", "ignoring", "and", "or", "unless",
                "offset", "bool", "group_left", "group_right"}
# labels Prometheus adds at scrape time, not the exposition
SCRAPE_LABELS = {"le", "job", "instance"}


def registries() -> dict:
    """Each component's registry, as its status port serves it, after some traffic:
    front door, node agent, replica, predictor."""
    t = Telemetry()
    t.event(1, "m", "warm_hit", 200, 5.0, None, 12.0, False, predicted_ttft_ms=10.0,
            done={"prompt_tokens": 4, "n_tokens": 3, "total_ms": 30.0},
            token_gaps=[(0.01, 1), (0.02, 2)])
    t.event(2, "m", "refused", 429, 0.0, None, None, False, reason="queue_full")
    t.queue_depth("m", 1)
    node = NodeMetrics("n1")
    record = SimpleNamespace(spec=SimpleNamespace(name="m"), path="restore", snapshot_id="s1",
                             phase_since_s=0.0, attempts=[
        {"path": "restore", "error": "SnapshotCorrupt"}], lifecycle=SimpleNamespace(
        state=ReplicaState.WARM), phase="restore", last_stats={
        "tokens_per_s": 1.0, "batch_size": 1, "queued_prefill_tokens": 3, "active_seqs": 1},
        handle=None)
    record.last_stats["phases_s"] = {"weights_s": 0.1, "package_s": 0.1, "golden_s": 0.2}
    node.attach(SimpleNamespace(store=SimpleNamespace(used_bytes=1, capacity_bytes=2),
                                pool={"cpu": []}, replicas={"r": record},
                                lock=threading.Lock()))
    catalog = SimpleNamespace(snapshot=lambda sid: SimpleNamespace(size_bytes=100))
    node.restore_finished(record, 1.0, True, catalog)
    replica = replica_registry(lambda: {"model": "m", "generated_tokens": 3})
    clock = ManualClock()

    class Scaler:
        def set_target(self, model, count, *, reason):
            pass

        def target(self, model):
            return 0

    predictor = PredictorService(Predictor([ModelPolicy("m")], clock=clock, scaler=Scaler(),
                                           snapshot_durable=lambda m: True),
                                 clock=clock, fetch=lambda: {"a": {"arrivals": {"m": 1}}})
    for _ in range(3):
        clock.advance(1)
        predictor.step()
    return {"frontdoor": t.registry, "agent": node.registry, "replica": replica,
            "predictor": predictor.registry}


def exposed() -> dict[str, set[str]]:
    """Every sample name rewarm exposes -> the label names seen on it."""
    out: dict[str, set[str]] = {}
    for registry in registries().values():
        text = generate_latest(registry).decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, set()).update(s.labels)
    return out


def panels() -> list[dict]:
    found = []
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        found += [p] + p.get("panels", [])
    return [p for p in found if p["type"] != "row"]


def names_and_labels(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) a PromQL expression uses."""
    labels = set()
    for body in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", body))
    for body in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in body.split(",") if x.strip()}
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\b(?:by|without)\s*\([^)]*\)|\"[^\"]*\"", " ", expr)
    names = {m.group(1) for m in re.finditer(r"([a-zA-Z_:][\w:]*)\s*(\()?", bare)
             if not m.group(2) and m.group(1) not in PROMQL_WORDS}
    names = {n for n in names if not re.fullmatch(r"\d.*", n)}
    return names, labels


def test_dashboard_loads_and_has_panels_for_each_component():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] == "rewarm" and dash["uid"]
    exprs = " ".join(t["expr"] for p in panels() for t in p["targets"])
    for prefix in ("rewarm_ttft_seconds", "rewarm_node_", "rewarm_replica_", "rewarm_predictor_",
                   "process_", "rewarm_prompt_tokens_total", "rewarm_generation_tokens_total",
                   "rewarm_e2e_request_latency_seconds_bucket",
                   "rewarm_inter_token_latency_seconds_bucket"):
        assert prefix in exprs
    ids = [p["id"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert len(ids) == len(set(ids))


@pytest.fixture(scope="module")
def metrics():
    return exposed()


@pytest.mark.parametrize("panel", panels(), ids=lambda p: p["title"])
def test_every_query_names_an_exposed_metric_with_its_labels(panel, metrics):
    assert panel["targets"], panel["title"]
    for target in panel["targets"]:
        names, labels = names_and_labels(target["expr"])
        assert names, target["expr"]
        for name in names:
            assert name in metrics, f"{panel['title']}: {name} is not exposed"
        have = set().union(*(metrics[n] for n in names))
        missing = labels - have - SCRAPE_LABELS
        assert not missing, f"{panel['title']}: labels {missing} not on {names}"


def test_the_checker_catches_a_wrong_name(metrics):
    names, labels = names_and_labels('sum by (model, tier) (rate(rewarm_nope_total{x="1"}[5m]))')
    assert names == {"rewarm_nope_total"} and labels == {"model", "tier", "x"}
    assert "rewarm_nope_total" not in metrics
