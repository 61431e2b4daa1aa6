"""How the HTTP entrance writes a generate's answer once it is submitted: whole (one JSON
body) or streamed (SSE), from the :class:`~agent.frontdoor.http_answers.HttpSink` the request
path fills.

Used by :mod:`agent.frontdoor.http_entrance` (its ``/v1/completions`` and
``/v1/chat/completions`` handlers).
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from agent.frontdoor import openai_api as oa
from agent.frontdoor.http_answers import HttpSink, error_response


def refusal_response(final: tuple) -> web.Response:
    """The error answer for a sink's ``("error", code, reason, retry_after_ms, refusal)``."""
    _, code, reason, retry_after_ms, refusal = final
    return error_response(code, reason, None, retry_after_ms, refusal=refusal)


async def whole_answer(parsed: oa.Parsed, rid: str, sink: HttpSink) -> web.Response:
    """Wait for the sink's final answer; the completion as one JSON body, or its refusal."""
    while sink.final is None:
        await sink.wait()
    if sink.final[0] == "error":
        return refusal_response(sink.final)
    done = sink.final[1]
    text = done.get("text", "".join(sink.parts))
    body = oa.answer(parsed, rid, oa.now_s(), text, done)
    if sink.token_ids is not None and "text" not in done:
        # a model without a tokenizer: the ids, as vLLM's return_token_ids gives them
        body["choices"][0]["token_ids"] = sink.token_ids
    return web.Response(body=json.dumps(body).encode(), content_type="application/json",
                        headers={"x-rewarm-path": str(done.get("path", ""))})


async def stream_answer(request: web.Request, parsed: oa.Parsed, rid: str, sink: HttpSink,
                        write_timeout_s: float) -> web.StreamResponse:
    """SSE: the status is chosen when the first token or the refusal arrives (a refusal
    before any token is a plain error answer with its status); after that an error is
    one ``data: {"error": ...}`` event and the stream ends: a half-written stream is
    never retried.  Each write waits at most ``write_timeout_s`` on the client."""
    while sink.final is None and not sink.parts:
        await sink.wait()
    if sink.final is not None and sink.final[0] == "error" and not sink.parts:
        return refusal_response(sink.final)
    created = oa.now_s()
    assert sink.flight is not None, "submitted before the stream starts"
    resp = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
        "x-rewarm-path": sink.flight.path})
    await resp.prepare(request)
    sent, first = [], True
    while True:
        out = []
        if sink.parts:
            parts, sink.parts = sink.parts, []
            so_far = None
            if parsed.continuous_usage:   # one count for the batch written together
                so_far = oa.usage({"prompt_tokens": sink.prompt_tokens,
                                   "n_tokens": sink.n_tokens})
            for piece in parts:
                if piece or first:
                    out.append(oa.chunk(parsed, rid, created, piece, first=first,
                                        usage_=so_far))
                    first = False
                    sent.append(piece)
        final = sink.final
        if final is not None:
            out += _stream_end(parsed, rid, created, final, "".join(sent), first)
        if out:
            await _write(resp, b"".join(out), write_timeout_s)
        if final is not None:
            break
        await sink.wait()
    await resp.write_eof()
    return resp


def _stream_end(parsed: oa.Parsed, rid: str, created: int, final: tuple, streamed: str,
                first: bool) -> list[bytes]:
    if final[0] == "error":
        _, code, reason, retry_after_ms, refusal = final
        event = oa.error_body(code, reason, None, retry_after_ms, refusal=refusal)
        return [b"data: " + json.dumps(event).encode() + b"\n\n"]
    done = final[1]
    text = done.get("text")
    rest = text[len(streamed):] if text and text.startswith(streamed) else ""
    out = [oa.chunk(parsed, rid, created, rest, done.get("finish_reason") or "length",
                    first=first,
                    usage_=oa.usage(done) if parsed.continuous_usage else None)]
    if parsed.include_usage:
        out.append(oa.chunk(parsed, rid, created, None, usage_=oa.usage(done)))
    out.append(oa.DONE_EVENT)
    return out


async def _write(resp: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    """Write, bounding the wait on a client that does not read (slow reader)."""
    async with asyncio.timeout(timeout_s):
        await resp.write(data)
