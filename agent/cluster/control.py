"""The node agent's control-API client, also reachable under this package's name: the same
objects as :mod:`agent.wire.control`, where it lives (the wire's room, so the front door, the
predictor and the node agent's commands reach it without a cluster module).  Code in
``agent/`` imports it from there; tests/cluster/test_boundary.py keeps it so.
"""

from agent.wire.control import (AGENT_HINT, DEFAULT_AGENT, MIN_TOKEN_BYTES, TOKEN_ENV,
                                ControlError, control_call, control_token, default_agent)

__all__ = ["AGENT_HINT", "DEFAULT_AGENT", "MIN_TOKEN_BYTES", "TOKEN_ENV", "ControlError",
           "control_call", "control_token", "default_agent"]
