"""Wire framing and message schema shared by the front door, replicas and the node agent.

Framing: a byte stream of concatenated msgpack maps (no length prefix), decoded with
msgpack's streaming ``Unpacker``.  A frame cut across TCP reads simply waits for more bytes;
many frames in one read decode one after another.

Every message is a map with ``"v": PROTOCOL_VERSION``.  Requests carry ``"op"`` and ``"id"``;
answers carry the request's ``"id"`` and ``"type"``:

=========  ===============================================================================
type       fields
=========  ===============================================================================
tokens     ``tokens: [int]`` (and ``text`` when the prompt was text or messages)
done       ``ttft_ms, total_ms, path, replica, n_tokens, prompt_tokens, finish_reason``
           (and ``text``: the whole completion, up to a stop string)
error      ``code: int, reason: str`` (and ``retry_after_ms`` with 429)
result     ``result: map`` (stats, health, models, control-plane answers)
=========  ===============================================================================

Requests are checked against their op's schema by :func:`validate_request`
(:data:`OP_SCHEMAS`: generate, stats, health, models).

Limits are explicit, documented in docs/protocol.md, and never disabled.  Declared lengths
and nesting are checked when their header arrives (:func:`scan_headers`), not when the data
does.  A message exactly
at a limit is accepted; one byte or one element over is refused with
:class:`~agent.errors.MessageTooLarge` (413) or :class:`~agent.errors.ProtocolError` (400).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

import msgpack

from agent.errors import ConfigError, MessageTooLarge, ProtocolError, Unreachable

PROTOCOL_VERSION = 1
_MSGPACK_LIMIT = re.compile(r"(\d+) exceeds max_(\w+?)_len\((\d+)\)")


@dataclass(frozen=True)
class Limits:
    """Upper bounds checked by the decoder before it allocates.

    ``max_message_bytes`` bounds one encoded message (and so the decoder's buffer);
    the others bound msgpack's containers and the nesting of the decoded value.
    """

    max_message_bytes: int = 1 << 20
    max_str_bytes: int = 256 * 1024
    max_bin_bytes: int = 256 * 1024
    max_array_len: int = 65_536
    max_map_len: int = 64
    max_depth: int = 8
    max_new_tokens: int = 4096       # generate.max_tokens
    max_deadline_ms: int = 600_000   # generate.deadline_ms (ten minutes)
    max_name_bytes: int = 128        # model names, tokens, request ids given as text
    max_stop: int = 16               # generate.stop entries (strings and token ids together)
    max_stop_bytes: int = 256        # one stop string, in UTF-8 bytes
    max_messages: int = 256          # generate.messages entries (chat)


DEFAULT_LIMITS = Limits()


def pack(message: dict[str, Any]) -> bytes:
    """Encode one message; adds ``"v"`` when it is missing."""
    if "v" not in message:
        message = {"v": PROTOCOL_VERSION, **message}
    return msgpack.packb(message, use_bin_type=True)


_CONTAINERS = frozenset((dict, list))


def _depth(value: Any, limit: int, depth: int = 1) -> None:
    """Raise ProtocolError when ``value`` (at ``depth``) nests deeper than ``limit``.

    A container of scalars only, the common case, is settled by one C-level pass
    (``isdisjoint(map(type, ...))``) instead of a Python loop over its items.
    """
    if depth > limit:
        raise ProtocolError(
            f"message nesting depth {depth} exceeds max_depth({limit})",
            field="depth", value=depth, limit=limit)
    items = value.values() if type(value) is dict else value
    if _CONTAINERS.isdisjoint(map(type, items)):
        return
    for item in items:
        kind = type(item)
        if kind is list or kind is dict:
            inner = item.values() if kind is dict else item
            if depth + 1 > limit or not _CONTAINERS.isdisjoint(map(type, inner)):
                _depth(item, limit, depth + 1)


READ_SIZE_BYTES = 16 << 10   # a connection's first decode buffer (grows as needed)


class Decoder:
    """Incremental decoder of a message stream with every limit enforced.

    ``feed(data)`` returns the complete messages now available.  A message split across
    reads stays buffered.  Raises :class:`MessageTooLarge` when a message (or the data
    buffered for one) exceeds ``max_message_bytes`` or a string/binary/container limit, and
    :class:`ProtocolError` for invalid msgpack, invalid UTF-8, a non-map top level, a wrong
    or missing version, or nesting deeper than ``max_depth``.  After an error the stream is
    unusable: close the connection.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._unpacker = msgpack.Unpacker(
            raw=False,
            # A key that is not a string ({1: "x"}) decodes, and validate_request refuses it
            # as a request error (400, connection kept); only a container as a key, which
            # Python cannot hash, remains a framing error.
            strict_map_key=False,
            max_buffer_size=limits.max_message_bytes,
            max_str_len=limits.max_str_bytes,
            max_bin_len=limits.max_bin_bytes,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
            # The unpacker's first buffer; it grows to what a message needs.  msgpack's default
            # (max_buffer_size, 1 MiB here) per connection fragments the heap as thousands of
            # connections come and go.
            read_size=min(READ_SIZE_BYTES, limits.max_message_bytes),
        )
        self._fed = 0       # bytes fed since the stream started
        self._boundary = 0  # stream offset just after the last complete message
        self._scan_pos = 0      # stream offset of the next header to check (see _scan)
        self._scan_tail = b""   # bytes from _scan_pos on of a header cut by a read
        self._scan_stack: list[int] = []  # items still due in each open container

    @property
    def buffered_bytes(self) -> int:
        """Bytes of an incomplete message held now."""
        return self._fed - self._boundary

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """The messages ``data`` completes.  On an error, the messages complete before it
        ride on the exception as ``err.decoded`` (a reader can still answer them)."""
        out: list[dict[str, Any]] = []
        try:
            return self._feed(data, out)
        except ProtocolError as err:
            err.decoded = out
            raise

    def _feed(self, data: bytes, out: list[dict[str, Any]]) -> list[dict[str, Any]]:
        limit = self.limits.max_message_bytes
        if len(data) <= limit - (self._fed - self._boundary):  # fits: the common case
            self._unpacker.feed(data)
            start = self._fed
            self._fed += len(data)
            self._drain(out)
            if self._fed > self._boundary:
                self._scan(memoryview(data), start)
            return out
        view = memoryview(data)
        while view:
            # Never hand the unpacker more than it may buffer for one message.
            room = limit - self.buffered_bytes
            if room <= 0:
                raise MessageTooLarge(
                    f"message exceeds max_message_bytes({limit})",
                    field="message", value=self.buffered_bytes + len(view), limit=limit)
            if len(view) <= room:
                piece, view = view, view[:0]
            else:
                piece, view = view[:room], view[room:]
            self._unpacker.feed(piece)
            start = self._fed
            self._fed += len(piece)
            self._drain(out)
            if self._fed > self._boundary:  # a message is incomplete: check its headers now
                self._scan(piece, start)
        return out

    def _scan(self, piece: memoryview, piece_start: int) -> None:
        """Walk the headers of the incomplete message so that a declared length or depth
        over a limit is refused when its header arrives, not when (or if) its data does.

        msgpack checks ``max_bin_len``/``max_str_len`` only once the payload is buffered and
        nesting only past its own stack (StackError); this walk costs nothing for messages
        that arrive whole.
        """
        if self._scan_pos < self._boundary:  # a new message starts at the boundary
            self._scan_pos, self._scan_tail, self._scan_stack = self._boundary, b"", []
        if self._scan_pos >= piece_start:
            if self._scan_pos >= self._fed:  # still skipping a payload
                return
            data = bytes(piece[self._scan_pos - piece_start:])
        else:                                # a header was cut by the previous read
            data = self._scan_tail + bytes(piece)
        at_start = self._scan_pos == self._boundary
        pos, tail = scan_headers(data, self._scan_stack, self.limits, at_start=at_start,
                                 offset=self._scan_pos - self._boundary)
        self._scan_pos += pos
        self._scan_tail = tail

    def _drain(self, out: list[dict[str, Any]]) -> None:
        """Append every complete message to ``out`` (a plain loop over the unpacker: this
        is the hot path)."""
        unpacker, limits = self._unpacker, self.limits
        tell = unpacker.tell
        try:
            for message in unpacker:
                self._boundary = tell()
                if type(message) is dict and type(message.get("v")) is int and \
                        message["v"] == PROTOCOL_VERSION:
                    _depth(message, limits.max_depth)  # the common case, checked inline
                    out.append(message)
                else:
                    out.append(validate_envelope(message, limits))
        except ProtocolError:
            raise
        except msgpack.StackError:  # raised with an empty message
            raise ProtocolError(
                f"bad message: nesting exceeds msgpack's stack and max_depth"
                f"({limits.max_depth})", field="depth", value=None,
                limit=limits.max_depth) from None
        except ValueError as exc:  # msgpack's limit errors and invalid UTF-8
            text = str(exc)
            found = _MSGPACK_LIMIT.match(text)
            if found:  # "<n> exceeds max_<kind>_len(<limit>)"
                raise MessageTooLarge(f"bad message: {text}", field=found[2],
                                      value=int(found[1]), limit=int(found[3])) from None
            raise ProtocolError(f"bad message: {text or type(exc).__name__}", field="message",
                                value=None, limit=None) from None
        except Exception as exc:  # ExtraData, FormatError
            raise ProtocolError(f"bad message: {type(exc).__name__}: {exc}",
                                field="message", value=None, limit=None) from None


# msgpack type bytes -> (header bytes, kind); see the msgpack spec's "Formats" table.
_FIXED = {0xc0: 1, 0xc2: 1, 0xc3: 1, 0xca: 5, 0xcb: 9, 0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9,
          0xd0: 2, 0xd1: 3, 0xd2: 5, 0xd3: 9}
_SIZED = {0xd9: (2, "str"), 0xda: (3, "str"), 0xdb: (5, "str"),
          0xc4: (2, "bin"), 0xc5: (3, "bin"), 0xc6: (5, "bin"),
          0xdc: (3, "array"), 0xdd: (5, "array"), 0xde: (3, "map"), 0xdf: (5, "map")}


def scan_headers(data: bytes, stack: list[int], limits: Limits, *, at_start: bool,
                 offset: int = 0) -> tuple[int, bytes]:
    """Check msgpack headers in ``data`` (the start of, or more of, one message).

    ``stack`` holds the items still due in each open container and is updated in place;
    ``offset`` is where ``data`` starts inside the message.  Returns ``(advanced, tail)``:
    bytes walked (past ``len(data)`` while a str/bin payload is still to come) and the bytes
    of a header cut short.  Raises :class:`MessageTooLarge` for a declared length over its
    limit or past ``max_message_bytes``, and :class:`ProtocolError` for a non-map top level,
    nesting deeper than ``max_depth``, ext types or the unused byte 0xc1.
    """
    pos, end = 0, len(data)
    while pos < end:
        if not stack and not (at_start and pos == 0):
            return pos, b""  # the message is complete; the decoder takes it from here
        byte = data[pos]
        n = -1               # container items (-1: not a container)
        size = 0             # str/bin payload bytes
        if byte <= 0x7f or byte >= 0xe0:
            head = 1
        elif byte <= 0x8f:
            head, n, kind = 1, byte & 0x0f, "map"
        elif byte <= 0x9f:
            head, n, kind = 1, byte & 0x0f, "array"
        elif byte <= 0xbf:
            head, size, kind = 1, byte & 0x1f, "str"
        elif byte in _FIXED:
            head = _FIXED[byte]
        elif byte in _SIZED:
            head, kind = _SIZED[byte]
            if pos + head > end:
                return pos, data[pos:]
            length = int.from_bytes(data[pos + 1:pos + head], "big")
            if kind in ("map", "array"):
                n = length
            else:
                size = length
        else:
            raise ProtocolError(f"bad message: msgpack type byte 0x{byte:02x} is not allowed",
                                field="type", value=byte, limit="no ext types")
        if at_start and pos == 0 and not (n >= 0 and kind == "map"):
            raise ProtocolError("top level must be a map", field="top level",
                                value=f"0x{byte:02x}", limit="map")
        if n >= 0:
            cap = limits.max_map_len if kind == "map" else limits.max_array_len
            if n > cap:
                raise MessageTooLarge(
                    f"bad message: {kind} of {n} items exceeds max_{kind}_len({cap})",
                    field=kind, value=n, limit=cap)
            if len(stack) + 1 > limits.max_depth:
                raise ProtocolError(
                    f"message nesting depth {len(stack) + 1} exceeds max_depth({limits.max_depth})",
                    field="depth", value=len(stack) + 1, limit=limits.max_depth)
        elif size:
            cap = limits.max_str_bytes if kind == "str" else limits.max_bin_bytes
            if size > cap:
                raise MessageTooLarge(
                    f"bad message: {kind} of {size} bytes exceeds max_{kind}_len({cap})",
                    field=kind, value=size, limit=cap)
        total = offset + pos + head + size
        if total > limits.max_message_bytes:
            raise MessageTooLarge(
                f"message of at least {total} bytes exceeds max_message_bytes"
                f"({limits.max_message_bytes})", field="message", value=total,
                limit=limits.max_message_bytes)
        if pos + head > end:
            return pos, data[pos:]
        if stack:
            stack[-1] -= 1
        if n > 0:
            stack.append(2 * n if kind == "map" else n)
        while stack and stack[-1] == 0:
            stack.pop()
        pos += head + size
    return pos, b""


def validate_envelope(message: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Check the top level: a map with ``v == PROTOCOL_VERSION`` and nesting within limits."""
    if not isinstance(message, dict):
        raise ProtocolError(
            f"top level must be a map, got {type(message).__name__}",
            field="top level", value=type(message).__name__, limit="map")
    _depth(message, limits.max_depth)
    version = message.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:   # not True, not 1.0
        raise ProtocolError(
            f"protocol version {version!r} not supported; expected {PROTOCOL_VERSION}",
            field="v", value=version, limit=PROTOCOL_VERSION)
    return message


async def read_messages(reader: asyncio.StreamReader, decoder: Decoder,
                        chunk_bytes: int = 65_536):
    """Yield messages from an asyncio stream until EOF.  Errors propagate (close after), once
    the messages complete before the bad bytes have been yielded."""
    while True:
        data = await reader.read(chunk_bytes)
        if not data:
            return
        try:
            messages = decoder.feed(data)
        except ProtocolError as err:
            for message in getattr(err, "decoded", None) or ():
                yield message
            raise
        for message in messages:
            yield message


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

# op -> {field: (allowed types, required)}; "v" and "op" are always present.  bool is
# refused where an int is due (msgpack true/false decode to bool, a subclass of int).
OP_SCHEMAS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "generate": {"id": (_ID, True), "model": ((str,), True), "prompt": ((str,), False),
                 "tokens": ((list,), False), "messages": ((list,), False),
                 "max_tokens": (_INT, False), "seed": (_INT + (type(None),), False),
                 "temperature": (_NUM, False), "top_p": (_NUM, False), "top_k": (_INT, False),
                 "deadline_ms": (_NUM, False), "stop": ((list,), False),
                 "detokenize": ((bool,), False), "ignore_eos": ((bool,), False),
                 "fit_context": ((bool,), False),
                 "token": ((str,), False)},
    "stats": {"id": (_ID, True), "token": ((str,), False)},
    "health": {"id": (_ID, True), "token": ((str,), False)},
    "models": {"id": (_ID, True), "token": ((str,), False)},
}
"""The front door's operations and their fields (docs/protocol.md)."""

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
                     schemas: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = OP_SCHEMAS,
                     ) -> dict[str, Any]:
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
            raise _bad(key, type(value).__name__, [t.__name__ for t in spec[0]],
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
    model = message["model"]
    if not model or (len(model) > limits.max_name_bytes // 4
                     and len(model.encode()) > limits.max_name_bytes):
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


def unreachable(service: str, address: str, exc: OSError, hint: str = "") -> Unreachable:
    """The :class:`Unreachable` for a failed connect to ``service`` at ``address``: the
    message names both, the OS error's text and, when given, ``hint`` (what to do)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return Unreachable(f"cannot reach {service} at {address}: {reason}"
                       + (f" ({hint})" if hint else ""), service=service, address=address,
                       reason=reason, errno=exc.errno, status=None)


def request(address: str, message: dict[str, Any], *, timeout_s: float = 120.0,
            service: str = "server", hint: str = "") -> list[dict[str, Any]]:
    """Blocking one-request client shared by the CLI, the node agent, the predictor and tests.

    ``address`` is ``host:port`` or ``unix:PATH``.  Sends ``message`` and returns every answer
    up to and including the final one (type ``done``, ``error`` or ``result``).
    Raises ConfigError for an address of neither form, :class:`~agent.errors.Unreachable` (a
    ConnectionError naming ``service``, the address and ``hint``) when nothing answers there,
    TimeoutError (after ``timeout_s`` without progress), ConnectionError (closed before a
    final answer), ProtocolError for a malformed answer.
    """
    import socket

    target: str | tuple[str, int]
    if address.startswith("unix:"):
        family, target = socket.AF_UNIX, address[len("unix:"):]
    else:
        host, _, port = address.rpartition(":")
        if not port.isdigit() or not 0 < int(port) <= 65535:
            raise ConfigError(f"{service} address {address!r} is not HOST:PORT (port 1..65535) "
                              "or unix:PATH", name="address", value=address,
                              limit="HOST:PORT or unix:PATH")
        family, target = socket.AF_INET, (host or "127.0.0.1", int(port))
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    decoder, answers = Decoder(), []
    with sock:
        try:
            sock.connect(target)
        except TimeoutError:
            raise
        except OSError as exc:
            raise unreachable(service, address, exc, hint) from exc
        sock.sendall(pack(message))
        while True:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError(f"{address} closed the connection before answering")
            for answer in decoder.feed(data):
                answers.append(answer)
                if answer.get("type") in ("done", "error", "result"):
                    return answers
