"""Cached snapshots as Nomad dynamic node metadata: posted on a change only, failures backed
off, an ACL denial logged once."""

import pytest

from agent.clock import ManualClock
from agent.cluster.node_meta import SNAPSHOTS_META_KEY, SnapshotMetadata, publish_cached_snapshots
from agent.cluster.nomad_http import nomad_client
from agent.errors import AclDenied, ClusterError, ConfigError


@pytest.fixture
def node(nomad_standin):
    return nomad_standin.add_node("n1", "127.0.0.1", meta={"gpu": "none"})


def posts(standin):
    return [r for r in standin.requests if r[1] == "/v1/client/metadata" and r[0] == "POST"]


def test_publish_sets_sorts_and_unsets(nomad_standin, node):
    client = nomad_client(address=nomad_standin.url)
    out = publish_cached_snapshots(client, ["b", "a", "a"], node_id=node.id)
    assert out["Meta"][SNAPSHOTS_META_KEY] == "a,b" and out["Static"] == {"gpu": "none"}
    assert node.merged_meta()[SNAPSHOTS_META_KEY] == "a,b"
    out = publish_cached_snapshots(client, [], node_id=node.id)
    assert SNAPSHOTS_META_KEY not in out["Meta"]            # null unsets the key
    with pytest.raises(ClusterError) as err:
        publish_cached_snapshots(client, ["a"], node_id="no-such-node")
    assert err.value.status == 404
    with pytest.raises(ConfigError):
        publish_cached_snapshots(client, ["a,b"], node_id=node.id)   # a comma would split it
    with pytest.raises(ConfigError):
        publish_cached_snapshots(client, ["a"], node_id="../acl")


def test_posts_only_when_the_cache_changes(nomad_standin, node):
    clock = ManualClock()
    meta = SnapshotMetadata(nomad_client(address=nomad_standin.url), node.id, clock=clock)
    assert meta.update(["tiny"]) is True
    for _ in range(5):
        assert meta.update(["tiny"]) is False                  # every tick: no request
    assert meta.update(["tiny", "other"]) is True
    assert len(posts(nomad_standin)) == 2
    assert node.merged_meta()[SNAPSHOTS_META_KEY] == "other,tiny"


def test_failures_back_off_and_catch_up(nomad_standin, node):
    clock = ManualClock()
    meta = SnapshotMetadata(nomad_client(address=nomad_standin.url), node.id, clock=clock)
    nomad_standin.fail_next(500, "/v1/client/metadata", times=2)
    assert meta.update(["tiny"]) is False and meta.failures == 1
    assert meta.update(["tiny"]) is False and len(posts(nomad_standin)) == 1   # backing off
    clock.advance(1.0)
    assert meta.update(["tiny"]) is False and meta.failures == 2
    clock.advance(2.0)
    assert meta.update(["tiny"]) is True and meta.last_error is None


def test_acl_denial_waits_long_and_logs_once(nomad_standin, node, caplog):
    nomad_standin.acl_token = "right"
    clock = ManualClock()
    meta = SnapshotMetadata(nomad_client(address=nomad_standin.url, token="wrong"), node.id,
                            clock=clock, acl_backoff_s=300.0)
    for _ in range(3):
        assert meta.update(["tiny"]) is False
        clock.advance(299.0)
        assert meta.update(["tiny"]) is False
        clock.advance(1.0)
    assert isinstance(meta.last_error, AclDenied) and "node:write" in str(meta.last_error)
    assert len(posts(nomad_standin)) == 3
    assert sum(r.levelname == "ERROR" for r in caplog.records) == 1
