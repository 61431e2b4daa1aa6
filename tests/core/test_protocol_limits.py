import msgpack
import pytest

from agent.errors import MessageTooLarge, ProtocolError
from agent.protocol import DEFAULT_MAX_TOKENS, Decoder, Limits, pack, validate_request

LIM = Limits(max_message_bytes=4096, max_str_bytes=100, max_bin_bytes=100, max_array_len=10,
             max_map_len=6, max_depth=3)


def feed(obj, limits=LIM, raw=False):
    data = obj if raw else msgpack.packb(obj, use_bin_type=True)
    return Decoder(limits).feed(data)


@pytest.mark.parametrize("field,at,over", [
    ("s", "a" * 100, "a" * 101),
    ("b", b"x" * 100, b"x" * 101),
    ("a", list(range(10)), list(range(11))),
])
def test_container_and_payload_limits_at_and_one_over(field, at, over):
    assert feed({"v": 1, field: at})[0][field] == at
    with pytest.raises(MessageTooLarge) as err:
        feed({"v": 1, field: over})
    assert err.value.limit in (100, 10)


def test_map_length_at_and_one_over():
    at = {"v": 1, **{f"k{i}": i for i in range(5)}}
    assert len(feed(at)[0]) == 6
    with pytest.raises(MessageTooLarge, match="max_map_len"):
        feed({**at, "k9": 9})


def test_depth_at_and_one_over():
    assert feed({"v": 1, "a": [[1]]})[0]["a"] == [[1]]      # depth 3
    with pytest.raises(ProtocolError, match="max_depth") as err:
        feed({"v": 1, "a": [[[1]]]})                         # depth 4
    assert err.value.limit == 3


def test_4gib_binary_header_alone_is_refused_before_its_data():
    # {"v": 1, "b": bin32 of 0xffffffff bytes}, only the 5-byte header sent
    head = b"\x82\xa1v\x01\xa1b"
    with pytest.raises(MessageTooLarge, match="max_bin_len") as err:
        Decoder().feed(head + b"\xc6\xff\xff\xff\xff")
    assert err.value.value == 0xFFFFFFFF


def test_5_byte_messages_claiming_huge_containers_or_binary_at_top_level():
    for data in (b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"):
        with pytest.raises(ProtocolError):
            Decoder().feed(data)
    with pytest.raises(MessageTooLarge, match="max_map_len"):
        Decoder().feed(b"\xdf\xff\xff\xff\xff")


def test_ten_thousand_nested_arrays_inside_a_map_and_bare():
    with pytest.raises(ProtocolError, match="depth"):
        Decoder().feed(b"\x81\xa1a" + b"\x91" * 10_000 + b"\x01")
    with pytest.raises(ProtocolError, match="depth|top level"):
        Decoder().feed(b"\x91" * 10_000 + b"\x01")


def test_nesting_over_the_limit_is_refused_before_the_message_completes():
    with pytest.raises(ProtocolError, match="max_depth"):
        Decoder(LIM).feed(b"\x81\xa1a\x91\x91\x91")  # incomplete, already depth 4


def test_invalid_utf8_and_non_map_and_ext_types():
    with pytest.raises(ProtocolError, match="utf-8"):
        Decoder().feed(b"\x81\xa1v\xa2\xff\xfe")
    with pytest.raises(ProtocolError, match="top level"):
        Decoder().feed(msgpack.packb("hello"))
    with pytest.raises(ProtocolError, match="ext"):
        Decoder().feed(b"\x81\xa1v\xd4\x01\x01")


def test_declared_string_past_the_message_limit_is_refused_at_its_header():
    limits = Limits(max_message_bytes=64, max_str_bytes=1000)
    with pytest.raises(MessageTooLarge, match="max_message_bytes"):
        Decoder(limits).feed(b"\x81\xa1s\xda\x00\x64")


def test_byte_at_a_time_and_coalesced_reads_give_the_same_messages():
    msgs = [{"op": "generate", "id": i, "model": "m", "prompt": "é" * i, "max_tokens": 3,
             "bin": b"\x00" * (i * 30)} for i in range(6)]
    stream = b"".join(pack(m) for m in msgs)
    one = Decoder()
    got = [m for b in range(len(stream)) for m in one.feed(stream[b:b + 1])]
    assert got == Decoder().feed(stream)
    assert [m["prompt"] for m in got] == ["é" * i for i in range(6)]
    assert one.buffered_bytes == 0


GOOD = {"v": 1, "op": "generate", "id": 7, "model": "m", "tokens": [1, 2], "max_tokens": 4}


@pytest.mark.parametrize("change,field", [
    ({"op": "launch"}, "op"),
    ({"colour": "red"}, "colour"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 4097}, "max_tokens"),
    ({"deadline_ms": 0}, "deadline_ms"),
    ({"deadline_ms": 600_001}, "deadline_ms"),
    ({"tokens": [1, -1]}, "tokens"),
    ({"tokens": [1, 2 ** 31]}, "tokens"),
    ({"tokens": []}, "tokens"),
    ({"prompt": "hi"}, "prompt"),
    ({"model": "m" * 129}, "model"),
    ({"model": "\U0001F642" * 33}, "model"),       # 132 bytes in 33 characters
    ({"id": [1]}, "id"),
    ({"id": "x" * 129}, "id"),
    ({"id": "é" * 65}, "id"),                       # 130 bytes in 65 characters
    ({"seed": 1.5}, "seed"),
    ({"stop": [1.5]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x" * 257]}, "stop"),
    ({"stop": list(range(17))}, "stop"),
    ({"stop": [2 ** 31]}, "stop"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 0.5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": 2 ** 63}, "seed"),
    ({"messages": []}, "prompt"),                   # with tokens too: not exactly one
])
def test_request_schema_refusals_name_the_field(change, field):
    with pytest.raises(ProtocolError) as err:
        validate_request({**GOOD, **change})
    assert err.value.field == field and err.value.code == 400
    # the reason a client reads names the field, the value and the limit
    assert repr(field) in err.value.message
    assert f"limit {err.value.limit!r}" in err.value.message
    assert "value " in err.value.message


def test_names_are_limited_in_utf8_bytes_not_characters():
    assert validate_request({**GOOD, "model": "\U0001F642" * 32, "id": "é" * 64})
    with pytest.raises(ProtocolError) as err:
        validate_request({**GOOD, "model": "\U0001F642" * 33})
    assert (err.value.value, err.value.limit) == (132, 128)
    assert "value 132, limit 128" in err.value.message


@pytest.mark.parametrize("version", [True, 1.0])
def test_version_must_be_the_integer_one(version):
    with pytest.raises(ProtocolError) as err:
        Decoder().feed(msgpack.packb({"v": version, "op": "health", "id": 1}))
    assert err.value.field == "v"


def test_request_schema_accepts_limits_and_rejects_missing():
    assert validate_request({**GOOD, "max_tokens": 4096, "deadline_ms": 600_000,
                             "tokens": [0, 2 ** 31 - 1], "model": "m" * 128,
                             "id": "x" * 128, "seed": None, "stop": [2]})
    missing = dict(GOOD)
    del missing["model"]
    with pytest.raises(ProtocolError, match="missing"):
        validate_request(missing)
    assert validate_request({"v": 1, "op": "health", "id": "x"})["op"] == "health"


def test_an_unknown_field_names_its_own_value():
    with pytest.raises(ProtocolError) as err:
        validate_request({**GOOD, "zzz": 1})
    assert (err.value.field, err.value.value) == ("zzz", 1) and "value 1," in err.value.message


CHAT = {"v": 1, "op": "generate", "id": 8, "model": "m",
        "messages": [{"role": "user", "content": "hi"}]}


def test_sampling_fields_accepted_at_their_limits_and_max_tokens_defaults():
    msg = validate_request({**GOOD, "temperature": 2.0, "top_p": 1.0, "top_k": 0,
                            "seed": 2 ** 63 - 1, "stop": ["x" * 256, 7] + list(range(14))})
    assert msg["temperature"] == 2.0 and len(msg["stop"]) == 16
    assert validate_request({**GOOD, "temperature": 0, "top_p": 1e-9})["top_p"] == 1e-9
    no_max = dict(GOOD)
    del no_max["max_tokens"]
    assert validate_request(no_max)["max_tokens"] == DEFAULT_MAX_TOKENS == 16


@pytest.mark.parametrize("messages,field", [
    ([], "messages"),
    ([{"role": "user"}], "messages[0]"),
    ([{"role": "user", "content": "a", "name": "x"}], "messages[0]"),
    (["hi"], "messages[0]"),
    ([{"role": "", "content": "a"}], "messages[0].role"),
    ([{"role": "r" * 129, "content": "a"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": "a"}] * 257, "messages"),
])
def test_chat_messages_are_checked(messages, field):
    with pytest.raises(ProtocolError) as err:
        validate_request({**CHAT, "messages": messages})
    assert err.value.field == field and err.value.code == 400
    assert validate_request({**CHAT, "messages": [{"role": "user", "content": "a"}] * 256})


def test_exactly_one_of_prompt_tokens_messages():
    with pytest.raises(ProtocolError) as err:
        validate_request({**CHAT, "prompt": "hi"})
    assert err.value.field == "prompt"
    assert validate_request(CHAT)["max_tokens"] == DEFAULT_MAX_TOKENS


def test_a_non_string_map_key_is_a_request_error_not_a_framing_error():
    decoder = Decoder()
    bad = msgpack.packb({"v": 1, "op": "generate", "id": 3, 1: "x"})
    good = pack({"op": "health", "id": 4})
    got = decoder.feed(bad + good)          # both decode: the stream is still sound
    assert [m["id"] for m in got] == [3, 4]
    with pytest.raises(ProtocolError) as err:
        validate_request(got[0])
    assert err.value.code == 400 and "map keys must be strings" in err.value.message
    nested = {**CHAT, "messages": [{"role": "user", "content": "a", 1: "x"}]}
    with pytest.raises(ProtocolError) as err:
        validate_request(decoder.feed(msgpack.packb(nested))[0])
    assert err.value.field == "messages[0]"


def test_a_generate_at_the_frame_limit_that_would_grow_past_it_when_forwarded_is_413():
    # A frame the decoder takes (exactly max_message_bytes, id 0, no max_tokens): forwarded,
    # max_tokens and the link's id make it larger, and the replica's decoder would reset the
    # link.  One byte of content less per turn than needed for that stays accepted.
    from agent.errors import MessageTooLarge
    from agent.protocol import LINK_ID_BYTES, Decoder, pack, validate_request

    def frame(content_chars: int) -> bytes:
        return pack({"op": "generate", "id": 0, "model": "m", "messages": [
            {"role": "user", "content": "a" * content_chars}] * 4})

    n = 262_000
    while len(frame(n + 1)) <= 1 << 20:
        n += 1
    raw = frame(n)
    assert len(raw) <= 1 << 20
    (message,) = Decoder().feed(raw)
    with pytest.raises(MessageTooLarge) as err:
        validate_request(message)
    assert err.value.field == "message" and err.value.code == 413
    small = n - (LINK_ID_BYTES + 16)
    (ok,) = Decoder().feed(frame(small))
    assert validate_request(ok)["max_tokens"] == 16
    assert len(pack(ok)) + LINK_ID_BYTES <= 1 << 20


def test_a_field_of_the_wrong_type_is_named_with_its_value_not_its_type():
    msg = {"v": 1, "op": "generate", "id": 1, "model": "m", "tokens": [1],
           "deadline_ms": "100"}
    with pytest.raises(ProtocolError) as info:
        validate_request(msg)
    assert info.value.field == "deadline_ms" and info.value.value == "100"
    assert "value '100'" in str(info.value) and "wrong type str" in str(info.value)
