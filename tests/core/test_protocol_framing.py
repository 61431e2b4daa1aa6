import msgpack
import pytest

from agent.errors import MessageTooLarge, ProtocolError
from agent.protocol import Decoder, Limits, pack


def test_split_at_every_byte_boundary_gives_the_same_messages():
    stream = b"".join(pack({"op": "generate", "id": i, "tokens": [1, 2, i]}) for i in range(3))
    for cut in range(len(stream) + 1):
        decoder = Decoder()
        got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert [m["id"] for m in got] == [0, 1, 2]
        assert got[2]["tokens"] == [1, 2, 2]
        assert decoder.buffered_bytes == 0


def test_message_exactly_at_the_byte_limit_is_accepted_and_one_over_refused():
    body = pack({"op": "x", "id": 1, "pad": ""})
    limit = len(body) + 10
    exact = pack({"op": "x", "id": 1, "pad": "a" * 10})
    assert len(exact) == limit
    assert Decoder(Limits(max_message_bytes=limit)).feed(exact)[0]["pad"] == "a" * 10
    over = pack({"op": "x", "id": 1, "pad": "a" * 11})
    with pytest.raises(MessageTooLarge) as err:
        Decoder(Limits(max_message_bytes=limit)).feed(over)
    assert err.value.limit == limit


def test_huge_declared_array_is_refused_before_allocation():
    with pytest.raises(MessageTooLarge, match="max_array_len"):
        Decoder().feed(b"\xdd\xff\xff\xff\xff")


def test_non_map_top_level_and_wrong_version_are_protocol_errors():
    with pytest.raises(ProtocolError, match="top level"):
        Decoder().feed(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError, match="version"):
        Decoder().feed(msgpack.packb({"v": 99, "op": "x"}))
