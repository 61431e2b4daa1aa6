"""Framing: a byte stream of concatenated msgpack maps, decoded under explicit limits.

No length prefix: msgpack's streaming ``Unpacker`` finds each map's end.  A frame cut across
TCP reads simply waits for more bytes; many frames in one read decode one after another.
Every message is a map with ``"v": PROTOCOL_VERSION``.

Limits are explicit (:class:`Limits`), documented in docs/protocol.md, and never disabled.
Declared lengths and nesting are checked when their header arrives (:func:`scan_headers`),
not when the data does.  A message exactly at a limit is accepted; one byte or one element
over is refused with :class:`~agent.errors.MessageTooLarge` (413) or
:class:`~agent.errors.ProtocolError` (400).  What each message may hold is
:mod:`agent.wire.schema`'s.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

import msgpack

from agent.errors import MessageTooLarge, ProtocolError

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
