"""The control API and the ``rewarm agent`` client commands against a live agent."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from agent import exitcodes
from agent.cli import main
from agent.errors import ModelNotFound, ProtocolError, ReplicaNotFound
from agent.wire.control import ControlError, control_call
from agent.node.control import ControlServer
from agent.protocol import pack


@pytest.fixture
def served(make_agent, tmp_path):
    agent = make_agent()
    loop = asyncio.new_event_loop()
    server = ControlServer(agent, f"unix:{tmp_path / 'agent.sock'}")
    address = loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield agent, address
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_restore_status_and_snapshots_over_the_wire(served, capsys):
    agent, address = served
    info = control_call(address, "restore", model="tiny")
    assert info["state"] == "warm" and info["path"] == "cold_boot"
    row = agent.captures[agent.models["tiny"].key].result(timeout=120)
    st = control_call(address, "status")
    assert [r["replica"] for r in st["replicas"]] == [info["replica"]]
    assert main(["agent", "snapshot", "ls", "--agent", address]) == 0
    listed = json.loads(capsys.readouterr().out)["snapshots"]
    assert [(s["snapshot"], s["status"]) for s in listed] == [(row.snapshot_id, "ready")]
    assert main(["agent", "snapshot", "verify", row.snapshot_id, "--agent", address]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["agent", "status", "--agent", address]) == 0
    assert json.loads(capsys.readouterr().out)["node"] == "n1"
    done = control_call(address, "drain", replica=info["replica"])
    assert done["state"] == "dead"


def test_errors_are_answers(served, capsys):
    _, address = served
    with pytest.raises(ModelNotFound):
        control_call(address, "restore", model="nope")
    with pytest.raises(ProtocolError):
        control_call(address, "restore")
    with pytest.raises(ProtocolError):
        control_call(address, "restore", model=7)
    with pytest.raises(ProtocolError):
        control_call(address, "reboot")
    with pytest.raises(ReplicaNotFound) as info:
        control_call(address, "suspend", replica="nope")
    assert info.value.status == 404
    # the agent answers 500 for it (a server failure, not a refusal): exit status 1
    assert main(["agent", "snapshot", "evict", "missing", "--agent", address]) == exitcodes.FAILURE
    assert "no snapshot 'missing'" in capsys.readouterr().err


def test_framing_error_closes_after_answer(served):
    import socket

    from agent.protocol import Decoder

    _, address = served
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(address[5:])
        sock.sendall(pack({"v": 99, "op": "status", "id": 1}))
        answer = Decoder().feed(sock.recv(65536))[0]
        assert (answer["type"], answer["code"]) == ("error", 400)
        assert sock.recv(65536) == b""


def test_unix_socket_removed_on_close(make_agent, tmp_path):
    agent = make_agent()
    path = tmp_path / "c.sock"
    server = ControlServer(agent, f"unix:{path}")

    async def cycle():
        await server.start()
        assert path.exists()
        await server.close()

    asyncio.run(cycle())
    assert not path.exists()


@pytest.mark.parametrize("op", ["drain", "suspend", "resume"])
def test_an_unknown_replica_is_404_naming_it(served, op, capsys):
    _, address = served
    with pytest.raises(ReplicaNotFound) as info:
        control_call(address, op, replica="nope")
    err = info.value
    assert (err.status, err.op) == (404, op)
    assert err.reason == "no replica 'nope' on node n1; replicas: []"
    assert isinstance(err, LookupError)
    assert main(["agent", op, "nope", "--agent", address]) == exitcodes.EX_TEMPFAIL
    assert capsys.readouterr().err == "error: agent: no replica 'nope' on node n1; replicas: []\n"


def test_suspend_and_resume_on_a_cpu_node_are_409_with_the_right_verb(served, capsys):
    agent, address = served
    info = control_call(address, "restore", model="tiny")
    rid = info["replica"]
    try:
        for op, verb in (("suspend", "suspended"), ("resume", "resumed")):
            with pytest.raises(ControlError) as refused:
                control_call(address, op, replica=rid)
            assert refused.value.status == 409
            assert refused.value.reason == (f"replica {rid} cannot be {verb}: this node has no "
                                            "CUDA checkpoint support (GPU nodes only)")
            assert main(["agent", op, rid, "--agent", address]) == exitcodes.EX_TEMPFAIL
            assert capsys.readouterr().err == (f"error: agent: {op} failed (409): "
                                               f"{refused.value.reason}\n")
        assert control_call(address, "status")["replicas"][0]["state"] == "warm"
    finally:
        agent.captures[agent.models["tiny"].key].result(timeout=120)
        control_call(address, "drain", replica=rid)


def test_a_token_is_required_of_every_op_when_set(make_agent, tmp_path, monkeypatch, capsys):
    from agent.errors import Unauthorized

    agent = make_agent()
    loop = asyncio.new_event_loop()
    server = ControlServer(agent, f"unix:{tmp_path / 'tok.sock'}", token="s3cret-s3cret-s3cret")
    address = loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        monkeypatch.delenv("REWARM_CONTROL_TOKEN", raising=False)
        with pytest.raises(Unauthorized, match="token missing"):
            control_call(address, "status")
        monkeypatch.setenv("REWARM_CONTROL_TOKEN", "wrong-wrong-wrong-wrong")
        with pytest.raises(Unauthorized, match="token wrong"):
            control_call(address, "status")
        assert main(["agent", "status", "--agent", address]) == exitcodes.EX_NOPERM
        assert "token wrong" in capsys.readouterr().err
        monkeypatch.setenv("REWARM_CONTROL_TOKEN", "s3cret-s3cret-s3cret")
        assert control_call(address, "status")["node"] == "n1"
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_the_control_api_refuses_an_open_bind_without_a_token():
    from agent.errors import ConfigError
    from agent.node.control import check_control_bind

    with pytest.raises(ConfigError) as err:
        check_control_bind("0.0.0.0:7733", None)
    assert err.value.value == "0.0.0.0:7733" and "REWARM_CONTROL_TOKEN" in str(err.value)
    check_control_bind("0.0.0.0:7733", "t")                     # a token: fine
    check_control_bind("0.0.0.0:7733", None, allow_open=True)   # said so: fine
    check_control_bind("127.0.0.1:7733", None)                  # loopback: fine
    check_control_bind("[::1]:7733", None)
    check_control_bind("unix:/run/rewarm/agent.sock", None)


@pytest.mark.parametrize("value, says", [("short", "at least 16"), ("   " * 8, "at least 16"),
                                         ("\udcff" * 20, "UTF-8")])
def test_a_weak_or_broken_control_token_is_refused(monkeypatch, value, says):
    from agent.errors import ConfigError
    from agent.wire.control import control_token

    monkeypatch.setenv("REWARM_CONTROL_TOKEN", value)
    with pytest.raises(ConfigError, match=says):
        control_token()


def test_answers_never_echo_an_id_a_client_could_not_mean(served):
    import socket

    from agent.protocol import Decoder

    _, address = served
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(address[len("unix:"):])
    good = {"op": "status", "id": 5}
    sock.sendall(pack({"op": "status", "id": [1, 2]}) + pack({"op": "status", "id": "i" * 200})
                 + pack(good) + b"\xc1")
    answers, decoder = [], Decoder()
    while data := sock.recv(65536):
        answers += decoder.feed(data)
    sock.close()
    assert [a["id"] for a in answers] == [None, None, 5, None]
    assert answers[2]["type"] == "result" and answers[3]["code"] == 400   # answered, then 400


def test_fields_named_like_the_clients_own_arguments_reach_the_agent(monkeypatch):
    # drain's own timeout_s collides with control_call's timeout_s: sent through ``fields``
    import agent.wire.control as control

    sent = {}

    def fake_request(address, message, **kw):
        sent.update(message)
        return [{"type": "result", "result": {"ok": True}}]
    monkeypatch.setattr(control, "request", fake_request)
    assert control.control_call("127.0.0.1:1", "drain", timeout_s=5.0,
                                fields={"replica": "r1", "timeout_s": 30.0}) == {"ok": True}
    assert sent["op"] == "drain" and sent["replica"] == "r1" and sent["timeout_s"] == 30.0


def test_stopping_with_an_op_in_flight_logs_no_traceback(tmp_path):
    """Stopping the loop cancels a connection whose op is still running (rewarm up stopped
    during a restore); the handler ends quietly instead of the loop's exception handler
    printing a CancelledError traceback (Python 3.11's streams callback did)."""
    entered, release = threading.Event(), threading.Event()

    class SlowAgent:
        def status(self):
            entered.set()
            release.wait(10)
            return {}

    reported: list[dict] = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx))
        server = ControlServer(SlowAgent(), f"unix:{tmp_path / 'agent.sock'}")
        address = await server.start()
        reader, writer = await asyncio.open_unix_connection(address[5:])
        writer.write(pack({"v": 1, "op": "status", "id": 1}))
        await writer.drain()
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert pending, "the connection's handler task is running"
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        release.set()
        assert await reader.read() == b""    # the client sees the connection close
        writer.close()
        await server.close()
        await asyncio.sleep(0)               # the streams done-callback runs

    asyncio.run(scenario())
    assert reported == []
