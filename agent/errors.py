"""The typed error hierarchy of rewarm.

One base, :class:`RewarmError`, and a handful of subclasses.  Each also inherits the builtin
that matches it (``SnapshotCorrupt`` is a ``ValueError``), so callers that only know the
builtins still catch it.  Every error carries the object it is about, the value found and the
limit or expected value as attributes, and names all three in its message.

Errors that reach a client carry ``code``: the protocol's status code (400, 401, 404, 409,
413, 429, 503, 504; see docs/protocol.md).  409 is a well-formed request that this node's
configuration or state does not allow (:class:`ConfigError`: suspend on a node without CUDA
checkpoint support, a device the node lacks); anything else (500) is a bug.
"""

from __future__ import annotations

from typing import Any


class RewarmError(Exception):
    """Base of every error rewarm raises on purpose.

    Attributes given as keywords are kept on the instance (``err.path``, ``err.limit``...)
    so that handlers and tests can read them without parsing the message.
    """

    code: int = 500

    def __init__(self, message: str, **attrs: Any) -> None:
        super().__init__(message)
        self.message = message
        for key, value in attrs.items():
            setattr(self, key, value)


# --- snapshots -------------------------------------------------------------------------

class SnapshotError(RewarmError):
    """Something is wrong with a snapshot; the restore fails closed."""


class SnapshotCorrupt(SnapshotError, ValueError):
    """Bytes on disk are not what the manifest promises (checksum, length, framing).

    Attributes: ``path``, ``chunk`` (index or None), ``tensors`` (names covered),
    ``expected``, ``actual``.
    """


class SnapshotIncompatible(SnapshotError, RuntimeError):
    """The snapshot was taken on a machine this one does not match.

    Attributes: ``path``, ``mismatches``: ``{pin: (snapshot_value, machine_value)}``.
    """


class SnapshotNotFound(SnapshotError, FileNotFoundError):
    """No ready snapshot where one was asked for. Attributes: ``path`` or ``model``."""


class SnapshotTampered(SnapshotCorrupt):
    """The manifest's signature or digest does not verify. Attributes: ``path``."""


class DiskFull(SnapshotError, OSError):
    """No space left while writing a snapshot; nothing partial is left behind.

    Attributes: ``path``, ``needed_bytes``, ``free_bytes`` (None when the write itself failed).
    """


class InvalidCheckpoint(RewarmError, ValueError):
    """A source checkpoint (config.json, safetensors, GGUF) is malformed.

    Attributes: ``path``, ``field`` (tensor or key), ``value``, ``limit``.
    """


# --- the replica ------------------------------------------------------------------------

class GoldenMismatch(RewarmError, RuntimeError):
    """A restored replica did not reproduce the recorded tokens; it must not serve.

    Attributes: ``prompt_index``, ``position`` (first differing token), ``expected``, ``actual``.
    """


class TargetMismatch(RewarmError, RuntimeError):
    """An AOT package was built for another CPU or GPU target. Attributes: ``built``, ``here``."""


class WeightSchemeMismatch(RewarmError, RuntimeError):
    """An AOT package was built for weights stored another way (``dense`` against ``int4``,
    agent/replica/quant.py) than the snapshot or checkpoint it is asked to bind.  Refused
    before any weight is bound.  Attributes: ``package``, ``built`` (the package's scheme),
    ``here`` (the weights' scheme).
    """


class PackageInputError(RewarmError, ValueError):
    """A call of an AOT package with inputs it was not compiled for: a rank, a dynamic size
    outside its recorded range, a fixed size, a dtype, a device or an index outside the cache.
    Refused before the compiled code runs, so nothing was read or written.

    Attributes: ``package``, ``argument`` (e.g. ``k_caches[3]``), ``field`` (``rank``,
    ``batch``, ``dtype``...), ``value``, ``limit``.
    """


class PackageCheckFailed(RewarmError, RuntimeError):
    """A freshly built AOT package refused a shape inside its recorded ranges, or disagreed
    with eager there; the build leaves no package.  Attributes: ``package``, ``sizes``
    (``{batch, seq, cache_batch}``), ``field``, ``value``, ``limit``.
    """


class CapacityExceeded(RewarmError, MemoryError):
    """A request cannot fit in the KV cache. Attributes: ``need_tokens``, ``limit_tokens``."""

    code = 413


# --- the wire ---------------------------------------------------------------------------

class ProtocolError(RewarmError, ValueError):
    """A malformed or out-of-limit message (400).  A well-framed request that fails its
    checks is answered alone; a framing error ends the connection once the requests in flight
    on it are answered (docs/protocol.md).

    Attributes: ``field``, ``value``, ``limit``; ``decoded``: messages complete before a
    framing error (from :meth:`agent.protocol.Decoder.feed`).
    """

    code = 400


class MessageTooLarge(ProtocolError):
    """A message or one of its parts is over a limit (413)."""

    code = 413


class Unauthorized(RewarmError, PermissionError):
    """Missing or wrong tenant token (401)."""

    code = 401


class ModelNotFound(RewarmError, LookupError):
    """No such model is configured (404). Attributes: ``model``."""

    code = 404


class ReplicaNotFound(RewarmError, LookupError):
    """No replica with this id on the node (404).

    Attributes: ``replica`` (the id asked for), ``node``, ``limit`` (the ids it has).
    """

    code = 404


class Overloaded(RewarmError):
    """Admission refused: the queue is full or the wait would be too long (429).

    Attributes: ``model``, ``retry_after_ms``, ``depth``, ``limit``.
    """

    code = 429


class NoCapacity(RewarmError):
    """No replica can be made available for this model (503). Attributes: ``model``."""

    code = 503


class DeadlineExceeded(RewarmError, TimeoutError):
    """The request's deadline passed before it could be served (504).

    Attributes: ``deadline_ms``, ``waited_ms``.
    """

    code = 504


# --- configuration, devices and the outside systems --------------------------------------

class ConfigError(RewarmError, ValueError):
    """A configuration value is out of range, or a request asks for something this node's
    configuration does not allow (409). Attributes: ``name``, ``value``, ``limit``."""

    code = 409


class InvalidTrace(RewarmError, ValueError):
    """A request trace (CSV) is malformed or over a limit.

    Attributes: ``path``, ``line`` (1-based, or None), ``field``, ``value``, ``limit``.
    """


class TraceNotFound(InvalidTrace, FileNotFoundError):
    """The trace file named does not exist (exit status 66, EX_NOINPUT, like a missing
    snapshot). Attributes as :class:`InvalidTrace`."""


class CudaCheckpointError(RewarmError, OSError):
    """A CUDA checkpoint driver call failed. Attributes: ``call``, ``result``, ``name``."""


class DriverUnavailable(CudaCheckpointError):
    """libcuda.so.1 or the checkpoint symbols (driver r570+) are missing. Attributes: ``missing``."""


class ClusterError(RewarmError, ConnectionError):
    """Consul or Nomad could not be reached or refused. Attributes: ``service``, ``status``."""


class Unreachable(ClusterError):
    """Nothing answered at a rewarm server's address (node agent, front door, replica): the
    connection was refused, the Unix socket is missing, the host is unknown...

    Attributes: ``service`` ("node agent", "front door"...), ``address`` (as given),
    ``reason`` (the OS error's text), ``errno`` (or None), ``status`` (None).
    """


class AclDenied(ClusterError, PermissionError):
    """Consul or Nomad refused the token (403). Attributes: ``service``, ``endpoint``."""


ERROR_BY_CODE: dict[int, type[RewarmError]] = {
    400: ProtocolError,
    401: Unauthorized,
    404: ModelNotFound,
    413: MessageTooLarge,
    429: Overloaded,
    503: NoCapacity,
    504: DeadlineExceeded,
}
