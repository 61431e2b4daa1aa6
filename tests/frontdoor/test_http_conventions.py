"""The conventions users of OpenAI's and vLLM's servers expect from the HTTP door: the
context in /v1/models and a chat without max_tokens sized to it, the context error in
vLLM's words, token-id prompts to a model without a tokenizer, Allow on 405, an unknown path
answered as such, Expect: 100-continue refused before the upload, CORS only when asked for,
and a refusal's reason readable from the answer."""

import asyncio
import contextlib
import json
import pathlib
import sys

import openai
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from http_harness import client, http_door, raw_http, run  # noqa: E402
from text_stub import TextStub  # noqa: E402

from agent.cluster.base import ServiceInstance  # noqa: E402
from agent.cluster.local import LocalRegistry  # noqa: E402
from agent.frontdoor.http_entrance import (REFUSAL_HEADER, HttpConfig, HttpEntrance,  # noqa: E402
                                           HttpSink)
from agent.frontdoor.server import FrontDoor, FrontDoorConfig  # noqa: E402


@contextlib.asynccontextmanager
async def door_over(stub_or_address, *, http: dict | None = None, meta: dict | None = None):
    """A front door + HTTP entrance over one replica: a started TextStub, or the address
    ``host:port`` of a worker with ``meta`` (its load keys)."""
    registry = LocalRegistry()
    if isinstance(stub_or_address, TextStub):
        registry.register(stub_or_address.instance(), 60)
        model = stub_or_address.model
    else:
        host, port = stub_or_address.rsplit(":", 1)
        model = meta.pop("model")
        registry.register(ServiceInstance("rewarm-replica", "w", host, int(port),
                                          tags=[f"model={model}"], meta=meta), 60)
    fd = FrontDoor(FrontDoorConfig(models={model: 60_000.0}, warm_slo_ms=60_000.0,
                                   restore_slo_ms=60_000.0), registry=registry)
    await fd.start()
    entrance = HttpEntrance(fd.path, HttpConfig(port=0, **(http or {})), clock=fd.clock,
                            auth=fd.auth)
    await entrance.start()
    try:
        yield entrance
    finally:
        entrance.close_listener()
        await fd.stop(grace_s=0.1)
        await entrance.stop()


def _head(raw: bytes) -> tuple[int, dict, bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


# --- the context ------------------------------------------------------------------------

def test_models_give_max_model_len_and_a_chat_without_max_tokens_fills_the_context():
    async def main():
        stub = await TextStub("m", "t", max_seqs=4, kv_capacity_tokens=4 * 300).start()
        try:
            async with door_over(stub) as e:
                c = client(e)
                models = await c.models.list()
                one = await c.models.retrieve("m")
                await c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}])
                await c.chat.completions.create(
                    model="m", max_tokens=7, messages=[{"role": "user", "content": "hi"}])
                await c.completions.create(model="m", prompt="hi")
                await c.close()
                return models, one, stub.received
        finally:
            await stub.stop()

    models, one, received = run(main())
    assert [m.model_extra["max_model_len"] for m in models.data] == [300]
    assert one.model_extra["max_model_len"] == 300
    chat, sized, completion = received
    assert chat["max_tokens"] == 300 and chat["fit_context"] is True
    assert sized["max_tokens"] == 7 and "fit_context" not in sized
    assert completion["max_tokens"] == 16 and "fit_context" not in completion  # OpenAI's


@pytest.fixture(scope="module")
def tokenizerless(tmp_path_factory):
    from agent.replica import zygote
    from agent.replica.synthetic import make_synthetic

    model_dir = make_synthetic(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=3)
    return zygote.boot(model_dir, max_seqs=2, max_seq_len=64)


async def _with_worker(loaded, body):
    from agent.replica.worker import Worker

    worker = Worker(loaded, replica_id="w")
    ready = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(worker.serve("127.0.0.1:0", ready.set_result))
    address = await asyncio.wait_for(ready, 30)
    meta = {"model": loaded.identity.name, "max_seqs": "2", "active_seqs": "0",
            "kv_capacity_tokens": str(2 * 64), "kv_used_tokens": "0"}
    try:
        async with door_over(address, meta=meta) as e:
            return await body(e, loaded.identity.name)
    finally:
        worker.stop()
        await asyncio.wait_for(serving, 30)


def test_a_token_prompt_to_a_model_without_a_tokenizer_is_served_over_http(tokenizerless):
    want = tokenizerless.engine.generate([[5, 6, 7]], 4)[0]

    async def body(e, model):
        c = client(e)
        answer = await c.completions.create(model=model, prompt=[5, 6, 7], max_tokens=4,
                                            temperature=0)
        await c.close()
        return answer

    answer = run(_with_worker(tokenizerless, body))
    choice = answer.choices[0]
    assert choice.text == "" and choice.model_extra["token_ids"] == want
    assert answer.usage.completion_tokens == 4 and answer.usage.prompt_tokens == 3


def test_over_the_context_is_a_400_clients_recognise(tokenizerless):
    async def body(e, model):
        c = client(e)
        try:
            await c.completions.create(model=model, prompt=[5] * 60, max_tokens=5)
        except openai.BadRequestError as err:
            return err
        finally:
            await c.close()

    err = run(_with_worker(tokenizerless, body))
    assert err.status_code == 400 and err.response.headers[REFUSAL_HEADER] == "context_length"
    assert "This model's maximum context length is 64 tokens. However, you requested 65 " \
        "tokens (60 in the messages, 5 in the completion)." in err.message


# --- HTTP ------------------------------------------------------------------------------

def test_405_carries_allow_and_an_unknown_path_is_not_an_unknown_model():
    async def main():
        async with http_door() as (fd, e, stubs):
            get = await raw_http(e, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 b"Connection: close\r\n\r\n")
            path = await raw_http(e, b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
            c = client(e)
            with pytest.raises(openai.NotFoundError) as model:
                await c.completions.create(model="nope", prompt="x")
            await c.close()
            return get, path, model.value

    get, path, model = run(main())
    status, headers, body = _head(get)
    assert status == 405 and headers["allow"] == "POST"
    assert json.loads(body)["error"]["code"] is None
    status, _, body = _head(path)
    err = json.loads(body)["error"]
    assert status == 404 and err["code"] is None
    assert err["message"] == "Invalid URL (POST /v1/embeddings)"
    assert model.response.json()["error"]["code"] == "model_not_found"


def test_expect_100_continue_over_the_body_limit_is_refused_before_the_upload():
    async def main():
        async with http_door(http={"max_body_bytes": 1000}) as (fd, e, stubs):
            host, port = e.address
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n"
                         b"Content-Type: application/json\r\nExpect: 100-continue\r\n\r\n")
            await writer.drain()
            refused = await asyncio.wait_for(reader.read(65536), 5)   # no body sent
            closed = await asyncio.wait_for(reader.read(65536), 5)
            writer.close()
            body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 1}).encode()
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                         b"Expect: 100-continue\r\nConnection: close\r\n\r\n" % len(body))
            await writer.drain()
            go_on = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            writer.write(body)
            served = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            odd = await raw_http(e, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 b"Content-Length: 2\r\nExpect: magic\r\nConnection: close\r\n"
                                 b"\r\n{}")
            return refused, closed, go_on, served, odd

    refused, closed, go_on, served, odd = run(main())
    status, headers, body = _head(refused)
    assert status == 413 and b"100 Continue" not in refused
    assert json.loads(body)["error"]["param"] == "body" and closed == b""
    assert go_on.startswith(b"HTTP/1.1 100 Continue") and _head(served)[0] == 200
    assert _head(odd)[0] == 417


def _preflight(origin: bytes) -> bytes:
    return (b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: " + origin +
            b"\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: "
            b"authorization, content-type\r\nConnection: close\r\n\r\n")


def test_cors_is_off_by_default():
    async def main():
        async with http_door() as (fd, e, stubs):
            pre = await raw_http(e, _preflight(b"http://ui.example"))
            get = await raw_http(e, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nOrigin: "
                                 b"http://ui.example\r\nConnection: close\r\n\r\n")
            return pre, get

    pre, get = run(main())
    assert _head(pre)[0] == 405
    assert "access-control-allow-origin" not in _head(get)[1]


def test_allowed_origins_answer_the_preflight_and_expose_the_refusal_header():
    async def main():
        async with http_door(http={"allowed_origins": ("http://ui.example",)}) as (fd, e, _):
            ok = await raw_http(e, _preflight(b"http://ui.example"))
            other = await raw_http(e, _preflight(b"http://evil.example"))
            get = await raw_http(e, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nOrigin: "
                                 b"http://ui.example\r\nConnection: close\r\n\r\n")
            return ok, other, get

    ok, other, get = run(main())
    status, headers, _ = _head(ok)
    assert status == 200 and headers["access-control-allow-origin"] == "http://ui.example"
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    assert "access-control-allow-origin" not in _head(other)[1]
    status, headers, _ = _head(get)
    assert status == 200 and headers["access-control-allow-origin"] == "http://ui.example"
    assert REFUSAL_HEADER in headers["access-control-expose-headers"].lower()


def test_a_bad_origin_is_a_config_error():
    from agent.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        HttpConfig(allowed_origins=("ui.example/path",))
    assert err.value.name == "allowed_origins" and err.value.value == "ui.example/path"


# --- refusals ---------------------------------------------------------------------------

def test_a_refusal_reason_is_a_header_and_an_error_field():
    sink = HttpSink(stream=False)
    sink.error(429, "model 'm': cannot start within 100 ms", 250, "deadline_unreachable")
    resp = HttpEntrance._refusal(sink.final)
    assert resp.status == 429 and resp.headers[REFUSAL_HEADER] == "deadline_unreachable"
    assert resp.headers["Retry-After"] == "1"
    err = json.loads(resp.text)["error"]
    assert err["refusal"] == "deadline_unreachable" and err["retry_after_ms"] == 250
    sink.error(503, "replica failed")
    resp = HttpEntrance._refusal(sink.final)
    assert REFUSAL_HEADER not in resp.headers and "refusal" not in json.loads(resp.text)["error"]


def test_a_refusal_decided_by_admission_says_why_over_http():
    from test_http_entrance import GatedCapacity

    capacity = GatedCapacity()

    async def main():
        async with http_door(stubs=0, capacity=capacity) as (fd, e, _):
            c = client(e)
            with pytest.raises(openai.RateLimitError) as shed:
                # nothing warm, a restore of unknown time: cannot start within 150 ms
                await c.completions.create(model="m", prompt="y", max_tokens=1,
                                           extra_headers={"x-rewarm-deadline-ms": "150"})
            capacity.release()
            await c.close()
            from prometheus_client import generate_latest
            return shed.value, generate_latest(fd.telemetry.registry).decode()

    shed, metrics = run(main())
    assert shed.response.headers[REFUSAL_HEADER] == "deadline_unreachable"
    assert shed.response.json()["error"]["refusal"] == "deadline_unreachable"
    assert ('rewarm_rejections_total{code="429",model="m",reason="deadline_unreachable"} 1.0'
            in metrics)


def test_a_chat_without_max_tokens_on_a_one_slot_replica_is_served_not_413():
    """With one sequence slot the context is the whole KV cache: a chat without max_tokens
    asks for the context and the replica fits it to what the prompt leaves (fit_context), so
    the front door's KV check must count what can be generated, not the bound, or every such
    chat is refused as too large for a replica that serves it."""
    async def main():
        stub = await TextStub("m", "t", max_seqs=1, kv_capacity_tokens=300).start()
        try:
            async with door_over(stub) as e:
                c = client(e)
                answer = await c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}])
                return answer, stub.received[-1]
        finally:
            await stub.stop()

    answer, sent = run(main())
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert sent["fit_context"] is True and sent["max_tokens"] == 300
