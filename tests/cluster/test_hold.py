"""``rewarm hold``: restore on the device Nomad gave, hold, give up when the replica or its
agent goes, drain on stop (forced when refused as the last one)."""

import io
import json
import threading

import pytest

from agent.wire.control import ControlError
from agent.cluster.hold import Hold, device_for
from agent.errors import ConfigError

GPUS = {"inventory": {"gpus": [{"index": 0, "uuid": "GPU-a"}, {"index": 1, "uuid": "GPU-b"}]}}


def test_device_from_nvidia_visible_devices():
    assert device_for(GPUS, "GPU-b") == "cuda:1"
    assert device_for(GPUS, "GPU-a,GPU-b") == "cuda:0"
    assert device_for({"inventory": {"gpus": []}}, "GPU-x") is None     # a CPU node
    with pytest.raises(ConfigError):
        device_for(GPUS, "GPU-z")
    with pytest.raises(ConfigError):
        device_for(GPUS, None)


class Agent:
    def __init__(self):
        self.ops, self.state, self.refuse_drain, self.down = [], "warm", False, False

    def __call__(self, op, **fields):
        self.ops.append((op, fields))
        if self.down:
            raise ConnectionRefusedError("agent down")
        if op == "status":
            reps = [{"replica": "r1", "state": self.state}] if self.state else []
            return {"replicas": reps, "inventory": {"gpus": []}}
        if op == "restore":
            return {"replica": "r1", "path": "restore", "device": "cpu"}
        if op == "drain":
            if self.refuse_drain and not fields.get("force"):
                raise ControlError("agent: last replica", op="drain", status=409, reason="")
            return {"replica": "r1"}
        raise AssertionError(op)


def test_restore_prints_one_json_line(monkeypatch):
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    out = io.StringIO()
    line = Hold(Agent(), "tiny", out=out).restore()
    assert json.loads(out.getvalue()) == line and line["replica"] == "r1"
    assert line["path"] == "restore" and line["restore_s"] >= 0


@pytest.mark.parametrize("state", [None, "dead", "draining"])
def test_gives_up_when_the_replica_is_gone(state):
    agent = Agent()
    hold = Hold(agent, "tiny", poll_s=0.01, out=io.StringIO())
    hold.restore()
    agent.state = state
    assert hold.watch() == 1


def test_gives_up_when_the_agent_stays_silent():
    agent = Agent()
    hold = Hold(agent, "tiny", poll_s=0.01, unreachable_s=0.05, out=io.StringIO())
    hold.restore()
    agent.down = True
    assert hold.watch() == 1


def test_stop_drains_and_a_refused_drain_is_forced():
    agent = Agent()
    agent.refuse_drain = True
    hold = Hold(agent, "tiny", poll_s=0.01, out=io.StringIO())
    hold.restore()
    threading.Timer(0.05, hold.stop.set).start()
    assert hold.watch() == 0
    drains = [f for op, f in agent.ops if op == "drain"]
    assert drains == [{"replica": "r1", "timeout_s": 30.0},
                      {"replica": "r1", "timeout_s": 30.0, "force": True}]
