"""The composition root (agent/cluster/__init__.py): one flag vocabulary for every command,
one function that builds the registry and the scaler it names."""

from __future__ import annotations

import argparse
import logging

import pytest

from agent.cli import build_parser
from agent.clock import ManualClock
from agent.cluster import (_BUILDERS, IMPLEMENTATIONS, ClusterChoice, add_flags, choice_from_args,
                           choose, cluster_model_catalog, leader_lock, snapshot_summary)
from agent.cluster.base import ServiceInstance


def _choice(argv: list[str], **flags) -> ClusterChoice:
    p = argparse.ArgumentParser()
    add_flags(p, **flags)
    return choice_from_args(p.parse_args(argv))


def test_defaults_are_the_embedded_ones():
    assert _choice([]) == ClusterChoice(registry="local", scaler="local", consul=None,
                                        node_agents=(), max_replicas=8)


def test_a_consul_address_alone_chooses_consul_and_an_explicit_registry_wins():
    assert _choice(["--consul", "10.0.0.1:8500"]).registry == "consul"
    assert _choice(["--consul", "10.0.0.1:8500"]).consul == "10.0.0.1:8500"
    assert _choice(["--registry", "consul"]) == ClusterChoice(registry="consul")
    assert _choice(["--registry", "local", "--consul", "10.0.0.1:8500"]).registry == "local"


def test_the_former_scaler_name_is_read_as_local_and_said(caplog):
    with caplog.at_level(logging.WARNING, logger="agent.cluster"):
        assert _choice(["--scaler", "agents"]).scaler == "local"
    assert "former name of --scaler local" in caplog.text
    assert _choice(["--scaler", "nomad", "--max-replicas", "3"], max_replicas=True) == \
        ClusterChoice(scaler="nomad", max_replicas=3)


def test_node_agents_repeat_in_order():
    got = _choice(["--node-agent", "a:1", "--node-agent", "b:2"])
    assert got.node_agents == ("a:1", "b:2")


def test_a_bad_flag_value_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        _choice(["--scaler", "k8s"])
    with pytest.raises(SystemExit):
        _choice(["--registry", "etcd"])


def test_every_command_speaks_the_same_vocabulary():
    parser = build_parser()
    argv = {"frontdoor": ["frontdoor"], "predictor": ["predictor", "--model", "m"],
            "agent run": ["agent", "run", "--state-dir", "s", "--model-dir", "m"]}
    for name, head in argv.items():
        args = parser.parse_args([*head, "--registry", "consul", "--consul", "h:8500"])
        assert choice_from_args(args).registry == "consul", name
        assert choice_from_args(args).consul == "h:8500", name
    for name in ("frontdoor", "predictor"):
        args = parser.parse_args([*argv[name], "--scaler", "nomad", "--node-agent", "a:1"])
        assert (choice_from_args(args).scaler, choice_from_args(args).node_agents) == \
            ("nomad", ("a:1",)), name


def test_every_listed_implementation_has_a_builder():
    assert set(_BUILDERS) == {(k, n) for k, names in IMPLEMENTATIONS.items() for n in names}


def test_a_choice_names_only_listed_implementations():
    with pytest.raises(KeyError) as err:
        ClusterChoice(registry="etcd")
    assert "consul" in str(err.value) and "local" in str(err.value)
    with pytest.raises(KeyError) as err:
        choose("queue", ClusterChoice())   # type: ignore[call-overload]  # an unknown kind
    assert "registry" in str(err.value) and "scaler" in str(err.value)


def test_the_local_registry_runs_on_the_given_clock():
    clock = ManualClock()
    registry = choose("registry", ClusterChoice(), clock=clock)
    registry.register(ServiceInstance("rewarm-replica", "r1", "127.0.0.1", 1), ttl_s=5.0)
    assert [i.id for i in registry.healthy("rewarm-replica")] == ["r1"]
    clock.advance(5.5)
    assert registry.healthy("rewarm-replica") == []


def test_the_consul_registry_talks_to_the_chosen_agent():
    registry = choose("registry", ClusterChoice(registry="consul", consul="10.9.8.7:8600"))
    assert type(registry).__name__ == "ConsulRegistry"
    assert registry._c.http.base_uri == "http://10.9.8.7:8600"


def test_the_local_scaler_asks_the_node_agents_given(monkeypatch):
    monkeypatch.delenv("REWARM_AGENT", raising=False)
    calls = []
    scaler = choose("scaler", ClusterChoice(), clock=ManualClock(),
                    agents={"n1": lambda op, **f: calls.append((op, f)) or {"replicas": []}})
    assert scaler.target("m") == 0          # what the node agent reports running
    assert calls == [("status", {})]
    default = choose("scaler", ClusterChoice(), clock=ManualClock())
    assert sorted(default._agents) == ["127.0.0.1:7733"]   # where rewarm agent run listens
    named = choose("scaler", ClusterChoice(node_agents=("a:1", "b:2")))
    assert sorted(named._agents) == ["a:1", "b:2"]


def test_the_consul_side_services_exist_only_with_consul():
    local = ClusterChoice()
    assert snapshot_summary(local) is None and cluster_model_catalog(local) is None
    assert leader_lock(local, clock=ManualClock(), name="p") is None
    consul = ClusterChoice(registry="consul", consul="10.9.8.7:8600")
    assert type(snapshot_summary(consul)).__name__ == "SnapshotKV"
    assert type(cluster_model_catalog(consul)).__name__ == "ModelCatalog"


def test_each_builder_still_builds_after_the_modules_behind_it_are_imported():
    # importing agent.cluster.NAME binds NAME in the package to that module: a builder of
    # the same name would be a module on its second call
    import ast
    import importlib
    from pathlib import Path

    import agent.cluster as cluster

    package = Path(cluster.__file__).parent
    functions = {node.name for node in ast.parse((package / "__init__.py").read_text()).body
                 if isinstance(node, ast.FunctionDef)}
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}
    assert "cluster_model_catalog" in functions and not functions & modules
    for name in sorted(modules):
        importlib.import_module(f"agent.cluster.{name}")
    consul = ClusterChoice(registry="consul", consul="10.9.8.7:8600")
    for _ in range(2):
        assert type(cluster.cluster_model_catalog(consul)).__name__ == "ModelCatalog"
        assert callable(cluster.snapshot_summary) and callable(cluster.leader_lock)
