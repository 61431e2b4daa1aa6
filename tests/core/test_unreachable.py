"""When nothing answers at an address, the error names the service, the address and what to
do, and is still a ConnectionError (callers that catch OSError keep working)."""

from __future__ import annotations

from agent import exitcodes
import socket

import pytest

from agent.cli import main
from agent.errors import ConfigError, Unreachable
from agent.protocol import request


@pytest.fixture
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]      # closed again: nothing listens there


def test_request_names_the_address_and_stays_a_connection_error(free_port):
    address = f"127.0.0.1:{free_port}"
    with pytest.raises(Unreachable) as info:
        request(address, {"op": "status", "id": 1}, service="node agent", hint="start it")
    err = info.value
    assert isinstance(err, ConnectionError) and isinstance(err, OSError)
    assert (err.service, err.address, err.reason) == ("node agent", address, "Connection refused")
    assert str(err) == f"cannot reach node agent at {address}: Connection refused (start it)"


def test_missing_unix_socket_is_unreachable_too(tmp_path):
    address = f"unix:{tmp_path / 'none.sock'}"
    with pytest.raises(Unreachable, match=f"cannot reach server at {address}: No such file"):
        request(address, {"op": "status", "id": 1})


@pytest.mark.parametrize("address", ["127.0.0.1", "h:port", "h:0", "h:65536"])
def test_a_malformed_address_is_a_config_error(address):
    with pytest.raises(ConfigError) as info:
        request(address, {"op": "status", "id": 1})
    assert (info.value.name, info.value.value) == ("address", address)


def test_agent_status_without_an_agent_says_where_it_looked(free_port, capsys):
    address = f"127.0.0.1:{free_port}"
    assert main(["agent", "status", "--agent", address]) == exitcodes.EX_UNAVAILABLE
    err = capsys.readouterr().err
    assert err == (f"error: cannot reach node agent at {address}: Connection refused (is "
                   "`rewarm agent run` or `rewarm up` running there? pass --agent or set "
                   "REWARM_AGENT)\n")


def test_generate_without_a_front_door_says_where_it_looked(free_port, capsys):
    address = f"127.0.0.1:{free_port}"
    assert main(["generate", "--model", "m", "--address", address, "hi"]) == exitcodes.EX_UNAVAILABLE
    err = capsys.readouterr().err
    assert err == (f"error: cannot reach front door at {address}: Connection refused (is "
                   "`rewarm up` or `rewarm frontdoor` running there? pass --address or "
                   "--consul)\n")


def test_async_client_connect_names_the_address(free_port):
    import asyncio

    from agent.client import AsyncClient

    with pytest.raises(Unreachable, match=f"front door at 127.0.0.1:{free_port}"):
        asyncio.run(AsyncClient.connect("127.0.0.1", free_port))
