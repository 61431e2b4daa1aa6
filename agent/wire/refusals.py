"""Why a request was refused, as data: the ``refusal`` field of an ``error`` answer.

The component that decides a refusal names it with one of :data:`REFUSALS`; the code travels
with the failure (``Sink.error(..., refusal=...)`` inside the front door, ``"refusal"`` in the
msgpack ``error`` map, the HTTP entrance's header and error body) so that no reader parses the
human-readable ``reason``.  The ``reason`` text still says the value and the limit.

==========================  =====  ==========================================================
code                        HTTP   decided where, and when
==========================  =====  ==========================================================
``deadline_unreachable``    429    admission: no replica, warm or in sight, can start it
                                   before its deadline (at arrival, or at a re-check)
``queue_full``              429    the model's admission queue is at ``max_queue_depth``
``max_wait``                429    it waited ``max_wait_s`` in the queue
``deadline``                504    its deadline passed while queued (a prediction was wrong)
``no_capacity``             503    no warm replica and no restore can be made
``draining``                503    the front door or the replica is shutting down
``replica_failed``          503    the link to its replica broke after tokens were streamed,
                                   its replica went silent before its first token and no
                                   other could start it in time, or its replica's engine
                                   step failed
``too_large``               413    prompt + max_tokens exceed the largest replica's KV cache
``context_length``          400    prompt + max_tokens exceed the model's context length
``unknown_model``           404    no such model here
``max_connections``         503    the entrance is at its connection cap
``fd_reserve``              503    the process is out of spare file descriptors
``other``                   any    none of these
==========================  =====  ==========================================================
"""

from __future__ import annotations

from typing import Any

DEADLINE_UNREACHABLE = "deadline_unreachable"
QUEUE_FULL = "queue_full"
MAX_WAIT = "max_wait"
DEADLINE = "deadline"
NO_CAPACITY = "no_capacity"
DRAINING = "draining"
REPLICA_FAILED = "replica_failed"
TOO_LARGE = "too_large"
CONTEXT_LENGTH = "context_length"
UNKNOWN_MODEL = "unknown_model"
MAX_CONNECTIONS = "max_connections"
FD_RESERVE = "fd_reserve"
OTHER = "other"

REFUSALS = (DEADLINE_UNREACHABLE, QUEUE_FULL, MAX_WAIT, DEADLINE, NO_CAPACITY, DRAINING,
            REPLICA_FAILED, TOO_LARGE, CONTEXT_LENGTH, UNKNOWN_MODEL, MAX_CONNECTIONS,
            FD_RESERVE, OTHER)
"""Every refusal code, in the table's order (a bounded set: safe as a metrics label)."""

_KNOWN = frozenset(REFUSALS)


def known_refusal(value: Any) -> str | None:
    """``value`` if it is one of :data:`REFUSALS` (a peer's answer is untrusted), else None."""
    return value if type(value) is str and value in _KNOWN else None
