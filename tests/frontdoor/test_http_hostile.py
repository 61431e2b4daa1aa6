"""Hostile request bodies at the HTTP entrance: each is a 400 in OpenAI's error shape naming
the parameter, never aiohttp's plain-text 500."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from http_harness import http_door, raw_http, run  # noqa: E402


def _post(path: bytes, body: bytes) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def _answer(raw: bytes) -> tuple[int, dict | None]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


@pytest.mark.parametrize("path,body,param", [
    # json's C scanner raises RecursionError, not ValueError, past its recursion limit
    (b"/v1/completions", b"[" * 100_000 + b"]" * 100_000, "body"),
    (b"/v1/completions",
     b'{"model": "m", "prompt": "x", "user": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "body"),
    # a list or a map as the role is unhashable: `in frozenset` raised TypeError
    (b"/v1/chat/completions",
     json.dumps({"model": "m", "messages": [{"role": [], "content": "x"}]}).encode(),
     "messages[0].role"),
    (b"/v1/chat/completions",
     json.dumps({"model": "m", "messages": [{"role": {"a": 1}, "content": "x"}]}).encode(),
     "messages[0].role"),
    # valid JSON whose string cannot be UTF-8 encoded for the replica
    (b"/v1/completions", b'{"model": "m", "prompt": "a\\ud800b"}', "body"),
    (b"/v1/completions", b'{"model": "m", "prompt": "x", "stop": "\\udfff"}', "body"),
    (b"/v1/chat/completions",
     b'{"model": "m", "messages": [{"role": "user", "content": "\\uDBFF"}]}', "body"),
])
def test_hostile_bodies_are_400_naming_the_parameter(path, body, param):
    async def main():
        async with http_door() as (fd, e, stubs):
            return await raw_http(e, _post(path, body)), len(stubs[0].received)

    raw, sent = run(main())
    status, answer = _answer(raw)
    assert status == 400, raw[:300]
    assert answer["error"]["param"] == param
    assert answer["error"]["type"] == "invalid_request_error"
    assert sent == 0


def test_a_surrogate_pair_is_one_character_and_accepted():
    async def main():
        async with http_door() as (fd, e, stubs):
            raw = await raw_http(e, _post(b"/v1/completions",
                                          b'{"model": "m", "prompt": "\\ud83d\\ude00", '
                                          b'"max_tokens": 1}'))
            return raw, stubs[0].received

    raw, received = run(main())
    assert _answer(raw)[0] == 200
    assert received[0]["prompt"] == "\U0001F600"


def test_a_wrong_method_is_a_client_error_in_openai_shape():
    async def main():
        async with http_door() as (fd, e, stubs):
            return await raw_http(e, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                  b"Connection: close\r\n\r\n")

    status, answer = _answer(run(main()))
    assert status == 405
    assert answer["error"]["type"] == "invalid_request_error"   # a 4xx is not a server error


@pytest.mark.parametrize("value", [b"1_000", b"\xd9\xa1\xd9\xa2\xd9\xa3", b"0x10", b"1e3e", b"5 5"])
def test_a_deadline_header_that_is_not_a_plain_decimal_number_is_400(value):
    # float() alone takes "1_000" and Arabic-Indic digits as 1000 and 123
    async def main():
        async with http_door() as (fd, e, stubs):
            body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode()
            req = _post(b"/v1/completions", body).replace(
                b"Connection: close\r\n", b"Connection: close\r\nx-rewarm-deadline-ms: " + value
                + b"\r\n")
            return await raw_http(e, req), len(stubs[0].received)

    raw, sent = run(main())
    status, answer = _answer(raw)
    assert status == 400 and answer["error"]["param"] == "x-rewarm-deadline-ms"
    assert sent == 0


@pytest.mark.parametrize("value", [b"2500", b"2500.5", b"1e4", b" 2500 "])
def test_a_plain_decimal_deadline_header_is_taken(value):
    async def main():
        async with http_door() as (fd, e, stubs):
            body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode()
            req = _post(b"/v1/completions", body).replace(
                b"Connection: close\r\n", b"Connection: close\r\nx-rewarm-deadline-ms: " + value
                + b"\r\n")
            return await raw_http(e, req)

    assert _answer(run(main()))[0] == 200


@pytest.mark.parametrize("name", [[1], 5, {"a": 1}])
def test_a_chat_message_name_that_is_not_a_string_is_400(name):
    async def main():
        async with http_door() as (fd, e, stubs):
            body = json.dumps({"model": "m", "messages": [
                {"role": "user", "content": "x", "name": name}]}).encode()
            return await raw_http(e, _post(b"/v1/chat/completions", body))

    status, answer = _answer(run(main()))
    assert status == 400 and answer["error"]["param"] == "messages[0].name"


def test_an_unexpected_error_is_a_500_in_openai_shape_without_its_traceback(monkeypatch):
    from agent.frontdoor import openai_api

    def broken(body, limits):
        raise KeyError("secret-internal-detail")

    monkeypatch.setattr(openai_api, "parse_completion", broken)

    async def main():
        async with http_door() as (fd, e, stubs):
            body = json.dumps({"model": "m", "prompt": "x"}).encode()
            first = await raw_http(e, _post(b"/v1/completions", body))
            models = await raw_http(e, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                    b"Connection: close\r\n\r\n")
            return first, models

    raw, models = run(main())
    status, answer = _answer(raw)
    assert status == 500
    assert answer["error"]["type"] == "server_error" and "KeyError" in answer["error"]["message"]
    assert b"secret-internal-detail" not in raw and b"Traceback" not in raw
    assert _answer(models)[0] == 200     # the entrance keeps serving


@pytest.mark.parametrize("body,param", [
    # within max_body_bytes, past the replica protocol's max_str_bytes (256 KiB) ...
    ({"model": "m", "prompt": "a " * 150_000}, "prompt"),
    ({"model": "m", "messages": [{"role": "user", "content": "a " * 150_000}]},
     "messages[0].content"),
    # ... and past its max_array_len (65,536 items)
    ({"model": "m", "prompt": [1] * 70_000}, "tokens"),
])
def test_a_field_the_replica_protocol_cannot_carry_is_413_and_the_replica_stays(body, param):
    # Forwarded, it was a framing error at the replica: the link was reset (503 for every
    # request on it) and the replica dropped from routing (the next request 503 too).
    async def main():
        async with http_door() as (fd, e, stubs):
            path = b"/v1/chat/completions" if "messages" in body else b"/v1/completions"
            req = _post(path, json.dumps(body).encode()).replace(   # long enough to start
                b"Connection: close\r\n", b"Connection: close\r\nx-rewarm-deadline-ms: 600000\r\n")
            big = await raw_http(e, req, timeout_s=10)
            ok = await raw_http(e, _post(b"/v1/completions", json.dumps(
                {"model": "m", "prompt": "x", "max_tokens": 1}).encode()))
            return big, ok, len(stubs[0].received)

    big, ok, sent = run(main())
    status, answer = _answer(big)
    assert status == 413, big[:300]
    assert answer["error"]["param"] == param
    assert _answer(ok)[0] == 200 and sent == 1



def test_a_body_within_max_body_bytes_whose_frame_the_replica_cannot_take_is_413():
    # Four chat turns of 262,108 bytes each: every string is within max_str_bytes and the
    # JSON body within max_body_bytes (1 MiB), but the packed generate is 23 bytes past
    # max_message_bytes (msgpack's str32 headers and the fields the door adds): forwarded,
    # the replica's decoder would reset the link as in the test above.
    from agent.errors import MessageTooLarge
    from agent.frontdoor import openai_api as oa

    turn = {"role": "user", "content": "a" * 262_108}
    raw = json.dumps({"model": "m", "messages": [turn] * 4}, separators=(",", ":")).encode()
    assert len(raw) <= 1 << 20
    with pytest.raises(MessageTooLarge) as err:
        oa.parse_chat(oa.parse_body(raw))
    assert err.value.field == "message" and err.value.code == 413
    # three such turns pack well within the frame and pass
    assert oa.parse_chat({"model": "m", "messages": [turn] * 3}).message["model"] == "m"
