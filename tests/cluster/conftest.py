"""Consul and Nomad HTTP stand-ins as fixtures (front door and node agent tests reuse them
through ``tests/standins.py``)."""

import pathlib
import sys

import pytest

_REPO = pathlib.Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from agent.clock import ManualClock  # noqa: E402
from tests.cluster.consul_standin import ConsulStandIn  # noqa: E402
from tests.cluster.nomad_standin import NomadStandIn  # noqa: E402


@pytest.fixture
def consul_clock():
    """The clock the Consul stand-in's TTLs run on (advance it to expire sessions)."""
    return ManualClock(1000.0)


@pytest.fixture
def consul_standin(consul_clock):
    server = ConsulStandIn(clock=consul_clock).start()
    yield server
    server.stop()


@pytest.fixture
def nomad_standin():
    server = NomadStandIn().start()
    yield server
    server.stop()
