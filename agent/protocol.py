"""The wire protocol shared by the front door, replicas and the node agent.

One module per job, in :mod:`agent.wire`: :mod:`~agent.wire.framing` (msgpack maps on a byte
stream, decoded under :class:`Limits`), :mod:`~agent.wire.schema` (each op's fields and the
checks both sides run: :func:`validate_request`), :mod:`~agent.wire.client` (the blocking
:func:`request`) and :mod:`~agent.wire.refusals` (why a request was refused).  This module
gathers the names other code uses, so ``from agent.protocol import Decoder, pack`` reads as
the protocol's own API.
"""

from agent.wire.client import request, unreachable
from agent.wire.framing import (DEFAULT_LIMITS, PROTOCOL_VERSION, READ_SIZE_BYTES, Decoder,
                                Limits, pack, read_messages, scan_headers, validate_envelope)
from agent.wire.schema import (DEFAULT_MAX_TOKENS, LINK_ID_BYTES, MAX_SEED, MAX_TEMPERATURE,
                               OP_SCHEMAS, REPLICA_SCHEMAS, check_stop, error_message, reply_id,
                               validate_request)

__all__ = ["DEFAULT_LIMITS", "DEFAULT_MAX_TOKENS", "LINK_ID_BYTES", "MAX_SEED", "MAX_TEMPERATURE",
           "OP_SCHEMAS", "PROTOCOL_VERSION", "READ_SIZE_BYTES", "REPLICA_SCHEMAS", "Decoder",
           "Limits", "check_stop", "error_message", "pack", "read_messages", "reply_id",
           "request", "scan_headers", "unreachable", "validate_envelope", "validate_request"]
