"""The Nomad stand-in's scheduler honours device counts, constraints and affinities (its
fidelity is what the cluster scenario's placement claims rest on)."""

import pytest

from tests.cluster.nomad_placement import Node, affinity_score, choose, feasible, matches


def node(name, gpus=1, cls="gpu", meta=None):
    return Node(id=f"id-{name}", name=name, address="127.0.0.1", node_class=cls,
                meta=dict(meta or {}), attributes={"unique.network.ip-address": "127.0.0.1"},
                devices={"nvidia/gpu": [f"G-{name}-{i}" for i in range(gpus)]})


@pytest.mark.parametrize("op,left,right,want", [
    ("=", "gpu", "gpu", True), ("=", "cpu", "gpu", False), ("!=", None, "gpu", True),
    ("set_contains", "a,b,c", "a,c", True), ("set_contains", "a,b", "a,d", False),
    ("set_contains", None, "a", False), ("set_contains_any", "a,b", "d,b", True),
    ("regexp", "gpu-large", "^gpu", True), ("is_set", None, "", False),
    ("is_not_set", None, "", True)])
def test_operators(op, left, right, want):
    assert matches(op, left, right) is want


def test_device_count_makes_a_node_infeasible():
    n = node("a", gpus=1)
    need = {"nvidia/gpu": 1}
    assert feasible(n, [], group_nodes=set(), device_need=need, devices_used={})
    assert not feasible(n, [], group_nodes=set(), device_need=need,
                        devices_used={n.id: {"G-a-0"}})
    assert not feasible(n, [], group_nodes=set(), device_need={"nvidia/gpu": 2}, devices_used={})


def test_constraints_and_distinct_hosts():
    n = node("a", cls="cpu")
    c = [{"LTarget": "${node.class}", "RTarget": "gpu", "Operand": "="}]
    assert not feasible(n, c, group_nodes=set(), device_need={}, devices_used={})
    d = [{"LTarget": "", "RTarget": "true", "Operand": "distinct_hosts"}]
    assert not feasible(n, d, group_nodes={n.id}, device_need={}, devices_used={})
    assert feasible(n, d, group_nodes=set(), device_need={}, devices_used={})


def test_affinity_prefers_the_node_that_caches_the_snapshot():
    aff = [{"LTarget": "${meta.rewarm_snapshots}", "RTarget": "tiny", "Operand": "set_contains",
            "Weight": 100}]
    nodes = [node("a"), node("b"), node("c")]
    nodes[2].dynamic_meta["rewarm_snapshots"] = "other,tiny"
    assert affinity_score(nodes[2], aff) == 1.0 and affinity_score(nodes[0], aff) == 0.0
    pick = choose(nodes, constraints=[], affinities=aff, group_nodes=set(),
                  device_need={"nvidia/gpu": 1}, devices_used={}, job_allocs={},
                  penalty_nodes=set())
    assert pick.name == "c"
    # its GPU taken: the affinity is a preference, the device count a requirement
    pick = choose(nodes, constraints=[], affinities=aff, group_nodes=set(),
                  device_need={"nvidia/gpu": 1}, devices_used={nodes[2].id: {"G-c-0"}},
                  job_allocs={}, penalty_nodes=set())
    assert pick.name == "a"
    nodes[2].dynamic_meta["rewarm_snapshots"] = None        # unset: no longer preferred
    assert affinity_score(nodes[2], aff) == 0.0


def test_a_rescheduled_allocation_leaves_its_failed_node_when_it_can():
    aff = [{"LTarget": "${meta.rewarm_snapshots}", "RTarget": "tiny", "Operand": "set_contains",
            "Weight": 100}]
    nodes = [node("a", meta={"rewarm_snapshots": "tiny"}), node("b")]
    kw = dict(constraints=[], affinities=aff, group_nodes=set(), device_need={"nvidia/gpu": 1},
              job_allocs={})
    assert choose(nodes, devices_used={}, penalty_nodes={nodes[0].id}, **kw).name == "b"
    # the only feasible node is the one it failed on: it goes back there
    assert choose(nodes, devices_used={nodes[1].id: {"G-b-0"}}, penalty_nodes={nodes[0].id},
                  **kw).name == "a"
    assert choose(nodes, devices_used={nodes[0].id: {"G-a-0"}, nodes[1].id: {"G-b-0"}},
                  penalty_nodes=set(), **kw) is None          # pending: no capacity
