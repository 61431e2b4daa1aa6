"""The node agent publishes its cached snapshots for placement whenever the cache changes
(Nomad dynamic node metadata through agent/cluster/node_meta.py, here against the stand-in)."""

from __future__ import annotations

from agent.cluster.node_meta import SNAPSHOTS_META_KEY, SnapshotMetadata
from agent.cluster.nomad_http import nomad_client


def test_cached_models_reach_nomad_node_metadata_on_change_only(make_agent, nomad_standin):
    node = nomad_standin.add_node("n1", "127.0.0.1")
    meta = SnapshotMetadata(nomad_client(address=nomad_standin.url), node.id)
    agent = make_agent(node_meta=meta)
    agent.tick()
    assert agent.cached_models() == [] and SNAPSHOTS_META_KEY not in node.merged_meta()
    info = agent.restore("tiny")                         # cold boot, then capture
    agent.captures[agent.models["tiny"].key].result(timeout=120)
    agent.tick()
    assert agent.cached_models() == ["tiny"]
    assert node.merged_meta()[SNAPSHOTS_META_KEY] == "tiny"
    posts = lambda: [r for r in nomad_standin.requests if r[1] == "/v1/client/metadata"]  # noqa: E731
    n = len(posts())
    for _ in range(3):
        agent.tick()
    assert len(posts()) == n                               # unchanged cache: no request
    agent.drain(info["replica"], force=True)
    for row in agent.catalog.snapshots("tiny"):
        agent.snapshot_evict(row.snapshot_id)
    agent.tick()
    assert SNAPSHOTS_META_KEY not in node.merged_meta()    # evicted: unset
