"""Re-exports the Consul and Nomad HTTP stand-ins and their fixtures for other components.

In a component's conftest.py::

    from tests.standins import consul_clock, consul_standin, nomad_standin  # noqa: F401

(run pytest from the repository root: ``.venv/bin/python -m pytest``). The stand-ins are
for tests only; nothing in ``agent/`` imports them.
"""

import pathlib
import sys

_REPO = pathlib.Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tests.cluster.conftest import consul_clock, consul_standin, nomad_standin  # noqa: E402,F401
from tests.cluster.consul_standin import ConsulStandIn  # noqa: E402,F401
from tests.cluster.nomad_standin import NomadStandIn  # noqa: E402,F401
