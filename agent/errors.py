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

from agent.wire import refusals


class RewarmError(Exception):
    """Base of every error rewarm raises on purpose.

    Attributes given as keywords are kept on the instance (``err.path``, ``err.limit``...)
    so that handlers and tests can read them without parsing the message.  ``refusal``: for
    an error that refuses a request, why, as one of :data:`agent.wire.refusals.REFUSALS`
    (a class default, or given where the refusal is decided); it travels in the ``error``
    answer's ``refusal`` field.
    """

    code: int = 500
    refusal: str | None = None

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

    path: object
    chunk: int | None
    tensors: list[str]
    expected: object
    actual: object


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

    path: object
    field: object
    value: object
    limit: object


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


class PackageBuildFailed(RewarmError, RuntimeError):
    """``rewarm build`` could not export or compile the forward for its target (the error of
    torch.export or AOTInductor, chained as ``__cause__``); the build leaves no package.
    Attributes: ``package`` (the directory it was building), ``target``, ``stage`` (``export``
    | ``compile`` | ``check``), ``error`` (the cause's type and message).
    """


class CapacityExceeded(RewarmError, MemoryError):
    """A request cannot fit in the KV cache. Attributes: ``need_tokens``, ``limit_tokens``."""

    code = 413
    refusal = refusals.TOO_LARGE


# --- the wire ---------------------------------------------------------------------------

class ProtocolError(RewarmError, ValueError):
    """A malformed or out-of-limit message (400).  A well-framed request that fails its
    checks is answered alone; a framing error ends the connection once the requests in flight
    on it are answered (docs/protocol.md).

    Attributes: ``field``, ``value``, ``limit``; ``decoded``: messages complete before a
    framing error (from :meth:`agent.protocol.Decoder.feed`).
    """

    field: object
    value: object
    limit: object
    decoded: list[dict[str, Any]]

    code = 400


class ContextLengthExceeded(ProtocolError):
    """Prompt + ``max_tokens`` is longer than the model's context (400).

    Worded as vLLM's OpenAI server words it (vllm/entrypoints/openai/serving_engine.py,
    ``_validate_prompt_and_tokenize``: a ``ValueError`` answered 400), so that clients that
    recognise "maximum context length is N tokens" (LangChain, LiteLLM) do.

    Attributes: ``field`` (``max_tokens``), ``value`` (prompt + max_tokens), ``limit`` (the
    context, ``max_model_len``), ``prompt_tokens``, ``max_tokens``.
    """

    refusal = refusals.CONTEXT_LENGTH

    def __init__(self, max_model_len: int, prompt_tokens: int, max_tokens: int) -> None:
        total = prompt_tokens + max_tokens
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion.",
            field="max_tokens", value=total, limit=max_model_len,
            prompt_tokens=prompt_tokens, max_tokens=max_tokens)


class MessageTooLarge(ProtocolError):
    """A message or one of its parts is over a limit (413)."""

    code = 413


class Unauthorized(RewarmError, PermissionError):
    """Missing or wrong tenant token (401)."""

    code = 401


class ModelNotFound(RewarmError, LookupError):
    """No such model is configured (404). Attributes: ``model``."""

    code = 404
    refusal = refusals.UNKNOWN_MODEL


class ReplicaNotFound(RewarmError, LookupError):
    """No replica with this id on the node (404).

    Attributes: ``replica`` (the id asked for), ``node``, ``limit`` (the ids it has).
    """

    code = 404


class Overloaded(RewarmError):
    """Admission refused: the queue is full or the wait would be too long (429).

    Attributes: ``model``, ``retry_after_ms``, ``depth``, ``limit``; ``refusal`` is given
    where it is raised (``queue_full``, ``max_wait``, ``deadline_unreachable``).
    """

    model: str
    retry_after_ms: int
    depth: int
    limit: int
    answer: dict[str, Any]   # a replica's refusal: predicted_ttft_ms, deadline_ms, retry_after_ms

    code = 429


class NoCapacity(RewarmError):
    """No replica can be made available for this model (503). Attributes: ``model``."""

    code = 503
    refusal = refusals.NO_CAPACITY


class DeadlineExceeded(RewarmError, TimeoutError):
    """The request's deadline passed before it could be served (504).

    Attributes: ``deadline_ms``, ``waited_ms``.
    """

    code = 504
    refusal = refusals.DEADLINE


# --- configuration, devices and the outside systems --------------------------------------

class ConfigError(RewarmError, ValueError):
    """A configuration value is out of range, or a request asks for something this node's
    configuration does not allow (409). Attributes: ``name``, ``value``, ``limit``."""

    name: str
    value: object
    limit: object

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

    call: str
    result: int | None
    name: str | None


class DriverUnavailable(CudaCheckpointError):
    """libcuda.so.1 or the checkpoint symbols (driver r570+) are missing. Attributes: ``missing``."""


class ClusterError(RewarmError, ConnectionError):
    """Consul or Nomad could not be reached or refused.

    Attributes: ``service``, ``status`` (HTTP status, None when nothing answered),
    ``endpoint``, ``retryable`` (429, 5xx and transport failures), ``retry_after_s`` (from a
    ``Retry-After`` header or the caller's back-off; None when none was given).
    """

    service: str
    status: int | None
    endpoint: str | None
    retryable: bool
    retry_after_s: float | None


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
