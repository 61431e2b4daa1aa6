"""The HTTP entrance driven by the official ``openai`` package against stub replicas."""

import asyncio
import json
import pathlib
import sys

import openai
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from http_harness import client, http_door, raw_http, run  # noqa: E402
from text_stub import TextStub  # noqa: E402

from agent.errors import NoCapacity  # noqa: E402
from agent.frontdoor.auth import TokenAuth  # noqa: E402
from agent.frontdoor.capacity import RestoreResult  # noqa: E402
from agent.frontdoor.router import ReplicaLoad  # noqa: E402


class GatedCapacity:
    """A restore that waits for :meth:`release` (or fails), then starts a TextStub."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls, self.stubs = fail, 0, []
        self.gate = asyncio.Event()

    def release(self) -> None:
        self.gate.set()

    async def request_restore(self, model):
        self.calls += 1
        await self.gate.wait()
        if self.fail:
            raise NoCapacity(f"no node can restore {model}", model=model)
        stub = await TextStub(model, f"restored-{self.calls}").start()
        self.stubs.append(stub)
        return RestoreResult(ReplicaLoad.from_instance(stub.instance()), "snapshot_restore", 42.0)


def test_completion_answer_usage_and_path_header():
    async def main():
        async with http_door() as (fd, e, stubs):
            c = client(e)
            raw = await c.completions.with_raw_response.create(
                model="m", prompt="hello there", max_tokens=4, seed=3, temperature=0.5,
                top_p=0.9, extra_body={"top_k": 5})
            r = raw.parse()
            sent = stubs[0].received[-1]
            await c.close()
            return raw.headers, r, sent

    headers, r, sent = run(main())
    assert headers["x-rewarm-path"] == "warm_hit"
    assert r.object == "text_completion" and r.choices[0].text == "w3 w4 w5 w6 "
    assert r.choices[0].finish_reason == "length" and r.id.startswith("cmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (2, 4, 6)
    # what reached the replica: the protocol's generate with every sampling field
    assert (sent["prompt"], sent["max_tokens"], sent["seed"], sent["temperature"],
            sent["top_p"], sent["top_k"]) == ("hello there", 4, 3, 0.5, 0.9, 5)


def test_token_prompts_defaults_and_stop():
    async def main():
        async with http_door() as (fd, e, stubs):
            c = client(e)
            a = await c.completions.create(model="m", prompt=[5, 6, 7], max_tokens=3)
            b = await c.completions.create(model="m", prompt=["one"], stop="w2")
            d = await c.completions.create(model="m", prompt="x", stop=["w1", 2], max_tokens=5)
            received = list(stubs[0].received)
            await c.close()
            return a, b, d, received

    a, b, d, received = run(main())
    assert received[0]["tokens"] == [5, 6, 7] and received[0]["detokenize"] is True
    assert a.usage.prompt_tokens == 3 and a.choices[0].text == "w0 w1 w2 "
    assert received[1]["max_tokens"] == 16 and received[1]["temperature"] == 1.0  # defaults
    assert b.choices[0].text == "w0 w1 " and b.choices[0].finish_reason == "stop"
    assert received[2]["stop"] == ["w1", 2] and d.choices[0].text == "w0 "


def test_chat_answer_and_messages_reach_the_replica():
    async def main():
        async with http_door() as (fd, e, stubs):
            c = client(e)
            r = await c.chat.completions.create(
                model="m", max_completion_tokens=2, seed=1,
                messages=[{"role": "developer", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                       {"type": "text", "text": " there"}]}])
            await c.close()
            return r, stubs[0].received[-1]

    r, sent = run(main())
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == "w1 w2 "
    assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi there"}]
    assert sent["max_tokens"] == 2 and r.usage.completion_tokens == 2


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_text_equals_the_whole_answer_for_the_same_seed(chat):
    async def main():
        async with http_door() as (fd, e, stubs):
            c = client(e)
            kw = dict(model="m", max_tokens=5, seed=11)
            if chat:
                msgs = [{"role": "user", "content": "hi"}]
                whole = await c.chat.completions.create(messages=msgs, **kw)
                stream = await c.chat.completions.create(
                    messages=msgs, stream=True, stream_options={"include_usage": True}, **kw)
            else:
                whole = await c.completions.create(prompt="hi", **kw)
                stream = await c.completions.create(
                    prompt="hi", stream=True, stream_options={"include_usage": True}, **kw)
            chunks = [ch async for ch in stream]
            await c.close()
            return whole, chunks

    whole, chunks = run(main())
    if chat:
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == whole.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == whole.choices[0].text
    assert text == "w11 w12 w13 w14 w15 "
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(ch.usage is None for ch in chunks[:-1])


def test_sse_framing_and_done_event():
    async def main():
        async with http_door() as (fd, e, stubs):
            body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2,
                               "stream": True}).encode()
            return await raw_http(e, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                  b"Content-Type: application/json\r\nConnection: close\r\n"
                                  b"Content-Length: %d\r\n\r\n" % len(body) + body)

    out = run(main())
    head, _, stream = out.partition(b"\r\n\r\n")
    assert b"200 OK" in head and b"text/event-stream" in head and b"x-rewarm-path: warm_hit" in head
    assert b'data: [DONE]\n\n' in stream and b'"usage"' not in stream   # no include_usage


@pytest.mark.parametrize("kwargs,param", [
    ({"n": 2}, "n"),
    ({"logprobs": 1}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"extra_body": {"tools": [{"type": "function"}]}}, "tools"),
    ({"extra_body": {"mystery": 1}}, "mystery"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_unsupported_or_bad_parameters_are_400_naming_them(kwargs, param):
    async def main():
        async with http_door() as (fd, e, stubs):
            c = client(e)
            args = {"model": "m", "prompt": "hi", **kwargs}
            try:
                await c.completions.create(**args)
            except openai.BadRequestError as err:
                return err, len(stubs[0].received)
            finally:
                await c.close()

    err, sent = run(main())
    assert err.status_code == 400 and sent == 0          # never reached a replica
    body = err.response.json()["error"]
    assert body["param"] == param and param in body["message"]
    assert body["type"] == "invalid_request_error"


def test_no_op_values_of_unsupported_parameters_are_accepted():
    async def main():
        async with http_door() as (fd, e, stubs):
            c = client(e)
            r = await c.completions.create(model="m", prompt="hi", max_tokens=1, n=1,
                                           logprobs=None, echo=False, presence_penalty=0,
                                           frequency_penalty=0.0, best_of=1, user="u1")
            await c.close()
            return r

    assert run(main()).choices[0].text == "w0 "


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
])
def test_chat_refusals_name_the_message(messages, param):
    async def main():
        async with http_door() as (fd, e, stubs):
            c = client(e)
            try:
                await c.chat.completions.create(model="m", messages=messages)
            except openai.BadRequestError as err:
                return err
            finally:
                await c.close()

    assert run(main()).response.json()["error"]["param"] == param


def test_error_classes_404_401_503_and_bad_json():
    auth = TokenAuth({"alice": "a" * 16})

    async def main():
        out = {}
        async with http_door(auth=auth) as (fd, e, stubs):
            good, bad = client(e, "a" * 16), client(e, "b" * 16)
            out["ok"] = (await good.completions.create(model="m", prompt="x", max_tokens=1)).usage
            for name, call in (("401", bad.completions.create(model="m", prompt="x")),
                               ("401m", bad.models.list()),
                               ("404", good.completions.create(model="nope", prompt="x"))):
                try:
                    await call
                except openai.APIStatusError as err:
                    out[name] = err
            await good.close(), await bad.close()
            resp = await raw_http(e, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                  b"Authorization: Bearer " + b"a" * 16 + b"\r\n"
                                  b"Content-Length: 5\r\nConnection: close\r\n\r\n{nope")
            out["json"] = resp
            out["route"] = await raw_http(e, b"GET /v2/else HTTP/1.1\r\nHost: x\r\n"
                                          b"Connection: close\r\n\r\n")
        async with http_door(stubs=0) as (fd, e, stubs):   # no replica, no capacity
            c = client(e)
            try:
                await c.completions.create(model="m", prompt="x")
            except openai.InternalServerError as err:
                out["503"] = err
            await c.close()
        return out

    out = run(main())
    assert out["ok"].completion_tokens == 1
    assert isinstance(out["401"], openai.AuthenticationError)
    assert out["401"].response.json()["error"]["code"] == "invalid_api_key"
    assert isinstance(out["401m"], openai.AuthenticationError)
    assert isinstance(out["404"], openai.NotFoundError)
    assert out["404"].response.json()["error"]["code"] == "model_not_found"
    assert "serves 'm'" in out["404"].message and "/v1/models" in out["404"].message
    assert out["503"].status_code == 503 and "no warm replica" in out["503"].message
    assert b"400 Bad Request" in out["json"] and b'"param": "body"' in out["json"]
    assert b"404 Not Found" in out["route"] and b'"error"' in out["route"]


def test_429_has_retry_after_and_a_bad_deadline_header_is_400():
    capacity = GatedCapacity()

    async def main():
        async with http_door(stubs=0, capacity=capacity) as (fd, e, _):
            c = client(e)
            try:   # nothing warm, a restore of unknown time: cannot start within 150 ms
                await c.completions.create(model="m", prompt="y", max_tokens=1,
                                           extra_headers={"x-rewarm-deadline-ms": "150"})
            except openai.RateLimitError as err:
                shed = err
            try:
                await c.completions.create(model="m", prompt="x", max_tokens=1,
                                           extra_headers={"x-rewarm-deadline-ms": "soon"})
            except openai.BadRequestError as err:
                bad_deadline = err
            capacity.release()
            await c.close()
            return shed, bad_deadline

    shed, bad = run(main())
    assert shed.status_code == 429 and "150 ms" in shed.message
    retry_ms = shed.response.json()["retry_after_ms"]
    assert retry_ms > 0 and shed.response.json()["error"]["retry_after_ms"] == retry_ms
    assert int(shed.response.headers["retry-after"]) == max(1, -(-retry_ms // 1000))
    assert shed.response.json()["error"]["type"] == "rate_limit_error"
    assert bad.response.json()["error"]["param"] == "x-rewarm-deadline-ms"


@pytest.mark.parametrize("code,cls,kind", [
    (504, openai.InternalServerError, "timeout"),
    (413, openai.APIStatusError, "request_too_large")])
def test_replica_errors_keep_their_status_and_openai_shape(code, cls, kind):
    async def main():
        async with http_door(fail_with=code) as (fd, e, _):
            c = client(e)
            try:
                await c.completions.create(model="m", prompt="x", max_tokens=1)
            except cls as err:
                return err
            finally:
                await c.close()

    err = run(main())
    assert err.status_code == code and err.response.json()["error"]["code"] == kind
    assert f"stub answers {code}" in err.message


def test_a_replica_503_before_any_token_is_placed_again_then_refused_429():
    # a replica going away (draining) has started nothing: with no other replica and no
    # capacity this request is refused 429 (retry later), never passed on as a loss
    async def main():
        async with http_door(fail_with=503) as (fd, e, _):
            c = client(e)
            try:
                await c.completions.create(model="m", prompt="x", max_tokens=1)
            except openai.RateLimitError as err:
                return err, fd.path.counts["rerouted"]
            finally:
                await c.close()

    err, rerouted = run(main())
    body = err.response.json()
    assert err.status_code == 429 and body["error"]["type"] == "rate_limit_error"
    assert "not started at replica" in err.message and "stub answers 503" in err.message
    assert body["retry_after_ms"] > 0 and rerouted == 1


def test_a_client_disconnect_cancels_at_the_replica():
    async def main():
        async with http_door(hold=True) as (fd, e, stubs):
            body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 50,
                               "stream": True}).encode()
            host, port = e.address
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d"
                         b"\r\n\r\n" % len(body) + body)
            while not stubs[0].held:
                await asyncio.sleep(0.01)
            stubs[0].step()                              # one token: the stream has begun
            head = await asyncio.wait_for(reader.readuntil(b"data: "), 5)
            writer.transport.abort()                     # the client goes away mid-stream
            while not stubs[0].cancelled:
                await asyncio.sleep(0.01)
            rid = stubs[0].received[0]["id"]
            # a non-streamed request whose client leaves before any token
            writer2 = (await asyncio.open_connection(host, port))[1]
            body2 = json.dumps({"model": "m", "prompt": "x", "max_tokens": 50}).encode()
            writer2.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d"
                          b"\r\n\r\n" % len(body2) + body2)
            while len(stubs[0].received) < 3:
                await asyncio.sleep(0.01)
            writer2.transport.abort()
            while len(stubs[0].cancelled) < 2:
                await asyncio.sleep(0.01)
            return (head, rid, list(stubs[0].cancelled), e.counts["cancelled"],
                    fd.path.counts["cancelled"], fd.router.warm("m")[0].active_seqs)

    head, rid, cancelled, http_cancels, path_cancels, active = run(main())
    assert b"200 OK" in head
    assert cancelled[0] == rid and len(cancelled) == 2
    assert http_cancels == 2 and path_cancels == 2 and active == 0   # slots freed


def test_models_list_states_and_health_and_readiness_during_a_restore():
    capacity = GatedCapacity()

    class States:
        def states(self):
            return {"m": "snapshot", "s": "suspended", "c": "cold", "odd": "weird"}

    async def main():
        out = {}
        async with http_door(stubs=0, capacity=capacity, models=States()) as (fd, e, _):
            c = client(e)
            out["models_before"] = {m.id: m.state for m in (await c.models.list()).data}
            out["ready_idle"] = await raw_http(e, b"GET /ready HTTP/1.1\r\nHost: x\r\n"
                                               b"Connection: close\r\n\r\n")
            task = asyncio.create_task(c.completions.create(model="m", prompt="x", max_tokens=2))
            while not capacity.calls:
                await asyncio.sleep(0.01)
            out["ready_restoring"] = await raw_http(e, b"GET /readyz HTTP/1.1\r\nHost: x\r\n"
                                                    b"Connection: close\r\n\r\n")
            capacity.release()
            out["answer"] = await task
            out["models_after"] = {m.id: m.state for m in (await c.models.list()).data}
            out["one"] = await c.models.retrieve("s")
            fd.path.begin_stop()                          # shutting down: not ready, alive
            out["ready_stopping"] = await raw_http(e, b"GET /ready HTTP/1.1\r\nHost: x\r\n"
                                                   b"Connection: close\r\n\r\n")
            out["health"] = await raw_http(e, b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
                                           b"Connection: close\r\n\r\n")
            await c.close()
        async with http_door(stubs=0) as (fd, e, _):      # nothing warm, nothing to restore
            out["ready_never"] = await raw_http(e, b"GET /ready HTTP/1.1\r\nHost: x\r\n"
                                                b"Connection: close\r\n\r\n")
            stub = await TextStub("m", "late").start()
            fd.path.upsert(ReplicaLoad.from_instance(stub.instance()))
            out["ready_warm"] = await raw_http(e, b"GET /ready HTTP/1.1\r\nHost: x\r\n"
                                               b"Connection: close\r\n\r\n")
            await stub.stop()
        return out

    out = run(main())
    assert out["models_before"] == {"m": "snapshot", "s": "suspended", "c": "cold", "odd": "cold"}
    assert b"200 OK" in out["ready_idle"]
    body = json.loads(out["ready_restoring"].partition(b"\r\n\r\n")[2])
    assert b"200 OK" in out["ready_restoring"] and body["restores_in_flight"] == 1
    assert out["answer"].choices[0].text == "w0 w1 "
    assert out["models_after"]["m"] == "warm" and out["one"].state == "suspended"
    assert b"503" in out["ready_stopping"].split(b"\r\n")[0]
    assert b"shutting down" in out["ready_stopping"]
    assert b"200 OK" in out["health"] and b'"ok"' in out["health"]
    assert b"503" in out["ready_never"].split(b"\r\n")[0]
    assert b"200 OK" in out["ready_warm"]
    for stub in capacity.stubs:
        run(stub.stop())


def test_an_error_after_the_stream_began_is_an_event_and_never_retried():
    async def main():
        async with http_door(hold=True) as (fd, e, stubs):
            c = client(e)
            stream = await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(_start(c, stubs))), 10)
            chunks = []
            with pytest.raises(openai.APIError) as err:
                async for ch in stream:
                    chunks.append(ch)
                    fd.path.replica_failed(fd.links["t0"], "replica t0 went away")
            sent = len([m for m in stubs[0].received if m.get("op") != "cancel"])
            await c.close()
            return chunks, err.value, sent

    chunks, err, sent = run(main())
    assert [ch.choices[0].text for ch in chunks] == ["w0 "]
    assert "went away" in str(err) and sent == 1              # not sent again anywhere


async def _start(c, stubs):
    async def stepper():
        while not stubs[0].held:
            await asyncio.sleep(0.01)
        stubs[0].step()
    task = asyncio.ensure_future(stepper())
    stream = await c.completions.create(model="m", prompt="x", max_tokens=9, stream=True)
    await task
    return stream


def test_vllm_extensions_ignore_eos_and_continuous_usage():
    async def main():
        async with http_door() as (fd, e, stubs):
            c = client(e)
            stream = await c.chat.completions.create(
                model="m", max_tokens=3, stream=True, messages=[{"role": "user", "content": "x"}],
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                extra_body={"ignore_eos": True})
            chunks = [ch async for ch in stream]
            await c.close()
            return chunks, stubs[0].received[-1]

    chunks, sent = run(main())
    assert sent["ignore_eos"] is True
    counted = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert counted[-1] == 3 and counted == sorted(counted) and counted[0] >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_answered_requests_leave_no_cycle_for_the_collector():
    """Each request's sink, flight and request are freed by reference counting when its
    handler returns (no garbage for the collector: its pauses were the HTTP door's tail)."""
    import gc

    from agent.frontdoor.http_entrance import HttpSink
    from agent.frontdoor.request import Flight

    async def main():
        async with http_door() as (fd, e, stubs):
            c = client(e)
            await c.completions.create(model="m", prompt="warm up", max_tokens=2)
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for stream in (False, True, False, True):
                    r = await c.completions.create(model="m", prompt="x", max_tokens=3,
                                                   stream=stream)
                    if stream:
                        async for _ in r:
                            pass
                await c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
                refused = await raw_http(e, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                         b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
                gc.collect()
                left = [o for o in gc.garbage if isinstance(o, (HttpSink, Flight))]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
            await c.close()
            return left, e.counts["requests"], refused

    left, requests, refused = run(main())
    assert requests == 7 and b" 400 " in refused.split(b"\r\n")[0]
    assert left == []
