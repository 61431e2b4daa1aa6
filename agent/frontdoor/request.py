"""What an entrance hands the request path: a validated request, the sink its answers go
to, and the handle (:class:`Flight`) it may cancel (docs/architecture.md, "Cancellation").

Both entrances (msgpack/TCP, HTTP) build a :class:`GenerateRequest` from their own wire form
and give :meth:`agent.frontdoor.request_path.RequestPath.submit` a :class:`Sink` that turns
the answers back into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agent.protocol import PROTOCOL_VERSION

if TYPE_CHECKING:  # pragma: no cover
    from agent.frontdoor.admission import Pending

# Sampling fields a request may carry, forwarded to the replica when set (docs/architecture.md,
# "Sampling fields").
SAMPLING_FIELDS = ("seed", "stop", "temperature", "top_p", "top_k")


@dataclass(slots=True)
class GenerateRequest:
    """One validated ``generate`` request, whichever entrance it came through.

    ``request_id``: the client's id (telemetry, logs); ``tokens`` ([int], the prompt's token
    ids) or ``prompt`` (text; the replica tokenizes it), exactly one; ``max_tokens``: tokens
    to generate (>= 1); ``deadline_ms``: the client's TTFT deadline counted from arrival, or
    None for the model's default; ``tenant``: who sent it (None without auth).  Sampling
    fields (None: the replica's default) are forwarded as they are.
    """

    request_id: Any
    model: str
    tokens: list[int] | None
    prompt: str | None
    max_tokens: int
    deadline_ms: float | None = None
    tenant: str | None = None
    seed: int | None = None
    stop: list | None = None          # token ids (and, where the replica supports it, strings)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    wire: dict | None = None          # the entrance's validated msgpack map, reused as is

    @classmethod
    def from_message(cls, message: dict, tenant: str | None = None) -> GenerateRequest:
        """From a ``generate`` map already checked by :func:`agent.protocol.validate_request`."""
        get = message.get
        return cls(message["id"], message["model"], get("tokens"), get("prompt"),
                   message["max_tokens"], get("deadline_ms"), tenant, get("seed"), get("stop"),
                   get("temperature"), get("top_p"), get("top_k"), message)

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens: exact for ``tokens``; for text ~3 characters per BPE token
        (an overestimate for English with a byte-level BPE vocabulary)."""
        if self.tokens is not None:
            return len(self.tokens)
        messages = self.wire.get("messages") if self.wire is not None else None
        if messages is not None:  # chat: the template adds a few tokens per turn
            return sum(len(m["content"]) // 3 + 8 for m in messages) + 8
        return len(self.prompt or "") // 3 + 1

    def replica_message(self) -> dict:
        """The ``generate`` map sent to a replica (its ``id`` is set by the link): the
        entrance's own map when it gave one (``wire``: already in the protocol's form; the
        front door's own fields ``token`` and ``deadline_ms`` are taken out), else built
        from the fields."""
        wire = self.wire
        if wire is not None:
            wire.pop("token", None)
            wire.pop("deadline_ms", None)
            return wire
        msg = {"v": PROTOCOL_VERSION, "op": "generate", "model": self.model,
               "max_tokens": self.max_tokens}
        if self.tokens is not None:
            msg["tokens"] = self.tokens
        else:
            msg["prompt"] = self.prompt
        if self.seed is not None:
            msg["seed"] = self.seed
        if self.stop is not None:
            msg["stop"] = self.stop
        if self.temperature is not None:
            msg["temperature"] = self.temperature
        if self.top_p is not None:
            msg["top_p"] = self.top_p
        if self.top_k is not None:
            msg["top_k"] = self.top_k
        return msg


class Sink(Protocol):
    """Where one request's answers go (an entrance's adapter).  Exactly one of :meth:`done`
    or :meth:`error` is called, last; none after the request was cancelled."""

    def tokens(self, message: dict) -> None:
        """A chunk: ``{"type": "tokens", "tokens": [int], "text"?: str}`` (its ``id`` is the
        replica link's own: the sink puts its client's id in)."""
        ...

    def done(self, message: dict) -> None:
        """The end: ``{"type": "done", "n_tokens", "text"?, "ttft_ms", "total_ms", "path",
        "replica", "queue_wait_ms"}`` (times measured here, from arrival)."""
        ...

    def error(self, code: int, reason: str, retry_after_ms: int | None = None,
              refusal: str | None = None) -> None:
        """A refusal or failure: HTTP-like ``code`` (400..504), ``reason`` naming the value
        and the limit, ``retry_after_ms`` with 429 and 503, ``refusal``: why, as data (one of
        agent/wire/refusals.py's codes; None for a failure that is no refusal)."""
        ...


class Canceller(Protocol):
    def cancel(self, flight: Flight) -> None:
        """Forget ``flight``: its client is gone."""
        ...


class Flight:
    """One request inside the front door, from submit to its final answer (or cancel)."""

    __slots__ = ("sent_s", "sent_predicted_s", "sent_slowdown",
                 "owner", "req", "sink", "model", "arrival_s", "deadline_s", "need_tokens",
                 "prompt_tokens", "path", "restore_ms", "queue_wait_ms", "replica_id",
                 "replica_rid", "ttft_s", "pending", "over", "predicted_ttft_s", "tried",
                 "warm_deadline_s", "cold", "last_token_s", "token_gaps", "slo_s",
                 "silent_moved")

    def __init__(self, owner: Canceller, req: GenerateRequest, sink: Sink,
                 arrival_s: float) -> None:
        self.owner, self.req, self.sink, self.model = owner, req, sink, req.model
        self.arrival_s = arrival_s
        self.deadline_s = arrival_s       # its first token's deadline (restore path once held)
        self.warm_deadline_s = arrival_s  # the deadline when served by a replica warm before it
        self.slo_s = arrival_s            # its first token's SLO (base + prefill; agent/slo.py)
        self.need_tokens = 0
        self.prompt_tokens = 0
        self.predicted_ttft_s: float | None = None  # from arrival, when it was last placed
        self.tried: set[str] | None = None          # replicas that refused it (429)
        self.path = "warm_hit"
        self.restore_ms: float | None = None
        self.queue_wait_ms = 0.0
        self.sent_s = 0.0                 # when it was last sent to a replica
        self.sent_predicted_s = 0.0       # the router's TTFT for it then, from then
        self.sent_slowdown = 1.0          # the replica's measured slowdown in that prediction
        self.replica_id = ""
        self.replica_rid = 0
        self.ttft_s: float | None = None
        self.pending: Pending | None = None
        self.over = False  # answered (done/error) or cancelled
        self.cold = False  # no warm replica of its model when it arrived
        self.silent_moved = False  # placed again once after a replica gave no first token
        self.last_token_s = 0.0  # when its latest tokens message arrived
        # (seconds since the previous tokens message, tokens in it), for inter-token latency
        self.token_gaps: list[tuple[float, int]] = []

    def cancel(self) -> None:
        """The client went away: forget this request (no answer is sent)."""
        self.owner.cancel(self)
