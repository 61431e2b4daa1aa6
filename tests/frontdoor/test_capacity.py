import pytest

from agent.errors import ConfigError
from agent.frontdoor.capacity import RestoreGate


def test_restores_are_capped_per_model_and_overall():
    gate = RestoreGate(per_model=2, overall=3, requests_per_restore=4)
    assert gate.wanted("a", 0) == 0
    assert gate.wanted("a", 1) == 1
    assert gate.wanted("a", 100) == 2          # per-model cap
    gate.started("a"), gate.started("a")
    assert gate.wanted("a", 100) == 0
    assert gate.wanted("b", 100) == 1          # overall cap leaves one
    gate.started("b")
    assert gate.wanted("c", 5) == 0 and gate.total == 3
    gate.finished("a")
    assert gate.in_flight == {"a": 1, "b": 1} and gate.wanted("c", 5) == 1


def test_queued_requests_share_a_restore():
    gate = RestoreGate(per_model=8, overall=8, requests_per_restore=4)
    assert gate.wanted("a", 4) == 1 and gate.wanted("a", 5) == 2
    gate.started("a")
    assert gate.wanted("a", 4) == 0


def test_gate_refuses_zero_caps():
    with pytest.raises(ConfigError):
        RestoreGate(per_model=0)
