"""Prometheus conventions on every status port: ``promtool check metrics`` finds nothing
(Prometheus's own linter: names, units, _total on counters, help text), and each metric
name is exported by exactly one component, so a sum over every port counts each once."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_dashboard import registries  # noqa: E402

from agent.health import union  # noqa: E402

SHARED = ("process_",)   # every process's own collector, told apart by job/instance


@pytest.fixture(scope="module")
def ports():
    found = registries()
    found["up"] = union(found["frontdoor"], found["agent"])   # rewarm up's one port
    return found


@pytest.mark.parametrize("component", ["frontdoor", "agent", "replica", "predictor", "up"])
def test_promtool_check_metrics_is_clean(component, ports):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    import urllib.request

    from agent.health import serve_status

    server = serve_status(ports[component], component=component)   # what the port serves
    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as answer:
            text = answer.read()
    finally:
        server.close()
    assert b"rewarm_" in text
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), (
        proc.stdout.decode() + proc.stderr.decode())


def test_each_metric_name_has_one_exporter(ports):
    owner: dict[str, str] = {}
    for component in ("frontdoor", "agent", "replica", "predictor"):
        text = generate_latest(ports[component]).decode()
        for family in text_string_to_metric_families(text):
            if family.name.startswith(SHARED):
                continue
            assert family.name not in owner, (
                f"{family.name} exported by {owner.get(family.name)} and {component}")
            owner[family.name] = component
    assert {owner[n] for n in ("rewarm_replica_batch_size", "rewarm_replica_generated_tokens")} \
        == {"replica"}
    assert owner["rewarm_node_restores"] == "agent"
    assert owner["rewarm_e2e_request_latency_seconds"] == "frontdoor"


def test_one_port_for_two_components_has_each_family_once(ports):
    text = generate_latest(ports["up"]).decode()
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)) and "rewarm_node_restores" in names \
        and "rewarm_requests" in names
