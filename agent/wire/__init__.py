"""The wire between rewarm's processes: framing, message schema, blocking clients, refusals.

One module per job (``agent.protocol`` re-exports what other code imports from here):

- :mod:`agent.wire.framing`: msgpack maps on a byte stream, decoded under explicit limits;
- :mod:`agent.wire.schema`: each op's fields and the checks both sides run on them;
- :mod:`agent.wire.client`: a blocking request/answer client (CLI, node agent, tests);
- :mod:`agent.wire.refusals`: the machine-readable reason a request was refused;
- :mod:`agent.wire.control`: the node agent's control API, client side (its token,
  the default address, one blocking call).
"""
