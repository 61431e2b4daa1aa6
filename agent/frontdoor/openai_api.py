"""OpenAI's completions and chat completions, as JSON in and out (no I/O here).

:func:`parse_completion` and :func:`parse_chat` turn a request body into the protocol's
``generate`` map, checked by the same :func:`agent.protocol.validate_request` as the msgpack
door (one set of limits and reasons), plus what only HTTP has (``stream``,
``stream_options.include_usage``).  The builders give the answer objects, the SSE chunks and
OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``.

Field meanings and shapes follow the OpenAI API reference (platform.openai.com/docs/api-
reference: "Completions", "Chat", "Streaming", "Error codes").  Supported: ``model``,
``prompt`` (one string, or one list of token ids) / ``messages``, ``max_tokens`` and
``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k`` (an extension, as vLLM's),
``seed``, ``stop`` (strings and, as an extension, token ids), ``n`` = 1, ``stream``,
``stream_options`` (``include_usage``; ``continuous_usage_stats``, vLLM's extension: usage
on every chunk), ``ignore_eos`` (vLLM's extension), ``user``.  A parameter outside these is a 400 naming it, unless it has
its no-op value (``null``, ``n: 1``, ``logprobs: false``, penalties 0...): never accepted
and then silently ignored.

A chat without ``max_tokens`` generates up to the context, as OpenAI's and vLLM's do: the
map gets ``max_tokens`` = ``max_new_tokens`` and ``fit_context`` (the replica caps it to what
its context leaves after the prompt; docs/protocol.md); a completion's default stays
OpenAI's 16.  Every parameter, limit and error: docs/http-api.md.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from agent.errors import ProtocolError
from agent.protocol import DEFAULT_LIMITS, PROTOCOL_VERSION, Limits, validate_request

_COMMON = frozenset(("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                     "n", "stream", "stream_options", "user", "ignore_eos"))
COMPLETION_FIELDS = _COMMON | {"prompt"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}

# Parameters rewarm does not implement, accepted only at the value that means "off".
NO_OP_VALUES: dict[str, tuple] = {
    "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "best_of": (1,),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "suffix": ("",), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "parallel_tool_calls": (False, True), "store": (False,),
    "metadata": ({},), "response_format": ({"type": "text"},),
}
CHAT_ROLES = frozenset(("system", "developer", "user", "assistant"))


@dataclass(slots=True)
class Parsed:
    """One OpenAI request, translated: ``message`` is a validated protocol ``generate`` map
    (``id`` 0; sent to the replica as it is); ``chat`` says which answer shape;
    ``detokenize``: a token-id prompt whose answer still needs text (set in the map too)."""

    message: dict
    chat: bool
    stream: bool
    include_usage: bool
    detokenize: bool
    continuous_usage: bool = False
    ignore_eos: bool = False


def _bad(param: str, value: Any, why: str) -> ProtocolError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ProtocolError(f"{param}: {why} (got {shown})", field=param, value=value, limit=why)


def _check_params(body: Any, allowed: frozenset) -> None:
    if type(body) is not dict:
        raise _bad("body", type(body).__name__, "the request body must be a JSON object")
    for key, value in body.items():
        if key in allowed or value is None:
            continue
        if any(value == v and type(value) is type(v) for v in NO_OP_VALUES.get(key, ())):
            continue
        raise _bad(key, value, f"parameter {key!r} is not supported by rewarm"
                   + (" (only its default)" if key in NO_OP_VALUES else ""))
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise _bad("n", n, "only n=1 is supported")


def _common(body: dict, message: dict, max_tokens_keys: tuple[str, ...]) -> None:
    for key in max_tokens_keys:
        if body.get(key) is not None:
            message["max_tokens"] = body[key]
            break
    for key in ("temperature", "top_p", "top_k", "seed"):
        if body.get(key) is not None:
            message[key] = body[key]
    if "temperature" not in message:
        message["temperature"] = 1.0   # OpenAI's default: sampled, not greedy
    stop = body.get("stop")
    if stop is not None:
        message["stop"] = [stop] if type(stop) is str else stop
    options = body.get("stream_options")
    if options is not None and (type(options) is not dict or not set(options) <= {
            "include_usage", "continuous_usage_stats"}):
        raise _bad("stream_options", options,
                   "only include_usage and continuous_usage_stats (booleans) are supported")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if type(ignore_eos) is not bool:
            raise _bad("ignore_eos", ignore_eos, "must be a boolean")
        if ignore_eos:
            message["ignore_eos"] = True
    if options is not None and not body.get("stream"):
        raise _bad("stream_options", options, "only allowed with stream: true")


def _stream(body: dict) -> tuple[bool, bool, bool]:
    stream = body.get("stream") or False
    if type(stream) is not bool:
        raise _bad("stream", stream, "must be a boolean")
    options = body.get("stream_options") or {}
    flags = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = options.get(key) or False
        if type(value) is not bool:
            raise _bad(f"stream_options.{key}", value, "must be a boolean")
        flags.append(value)
    return stream, flags[0], flags[1]


def _validated(message: dict, limits: Limits) -> dict:
    """The protocol's own checks; its field names are OpenAI's parameter names too."""
    return validate_request(message, limits)


def parse_completion(body: Any, limits: Limits = DEFAULT_LIMITS) -> Parsed:
    """``POST /v1/completions``.  Raises ProtocolError (400) naming the parameter."""
    _check_params(body, COMPLETION_FIELDS)
    message: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": "generate", "id": 0,
                               "model": body.get("model")}
    prompt = body.get("prompt")
    if type(prompt) is list and len(prompt) == 1 and type(prompt[0]) in (str, list):
        prompt = prompt[0]                       # a batch of one
    detokenize = False
    if type(prompt) is str:
        message["prompt"] = prompt
    elif type(prompt) is list and prompt and all(type(t) is int for t in prompt):
        message["tokens"] = prompt
        message["detokenize"] = detokenize = True
    else:
        raise _bad("prompt", prompt if type(prompt) is not list else f"list of {len(prompt)}",
                   "one string or one list of token ids (batches of prompts: send one each)")
    _common(body, message, ("max_tokens",))
    stream, usage, continuous = _stream(body)
    message = _validated(message, limits)
    return Parsed(message, False, stream, usage, detokenize, continuous,
                  message.get("ignore_eos", False))


def parse_chat(body: Any, limits: Limits = DEFAULT_LIMITS) -> Parsed:
    """``POST /v1/chat/completions``.  Content given as parts must be text parts (joined).
    Raises ProtocolError (400) naming the parameter."""
    _check_params(body, CHAT_FIELDS)
    messages = body.get("messages")
    if type(messages) is not list or not messages:
        raise _bad("messages", messages, "a non-empty list of {role, content}")
    turns = []
    for i, m in enumerate(messages):
        if type(m) is not dict:
            raise _bad(f"messages[{i}]", m, "each message is an object")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise _bad(f"messages[{i}].{sorted(extra)[0]}", m[sorted(extra)[0]],
                       "not supported by rewarm (tools and function calls are not)")
        if "name" in m and m["name"] is not None and type(m["name"]) is not str:
            raise _bad(f"messages[{i}].name", m["name"], "a string")
        role, content = m.get("role"), m.get("content")
        if type(role) is not str or role not in CHAT_ROLES:   # a list or map is unhashable
            raise _bad(f"messages[{i}].role", role, f"one of {sorted(CHAT_ROLES)}")
        if type(content) is list:
            if not all(type(p) is dict and p.get("type") == "text" and type(p.get("text")) is str
                       for p in content):
                raise _bad(f"messages[{i}].content", content, "only text parts are supported")
            content = "".join(p["text"] for p in content)
        if type(content) is not str:
            raise _bad(f"messages[{i}].content", content, "a string or a list of text parts")
        turns.append({"role": "system" if role == "developer" else role, "content": content})
    message: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": "generate", "id": 0,
                               "model": body.get("model"), "messages": turns}
    _common(body, message, ("max_completion_tokens", "max_tokens"))
    if "max_tokens" not in message:
        # OpenAI's and vLLM's chat generate up to the context: the replica caps this bound
        # to what its context leaves after the prompt (docs/protocol.md, fit_context)
        message["max_tokens"] = limits.max_new_tokens
        message["fit_context"] = True
    stream, usage, continuous = _stream(body)
    message = _validated(message, limits)
    return Parsed(message, True, stream, usage, False, continuous,
                  message.get("ignore_eos", False))


# A \\u escape of a UTF-16 surrogate (D800..DFFF); only then can a decoded string hold one.
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


def parse_body(raw: bytes) -> Any:
    """JSON from the request body; a 400 for bytes that are not UTF-8 JSON, for nesting
    deeper than the parser's recursion allows (``[[[[...`` : RecursionError), and for a lone
    surrogate escape (``"\\ud800"``: valid JSON, but no UTF-8 string can carry it to the
    replica).  A surrogate *pair* decodes to one character and is fine."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad("body", f"{len(raw)} bytes", f"not valid JSON: {exc}") from None
    except RecursionError:
        raise _bad("body", f"{len(raw)} bytes", "JSON nested too deeply") from None
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise _bad("body", f"{len(raw)} bytes",
                       "a \\u escape of a lone UTF-16 surrogate is not text") from None
    return body


# --- answers ---------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(done: dict) -> dict:
    prompt, completion = int(done.get("prompt_tokens", 0)), int(done.get("n_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def answer(parsed: Parsed, rid: str, created: int, text: str, done: dict) -> dict:
    """The non-streamed answer object (``text_completion`` or ``chat.completion``)."""
    finish = done.get("finish_reason") or "length"
    if parsed.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if parsed.chat else "text_completion",
            "created": created, "model": parsed.message["model"], "choices": [choice],
            "usage": usage(done)}


def chunk(parsed: Parsed, rid: str, created: int, text: str | None,
          finish: str | None = None, *, first: bool = False, usage_: dict | None = None) -> bytes:
    """One SSE event: ``data: {chunk}\\n\\n``.  ``text`` None with ``usage_``: the usage chunk
    (``choices: []``); with ``include_usage`` every other chunk carries ``usage: null``, or,
    with ``continuous_usage_stats``, the usage so far (``usage_``)."""
    if parsed.chat:
        obj = "chat.completion.chunk"
        if usage_ is not None and text is None:
            choices = []
        else:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    else:
        obj = "text_completion"
        choices = [] if usage_ is not None and text is None else [
            {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                           "model": parsed.message["model"], "choices": choices}
    if parsed.include_usage or parsed.continuous_usage:
        out["usage"] = usage_
    return b"data: " + json.dumps(out, separators=(",", ":")).encode() + b"\n\n"


DONE_EVENT = b"data: [DONE]\n\n"

# HTTP status -> OpenAI error ``type`` and ``code`` (the API reference's error codes table).
_ERROR_KIND = {400: ("invalid_request_error", None), 401: ("invalid_request_error", "invalid_api_key"),
               404: ("invalid_request_error", "model_not_found"),
               408: ("invalid_request_error", "request_timeout"),
               413: ("invalid_request_error", "request_too_large"),
               429: ("rate_limit_error", "rate_limit_exceeded"),
               503: ("server_error", "service_unavailable"), 504: ("server_error", "timeout")}


_NO_CODE = object()


def error_body(status: int, message: str, param: str | None = None,
               retry_after_ms: int | None = None, *, refusal: str | None = None,
               code: Any = _NO_CODE) -> dict:
    """OpenAI's error shape; rewarm adds ``retry_after_ms`` beside it on 429 and 503, and
    ``refusal`` (why a request was refused: ``deadline_unreachable``, ``no_capacity``,
    ``overloaded``..., docs/http-api.md) when the refusal says.  ``code`` overrides the
    status's code (None: an unknown path is no ``model_not_found``)."""
    kind, default_code = _ERROR_KIND.get(status, (
        "invalid_request_error" if status < 500 else "server_error", None))
    err: dict[str, Any] = {"message": message, "type": kind, "param": param,
                           "code": default_code if code is _NO_CODE else code}
    body: dict[str, Any] = {"error": err}
    if refusal is not None:
        err["refusal"] = refusal
    if retry_after_ms is not None:
        err["retry_after_ms"] = int(retry_after_ms)
        body["retry_after_ms"] = int(retry_after_ms)
    return body


def now_s() -> int:
    """``created``: Unix seconds (wall clock, as OpenAI's answers carry)."""
    return int(time.time())
