"""Wire framing and message schema shared by the front door, replicas and the node agent.

Framing: a byte stream of concatenated msgpack maps (no length prefix), decoded with
msgpack's streaming ``Unpacker``.  A frame cut across TCP reads simply waits for more bytes;
many frames in one read decode one after another.

Every message is a map with ``"v": PROTOCOL_VERSION``.  Requests carry ``"op"`` and ``"id"``;
answers carry the request's ``"id"`` and ``"type"``:

=========  ===============================================================================
type       fields
=========  ===============================================================================
tokens     ``tokens: [int]`` (and ``text`` when the prompt was text)
done       ``ttft_ms, total_ms, path, replica, n_tokens`` (and ``text``)
error      ``code: int, reason: str`` (and ``retry_after_ms`` with 429)
result     ``result: map`` (stats, health, models, control-plane answers)
=========  ===============================================================================

Limits are explicit, documented in docs/protocol.md, and never disabled.  A message exactly
at a limit is accepted; one byte or one element over is refused with
:class:`~agent.errors.MessageTooLarge` (413) or :class:`~agent.errors.ProtocolError` (400).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Iterator

import msgpack

from agent.errors import MessageTooLarge, ProtocolError

PROTOCOL_VERSION = 1


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


DEFAULT_LIMITS = Limits()


def pack(message: dict[str, Any]) -> bytes:
    """Encode one message; adds ``"v"`` when it is missing."""
    if "v" not in message:
        message = {"v": PROTOCOL_VERSION, **message}
    return msgpack.packb(message, use_bin_type=True)


def _depth(value: Any, limit: int, depth: int = 1) -> None:
    if depth > limit:
        raise ProtocolError(
            f"message nesting depth {depth} exceeds max_depth({limit})",
            field="depth", value=depth, limit=limit)
    if isinstance(value, dict):
        for item in value.values():
            if isinstance(item, (dict, list)):
                _depth(item, limit, depth + 1)
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, (dict, list)):
                _depth(item, limit, depth + 1)


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
            strict_map_key=True,
            max_buffer_size=limits.max_message_bytes,
            max_str_len=limits.max_str_bytes,
            max_bin_len=limits.max_bin_bytes,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
        self._fed = 0       # bytes fed since the stream started
        self._boundary = 0  # stream offset just after the last complete message

    @property
    def buffered_bytes(self) -> int:
        """Bytes of an incomplete message held now."""
        return self._fed - self._boundary

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        limit = self.limits.max_message_bytes
        out: list[dict[str, Any]] = []
        view = memoryview(data)
        while view:
            # Never hand the unpacker more than it may buffer for one message.
            room = limit - self.buffered_bytes
            if room <= 0:
                raise MessageTooLarge(
                    f"message exceeds max_message_bytes({limit})",
                    field="message", value=self.buffered_bytes + len(view), limit=limit)
            piece, view = view[:room], view[room:]
            self._unpacker.feed(piece)
            self._fed += len(piece)
            out.extend(self._drain())
        return out

    def _drain(self) -> Iterator[dict[str, Any]]:
        while True:
            try:
                message = self._unpacker.unpack()
            except msgpack.OutOfData:
                return
            except ValueError as exc:  # msgpack's limit errors and invalid UTF-8
                text = str(exc)
                cls = MessageTooLarge if "exceeds max" in text else ProtocolError
                raise cls(f"bad message: {text}", field="message", value=None,
                          limit=None) from None
            except Exception as exc:  # ExtraData, FormatError, StackError
                raise ProtocolError(f"bad message: {type(exc).__name__}: {exc}",
                                    field="message", value=None, limit=None) from None
            self._boundary = self._unpacker.tell()
            yield validate_envelope(message, self.limits)


def validate_envelope(message: Any, limits: Limits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Check the top level: a map with ``v == PROTOCOL_VERSION`` and nesting within limits."""
    if not isinstance(message, dict):
        raise ProtocolError(
            f"top level must be a map, got {type(message).__name__}",
            field="top level", value=type(message).__name__, limit="map")
    _depth(message, limits.max_depth)
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} not supported; expected {PROTOCOL_VERSION}",
            field="v", value=version, limit=PROTOCOL_VERSION)
    return message


async def read_messages(reader: asyncio.StreamReader, decoder: Decoder,
                        chunk_bytes: int = 65_536):
    """Yield messages from an asyncio stream until EOF.  Errors propagate (close after)."""
    while True:
        data = await reader.read(chunk_bytes)
        if not data:
            return
        for message in decoder.feed(data):
            yield message


def error_message(request_id: Any, code: int, reason: str, **extra: Any) -> dict[str, Any]:
    """The answer for a failed request: ``{"type": "error", "code", "reason", ...}``."""
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": "error", "code": code,
            "reason": reason, **extra}
