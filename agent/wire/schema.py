"""The wire's message schema, one for both sides: what each op may carry, and its checks.

The front door's entrances (msgpack and HTTP) and the replica validate a ``generate`` with the
same :func:`validate_request` over :data:`OP_SCHEMAS` (the front door's ops) or
:data:`REPLICA_SCHEMAS` (the replica's ``generate``: ``model`` optional, since a replica
serves one; ``deadline_ms`` is the time left for the first token), so ``max_tokens`` has one
limit (:attr:`~agent.wire.framing.Limits.max_new_tokens`) and sampling one range check.

Answers carry the request's ``"id"`` and ``"type"``:

=========  ===============================================================================
type       fields
=========  ===============================================================================
tokens     ``tokens: [int]`` (and ``text`` when the prompt was text or messages)
done       ``ttft_ms, total_ms, path, replica, n_tokens, prompt_tokens, finish_reason``
           (and ``text``: the whole completion, up to a stop string)
error      ``code: int, reason: str`` (and ``retry_after_ms`` with 429; ``refusal``: why it
           was refused, one of :data:`agent.wire.refusals.REFUSALS`)
result     ``result: map`` (stats, health, models, control-plane answers)
=========  ===============================================================================
"""

from __future__ import annotations

from typing import Any

from agent.errors import MessageTooLarge, ProtocolError
from agent.wire.framing import DEFAULT_LIMITS, PROTOCOL_VERSION, Limits, pack

def reply_id(request_id: Any, limits: Limits = DEFAULT_LIMITS) -> Any:
    """The id to answer a possibly malformed request with: its own when it is an int or a
    string within ``max_name_bytes``, else None (never echo a list or a huge string back)."""
    if type(request_id) is int or (type(request_id) is str
                                   and len(request_id.encode()) <= limits.max_name_bytes):
        return request_id
    return None


def error_message(request_id: Any, code: int, reason: str, *, refusal: str | None = None,
                  **extra: Any) -> dict[str, Any]:
    """The answer for a failed request: ``{"type": "error", "code", "reason", ...}``, with
    ``"refusal"`` (why it was refused, one of agent/wire/refusals.py's codes) when given."""
    message = {"v": PROTOCOL_VERSION, "id": request_id, "type": "error", "code": code,
               "reason": reason, **extra}
    if refusal is not None:
        message["refusal"] = refusal
    return message


# --- request schemas ---------------------------------------------------------------------

_INT = (int,)
_NUM = (int, float)
_ID = (int, str)
_TOKEN_ID_MAX = (1 << 31) - 1
MAX_SEED = (1 << 63) - 1       # torch.Generator.manual_seed takes a signed 64-bit value
MAX_TEMPERATURE = 2.0          # OpenAI's documented range for temperature is 0..2
DEFAULT_MAX_TOKENS = 16        # generate.max_tokens when absent (OpenAI completions' default)

Schema = dict[str, dict[str, tuple[tuple[type, ...], bool]]]
"""op -> {field: (allowed types, required)}; "v" and "op" are always present.  bool is
refused where an int is due (msgpack true/false decode to bool, a subclass of int)."""

_GENERATE: dict[str, tuple[tuple[type, ...], bool]] = {
    "id": (_ID, True), "model": ((str,), True), "prompt": ((str,), False),
    "tokens": ((list,), False), "messages": ((list,), False),
    "max_tokens": (_INT, False), "seed": (_INT + (type(None),), False),
    "temperature": (_NUM, False), "top_p": (_NUM, False), "top_k": (_INT, False),
    "deadline_ms": (_NUM, False), "stop": ((list,), False),
    "detokenize": ((bool,), False), "ignore_eos": ((bool,), False),
    "fit_context": ((bool,), False),
    "token": ((str,), False)}

OP_SCHEMAS: Schema = {
    "generate": _GENERATE,
    "stats": {"id": (_ID, True), "token": ((str,), False)},
    "health": {"id": (_ID, True), "token": ((str,), False)},
    "models": {"id": (_ID, True), "token": ((str,), False)},
}
"""The front door's operations and their fields (docs/protocol.md)."""

REPLICA_SCHEMAS: Schema = {
    "generate": {**_GENERATE, "model": ((str,), False)},
}
"""The replica's ``generate``: the front door's fields and checks, ``model`` optional (a
replica serves one model; a client talking to it directly may leave the name out).  Its
other ops (cancel, health, stats, restore, capture, shutdown) carry no fields to check
beyond their own handlers'."""

_REQUIRED = {op: frozenset(k for k, (_, req) in fields.items() if req)
             for op, fields in OP_SCHEMAS.items()}


def _bad(field: str, value: Any, limit: Any, why: str) -> ProtocolError:
    """A 400 whose reason names the field, the value and the limit (also as attributes)."""
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ProtocolError(f"field {field!r}: {why} (value {shown}, limit {limit!r})",
                         field=field, value=value, limit=limit)


def validate_request(message: dict[str, Any], limits: Limits = DEFAULT_LIMITS,
                     schemas: Schema = OP_SCHEMAS) -> dict[str, Any]:
    """Check one decoded request against its op's schema and return it (a generate without
    ``max_tokens`` gets :data:`DEFAULT_MAX_TOKENS` filled in; nothing else changes).

    Raises :class:`ProtocolError` (400) naming the field, the value and the expected type or
    limit for: a map key that is not a string, an unknown op, an unknown field, a missing
    field, a value of the wrong type, ``max_tokens`` outside 1..``max_new_tokens``,
    ``deadline_ms`` outside (0, ``max_deadline_ms``], token ids outside 0..2**31-1, not
    exactly one of ``prompt``, ``tokens`` and ``messages`` (generate), a sampling field out
    of range, names longer than ``max_name_bytes``.
    """
    op = message.get("op")
    schema = schemas.get(op) if isinstance(op, str) else None
    if schema is None:
        raise _bad("op", op, sorted(schemas), "unknown operation")
    for key, value in message.items():
        if key == "v" or key == "op":
            continue
        spec = schema.get(key)
        if spec is None:
            if type(key) is not str:
                raise _bad(repr(key), type(key).__name__, "str", "map keys must be strings")
            raise _bad(key, value, sorted(schema), f"unknown field for op {op!r}")
        if type(value) not in spec[0]:
            raise _bad(key, value, [t.__name__ for t in spec[0]],
                       f"wrong type {type(value).__name__}")
    required = _REQUIRED.get(str(op)) if schemas is OP_SCHEMAS else None
    if required is None:
        required = frozenset(k for k, (_, req) in schema.items() if req)
    if not required <= message.keys():
        missing = sorted(required - message.keys())[0]
        raise _bad(missing, None, "required", f"missing for op {op!r}")
    rid = message["id"]
    if type(rid) is str and len(rid) > limits.max_name_bytes // 4 and \
            len(rid.encode()) > limits.max_name_bytes:   # bytes, not characters
        raise _bad("id", len(rid.encode()), limits.max_name_bytes, "too long in UTF-8 bytes")
    if op == "generate":
        _check_generate(message, limits)
    return message


def _check_generate(message: dict[str, Any], limits: Limits) -> None:
    model = message.get("model")    # required by OP_SCHEMAS; a replica's may leave it out
    if model is not None and (not model or (len(model) > limits.max_name_bytes // 4
                                            and len(model.encode()) > limits.max_name_bytes)):
        raise _bad("model", len(model.encode()), limits.max_name_bytes,
                   "length in UTF-8 bytes must be 1..limit")
    n = message.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
    if not 1 <= n <= limits.max_new_tokens:
        raise _bad("max_tokens", n, limits.max_new_tokens, "must be within 1..limit")
    given = [k for k in ("prompt", "tokens", "messages") if k in message]
    if len(given) != 1:
        raise _bad("prompt", given, "exactly one of prompt, tokens, messages",
                   "give prompt, tokens or messages")
    prompt = message.get("prompt")
    if prompt is not None:
        _check_str_bytes("prompt", prompt, limits)
    ids = message.get("tokens")
    if ids is not None:
        if not ids:
            raise _bad("tokens", 0, ">= 1", "empty prompt")
        if len(ids) > limits.max_array_len:   # an HTTP body can hold more; the replica's
            raise MessageTooLarge(             # decoder would refuse the frame
                f"field 'tokens': {len(ids)} token ids exceed max_array_len"
                f"({limits.max_array_len})", field="tokens", value=len(ids),
                limit=limits.max_array_len)
        for t in ids:
            if type(t) is not int or not 0 <= t <= _TOKEN_ID_MAX:
                raise _bad("tokens", t, _TOKEN_ID_MAX, "token ids are ints within 0..limit")
    if "messages" in message:
        _check_messages(message["messages"], limits)
    if "stop" in message:
        check_stop(message["stop"], limits)
    if not _SAMPLING.isdisjoint(message):
        _check_sampling(message)
    deadline = message.get("deadline_ms")
    if deadline is not None and not 0 < deadline <= limits.max_deadline_ms:
        raise _bad("deadline_ms", deadline, limits.max_deadline_ms, "must be within (0, limit]")
    _check_frame(message, limits)


LINK_ID_BYTES = 8
"""Bytes a front door's own request id may add when it forwards a generate (a uint64)."""


def _check_frame(message: dict[str, Any], limits: Limits) -> None:
    """MessageTooLarge (413, field ``message``) for a generate that would pack past
    ``max_message_bytes`` once forwarded: a JSON body within the HTTP door's limit, or a
    msgpack frame right at the limit with ``id`` 0 and no ``max_tokens``, grows by the
    fields filled in and the link's id, and the replica's decoder would reset the link (every
    request on it) over it.  Packed and measured only when an upper bound from the text
    lengths says it may be over (never for ordinary requests)."""
    texts = message.get("messages") or ()
    bound = 4 * (len(message.get("prompt") or "") + sum(len(m["content"]) for m in texts)) \
        + 9 * len(message.get("tokens") or ()) + 64 * len(texts) \
        + limits.max_stop * (4 * limits.max_stop_bytes + 9) + 4096
    if bound <= limits.max_message_bytes:
        return
    size = len(pack(message)) + LINK_ID_BYTES
    if size > limits.max_message_bytes:
        raise MessageTooLarge(f"the request packs to {size} bytes for a replica, over "
                              f"max_message_bytes({limits.max_message_bytes})",
                              field="message", value=size, limit=limits.max_message_bytes)


_SAMPLING = frozenset(("temperature", "top_p", "top_k", "seed"))


def _check_sampling(message: dict[str, Any]) -> None:
    """Ranges of the sampling fields (their types are already checked)."""
    temperature = message.get("temperature")
    if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
        raise _bad("temperature", temperature, MAX_TEMPERATURE, "must be within [0, limit]")
    top_p = message.get("top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise _bad("top_p", top_p, 1, "must be within (0, limit]")
    top_k = message.get("top_k")
    if top_k is not None and not 0 <= top_k <= _TOKEN_ID_MAX:
        raise _bad("top_k", top_k, _TOKEN_ID_MAX, "must be within 0..limit (0: off)")
    seed = message.get("seed")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise _bad("seed", seed, MAX_SEED, "must be within 0..limit")


def check_stop(stop: list, limits: Limits = DEFAULT_LIMITS) -> None:
    """``stop``: at most ``max_stop`` entries, each a token id or a non-empty string of at
    most ``max_stop_bytes`` UTF-8 bytes."""
    if len(stop) > limits.max_stop:
        raise _bad("stop", len(stop), limits.max_stop, "too many entries")
    for t in stop:
        if type(t) is int:
            if not 0 <= t <= _TOKEN_ID_MAX:
                raise _bad("stop", t, _TOKEN_ID_MAX, "token ids are ints within 0..limit")
        elif type(t) is str:
            if not t or len(t.encode()) > limits.max_stop_bytes:
                raise _bad("stop", len(t.encode()), limits.max_stop_bytes,
                           "stop strings must be 1..limit UTF-8 bytes")
        else:
            raise _bad("stop", type(t).__name__, "int or str", "entries are token ids or strings")


def _check_messages(messages: list, limits: Limits) -> None:
    """``messages`` (chat): 1..``max_messages`` maps of exactly ``role`` (a non-empty string
    of at most ``max_name_bytes``) and ``content`` (a string)."""
    if not 1 <= len(messages) <= limits.max_messages:
        raise _bad("messages", len(messages), limits.max_messages, "must hold 1..limit entries")
    for i, m in enumerate(messages):
        if type(m) is not dict or m.keys() != {"role", "content"}:
            shown = sorted(map(repr, m)) if type(m) is dict else type(m).__name__
            raise _bad(f"messages[{i}]", shown, "{role: str, content: str}",
                       "each message is a map of role and content")
        role, content = m["role"], m["content"]
        if type(role) is not str or not role or len(role.encode()) > limits.max_name_bytes:
            raise _bad(f"messages[{i}].role", role, limits.max_name_bytes,
                       "a non-empty string within limit UTF-8 bytes")
        if type(content) is not str:
            raise _bad(f"messages[{i}].content", type(content).__name__, "str",
                       "content is a string")
        _check_str_bytes(f"messages[{i}].content", content, limits)


def _check_str_bytes(field: str, value: str, limits: Limits) -> None:
    """MessageTooLarge (413) for a string over ``max_str_bytes`` in UTF-8.  The msgpack
    decoder refuses such a string itself; a map built from JSON (the HTTP door, whose body
    may be larger) must be refused here, before it is packed for a replica whose decoder
    would reset the link over it."""
    if len(value) > limits.max_str_bytes // 4 and len(value.encode()) > limits.max_str_bytes:
        raise MessageTooLarge(f"field {field!r}: {len(value.encode())} UTF-8 bytes exceed "
                              f"max_str_bytes({limits.max_str_bytes})", field=field,
                              value=len(value.encode()), limit=limits.max_str_bytes)
