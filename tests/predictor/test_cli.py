"""``rewarm predictor``'s command line: where it looks for the node agent."""

from __future__ import annotations

from agent.cli import build_parser
from agent.clock import ManualClock
from agent.cluster.control import DEFAULT_AGENT
from agent.predictor.cli import build


def _agents(argv, monkeypatch, env=None):
    monkeypatch.delenv("REWARM_AGENT", raising=False)
    if env is not None:
        monkeypatch.setenv("REWARM_AGENT", env)
    args = build_parser().parse_args(["predictor", "--model", "m", *argv])
    service, _ = build(args, ManualClock())
    return sorted(service._scaler._agents)


def test_default_node_agent_is_where_rewarm_agent_run_listens(monkeypatch):
    assert DEFAULT_AGENT == "127.0.0.1:7733"
    assert _agents([], monkeypatch) == ["127.0.0.1:7733"]
    run = build_parser().parse_args(["agent", "run", "--state-dir", "s", "--model-dir", "m"])
    assert run.listen == DEFAULT_AGENT


def test_rewarm_agent_env_and_flags_choose_the_node_agent(monkeypatch):
    assert _agents([], monkeypatch, env="10.0.0.5:9000") == ["10.0.0.5:9000"]
    assert _agents(["--node-agent", "a:1", "--node-agent", "b:2"], monkeypatch,
                   env="10.0.0.5:9000") == ["a:1", "b:2"]
