"""The models a cluster serves from Consul KV: entries from node agents and operators."""

import json
import threading

import pytest

from agent.cluster.consul_http import consul_client
from agent.cluster.consul_kv import SnapshotKV
from agent.cluster.model_catalog import CatalogWatcher, ModelCatalog, policy_from
from agent.errors import ClusterError, ConfigError


def catalog(standin):
    return ModelCatalog(consul_client(f"127.0.0.1:{standin.port}"))


def test_models_come_from_both_prefixes_with_policies(consul_standin):
    cat = catalog(consul_standin)
    assert cat.watch()[1] == {}
    assert cat.announce("tiny", "v1", "n1") is True
    assert cat.announce("tiny", "v2", "n2") is False            # created once, never replaced
    c = consul_client(f"127.0.0.1:{consul_standin.port}")
    c.kv.put("rewarm/models/big", json.dumps({"deadline_ms": 20000}))
    SnapshotKV(c).publish("snap-only", "s1", "ready", durable=True)
    c.kv.put("rewarm/models/bad/name", "{}")                    # not a model key: ignored
    c.kv.put("rewarm/predictor/leader", "x")
    index, models = cat.watch()
    assert models == {"tiny": {}, "big": {"deadline_ms": 20000.0}, "snap-only": {}}
    assert index >= 1


@pytest.mark.parametrize("raw,want", [(b'{"deadline_ms": 5}', {"deadline_ms": 5.0}),
                                      (b'{"deadline_ms": 0}', {}), (b'{"deadline_ms": -1}', {}),
                                      (b'{"deadline_ms": 3600000}', {"deadline_ms": 3600000.0}),
                                      (b'{"deadline_ms": 3600001}', {}),
                                      (b'{"deadline_ms": true}', {}), (b"not json", {}),
                                      (b"[1]", {}), (None, {}), (b" " * 4097, {})])
def test_policy_values_are_checked_not_trusted(raw, want):
    assert policy_from(raw) == want


def test_announce_checks_the_name(consul_standin):
    with pytest.raises(ConfigError):
        catalog(consul_standin).announce("a/../b")
    assert consul_standin.requests == []


def test_a_down_consul_is_a_typed_error(consul_standin):
    consul_standin.down = True
    with pytest.raises(ClusterError):
        catalog(consul_standin).watch()


def test_watcher_reports_changes_only(consul_standin):
    seen, changed = [], threading.Event()

    def on_change(models):
        seen.append(models)
        changed.set()
    w = CatalogWatcher(catalog(consul_standin), on_change, wait_s=1, min_interval_s=0.05).start()
    try:
        assert changed.wait(10)
        changed.clear()
        catalog(consul_standin).announce("tiny")
        assert changed.wait(10)
        assert seen[0] == {} and seen[-1] == {"tiny": {}}
    finally:
        w.stop()
