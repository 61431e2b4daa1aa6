"""``rewarm frontdoor`` (serve) and ``rewarm generate --model M "prompt"`` (client)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import sys

from agent import logs
from agent.argtypes import deadline_factor, host_port, port, positive_float, positive_int
from agent.cluster import (ClusterChoice, add_flags, catalog_watcher, choice_from_args, choose,
                           consul_client)
from agent.cluster.base import Registry
from agent.errors import ConfigError, RewarmError, Unreachable
from agent.slo import DEADLINE_FACTOR


def register(subparsers) -> None:
    p = subparsers.add_parser("frontdoor", help="serve the front door (msgpack/TCP and OpenAI-compatible HTTP)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address both entrances listen on (beyond loopback needs --tokens or "
                        "--allow-open)")
    p.add_argument("--port", type=port, default=7400,
                   help="msgpack/TCP door port (default %(default)s; 0: any free)")
    p.add_argument("--model", action="append", default=[], metavar="NAME[=DEADLINE_MS]",
                   help="a model to accept, optionally with its default deadline (ms, default "
                        "30000): the cap on a deadline derived from the SLO, and the longest a "
                        "request without a deadline of its own waits for a start of the model")
    p.add_argument("--tokens", help="file of tenant:token lines (enables auth)")
    p.add_argument("--allow-open", action="store_true",
                   help="listen beyond loopback without tokens")
    p.add_argument("--events", help="append cold-start events (JSON lines) here")
    p.add_argument("--metrics-port", type=port, help="serve Prometheus /metrics on this port")
    # --registry, --consul, --scaler, --node-agent, --max-replicas (agent/cluster/__init__.py)
    add_flags(p, max_replicas=True)
    p.add_argument("--replica", action="append", default=[], metavar="MODEL@HOST:PORT",
                   help="a static replica (local registry; 64 seqs, 1 Mi KV tokens assumed)")
    p.add_argument("--max-queue-depth", type=positive_int, default=1024,
                   help="requests queued per model beyond which new ones get 429 queue_full "
                        "(default %(default)s)")
    p.add_argument("--max-wait-s", type=positive_float, default=60.0,
                   help="longest a request may wait for capacity, whatever its deadline (s; "
                        "default %(default)g)")
    p.add_argument("--max-connections", type=positive_int, default=4096,
                   help="open msgpack connections beyond which new ones get 429 (default "
                        "%(default)s)")
    p.add_argument("--http-port", type=port, default=None,
                   help="OpenAI-compatible HTTP entrance port (default $REWARM_HTTP_PORT or "
                        "8000; 0: any free port)")
    p.add_argument("--no-http", action="store_true", help="serve the msgpack door only")
    p.add_argument("--allowed-origins", default="", metavar="ORIGIN[,ORIGIN...]",
                   help="browser origins allowed to call the HTTP entrance (CORS), e.g. "
                        "http://localhost:3000, or '*'; default none (no CORS headers)")
    p.add_argument("--warm-slo-ms", type=positive_float, default=2000.0,
                   help="TTFT SLO of a warm hit, from arrival, beyond the prompt's own prefill "
                        "(p99, ms; default %(default)g; docs/architecture.md, Admission)")
    p.add_argument("--restore-slo-ms", type=positive_float, default=4000.0,
                   help="TTFT SLO of a request that waits for a restore, beyond the prompt's "
                        "own prefill (p99, ms; default %(default)g)")
    p.add_argument("--slo", action="append", default=[], metavar="MODEL=WARM_MS,RESTORE_MS",
                   help="one model's SLOs (repeatable)")
    p.add_argument("--deadline-factor", type=deadline_factor, default=DEADLINE_FACTOR,
                   metavar="F", help="a request without a deadline of its own must get its "
                   "first token within F times its path's SLO, at most the model's default "
                   "deadline, else it is refused at once (>= 1; default %(default)g: the "
                   "deadline is the SLO). One that finds nothing of its model warm is held "
                   "for the start under way and served when it comes up, within the "
                   "model's default deadline")
    p.add_argument("--drain-grace-s", type=positive_float, default=30.0,
                   help="on SIGTERM, streams in flight finish within this; new requests get "
                        "503 + retry_after_ms meanwhile (s, default %(default)g; match systemd "
                        "TimeoutStopSec, Nomad kill_timeout)")
    p.set_defaults(func=_serve)

    g = subparsers.add_parser("generate", help="send one prompt to a front door")
    g.add_argument("prompt", nargs="?", help="text (the model's tokenizer encodes it)")
    g.add_argument("--tokens", type=token_ids, metavar="ID,ID,...",
                   help="token ids instead of text (models without a tokenizer)")
    g.add_argument("--model", required=True, help="model name the front door accepts")
    g.add_argument("--address", type=host_port, default="127.0.0.1:7400", metavar="HOST:PORT",
                   help="the front door's msgpack door (default %(default)s, rewarm up's)")
    g.add_argument("--consul", type=host_port, metavar="HOST:PORT", help="discover a front door in Consul")
    g.add_argument("--token", help="tenant token (front doors started with --tokens)")
    g.add_argument("--max-tokens", type=max_tokens, default=32,
                   help="tokens to generate (default %(default)s)")
    g.add_argument("--seed", type=seed, help="sampling seed (default: greedy)")
    g.add_argument("--deadline-ms", type=positive_float,
                   help="first token within this (ms), else 429 at once (default: the front "
                        "door's, the path's TTFT SLO)")
    g.set_defaults(func=_generate)


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def _registry(choice: ClusterChoice, static_replicas: list[str]) -> Registry:
    """The chosen registry; a local one holds the ``--replica MODEL@HOST:PORT`` entries."""
    registry = choose("registry", choice)
    if choice.registry == "local":
        from agent.cluster.base import ServiceInstance
        for n, spec in enumerate(static_replicas):
            model, _, address = spec.partition("@")
            host, port = _hostport(address)
            registry.register(ServiceInstance(
                "rewarm-replica", f"static-{n}", host, port, tags=[f"model={model}"],
                meta={"max_seqs": "64", "active_seqs": "0", "kv_capacity_tokens": str(1 << 20),
                      "kv_used_tokens": "0"}), ttl_s=float("inf"))
    return registry


def _serve(args) -> int:
    from agent.frontdoor.auth import TokenAuth, check_bind
    from agent.frontdoor.capacity import (CapacityRequester, NodeAgentCapacity,
                                          nodes_from_registry)
    from agent.frontdoor.server import FrontDoor, FrontDoorConfig
    from agent import sdnotify
    from agent.telemetry import Telemetry

    models = {}
    for spec in args.model:
        name, _, deadline = spec.partition("=")
        try:
            models[name] = positive_float(deadline) if deadline else 30_000.0
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"--model {spec!r}: deadline {exc}", name="--model", value=spec,
                              limit="NAME or NAME=DEADLINE_MS with DEADLINE_MS > 0") from None
        if not name:
            raise ConfigError(f"--model {spec!r}: no model name", name="--model", value=spec,
                              limit="NAME or NAME=DEADLINE_MS")
    auth = TokenAuth.from_file(args.tokens) if args.tokens else TokenAuth()
    check_bind(args.host, auth, args.allow_open)
    telemetry = Telemetry(args.events)
    if args.metrics_port:
        telemetry.serve_http(args.metrics_port, args.host)
    choice = choice_from_args(args)
    registry = _registry(choice, args.replica)
    nodes = [_hostport(a) for a in choice.node_agents]
    holder: list = []   # the FrontDoor, once built (the scaler's capacity reads its view)
    capacity: CapacityRequester
    if choice.scaler == "nomad":
        from agent.frontdoor.capacity import ScalerCapacity
        capacity = ScalerCapacity(choose("scaler", choice),
                                  lambda m: len(holder[0].router.warm(m)) if holder else 0,
                                  timeout_s=300.0)
    else:
        # The local scaler's own request, made by the front door: a node agent's restore op
        # (static node agents when given, else every passing rewarm-agent in the registry).
        capacity = NodeAgentCapacity((lambda model: list(nodes)) if nodes
                                     else nodes_from_registry(registry))
    # Consul: a client each for the announcers and the catalog watch (one call at a time per
    # client).
    consul = choice.registry == "consul"
    announcer = None
    if consul:
        from agent.frontdoor.announce import ConsulTcpAnnouncer
        announcer = ConsulTcpAnnouncer(consul_client(choice))
    if not args.no_http:
        from agent.frontdoor.http_conn import http_port_from_env
        http_port = args.http_port if args.http_port is not None else http_port_from_env()
    config = FrontDoorConfig(host=args.host, port=args.port, models=models,
                             max_queue_depth=args.max_queue_depth, max_wait_s=args.max_wait_s,
                             max_connections=args.max_connections,
                             drain_grace_s=args.drain_grace_s, warm_slo_ms=args.warm_slo_ms,
                             restore_slo_ms=args.restore_slo_ms, slos=_slos(args.slo),
                             deadline_factor=args.deadline_factor)

    async def run() -> None:
        # Handlers first: the door listens (and is announced) from fd.start() on, and a
        # SIGTERM before them killed it outright, unflushed and still registered.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        fd = FrontDoor(config, registry=registry, capacity=capacity,
                       telemetry=telemetry, auth=auth, announcer=announcer)
        holder.append(fd)
        catalog = None
        # models and their policies from the catalog in Consul KV (None: local registry)
        catalog = catalog_watcher(choice, _learn_models(fd, asyncio.get_running_loop()))
        host, port = await fd.start()
        http = None
        if not args.no_http:
            from agent.frontdoor.http_entrance import HttpConfig, start_http
            http_announcer = None
            if consul:
                from agent.frontdoor.announce import ConsulHttpAnnouncer
                http_announcer = ConsulHttpAnnouncer(consul_client(choice))
            try:
                origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
                http = await start_http(fd, HttpConfig(host=args.host, port=http_port,
                                                       max_connections=args.max_connections,
                                                       allowed_origins=origins),
                                        announcer=http_announcer)
            except BaseException:
                await fd.stop()
                raise
        gc.freeze()  # start-up objects leave the collector's generations: shorter GC pauses
        logs.say(f"front door listening on {host}:{port}", address=f"{host}:{port}")
        if http is not None:
            logs.say(f"OpenAI-compatible HTTP entrance on {http.url}/v1", address=http.url)
        sdnotify.ready(f"listening on {host}:{port}")
        try:
            await stop.wait()
        finally:
            if catalog is not None:
                catalog.stop()
            if http is not None:
                from agent.frontdoor.http_entrance import stop_http
                await stop_http(fd, http)
            else:
                await fd.stop()

    try:
        import uvloop  # a dependency on every platform it builds for (pyproject.toml)
        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    finally:
        telemetry.close()
    return 0


def _learn_models(fd, loop):
    """``on_change`` for the catalog watcher: add each catalog model to the front door's
    known models (with its ``deadline_ms`` when the catalog sets one and ``--model`` did
    not), on the event loop's thread."""
    def apply(models: dict) -> None:
        for name, policy in models.items():
            fd.known_models.add(name)
            deadlines = getattr(fd, "_deadline_ms", None)
            if deadlines is not None and "deadline_ms" in policy and name not in fd.config.models:
                deadlines[name] = policy["deadline_ms"]

    def on_change(models: dict) -> None:
        try:
            loop.call_soon_threadsafe(apply, models)
        except RuntimeError:   # the loop is closed
            pass
    return on_change


def _slos(specs: list[str]) -> dict[str, tuple[float, float]]:
    """``--slo MODEL=WARM_MS,RESTORE_MS`` flags; ConfigError naming the flag otherwise."""
    out = {}
    for spec in specs:
        model, _, pair = spec.partition("=")
        try:
            warm, restore = (positive_float(v) for v in pair.split(","))
        except (ValueError, argparse.ArgumentTypeError):
            raise ConfigError(f"--slo {spec!r}: want MODEL=WARM_MS,RESTORE_MS with both > 0",
                              name="--slo", value=spec, limit="MODEL=WARM_MS,RESTORE_MS") from None
        if not model:
            raise ConfigError(f"--slo {spec!r}: no model name", name="--slo", value=spec,
                              limit="MODEL=WARM_MS,RESTORE_MS")
        out[model] = (warm, restore)
    return out


class TextStream:
    """Writes a generation to ``out`` as it streams, adding no characters of its own.

    A ``tokens`` message's ``text`` is that chunk decoded on its own, so chunks simply
    concatenate (byte-level BPE keeps each token's leading space).  A character whose UTF-8
    bytes span tokens decodes as U+FFFD in each part; text from the first U+FFFD on is held
    back and the ``done`` message's ``text`` (the whole generation decoded at once) supplies
    the rest.  Without text (a token-id prompt, a model with no tokenizer) the ids are written
    separated by spaces.
    """

    def __init__(self, out) -> None:
        self.out = out
        self.written = ""     # text written so far (a prefix of the final text)
        self.received = ""    # every chunk's text, concatenated
        self._ids = False     # ids written (no text in the stream)

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()

    def tokens(self, msg: dict) -> None:
        if "text" not in msg:
            self._write((" " if self._ids else "") + " ".join(map(str, msg["tokens"])))
            self._ids = True
            return
        self.received += msg["text"]
        safe = self.received.split("\ufffd", 1)[0]
        if len(safe) > len(self.written):
            self._write(safe[len(self.written):])
            self.written = safe

    def done(self, msg: dict) -> None:
        final = msg.get("text")
        if final is None or not final.startswith(self.written):
            final = self.received
        self._write(final[len(self.written):])
        self.written = final


TOKEN_ID_MAX = (1 << 31) - 1       # the protocol's limit (agent/protocol.py)


def max_tokens(text: str) -> int:
    """``--max-tokens``: 1..2**31-1 here; the front door applies its own, smaller limit."""
    value = positive_int(text)
    if value > TOKEN_ID_MAX:
        raise argparse.ArgumentTypeError(f"{value} is above the limit {TOKEN_ID_MAX}")
    return value


def token_ids(text: str) -> list[int]:
    """``--tokens``: comma-separated token ids (ints >= 0)."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated token ids") from None
    if not ids:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more token ids")
    for t in ids:
        if not 0 <= t <= TOKEN_ID_MAX:
            raise argparse.ArgumentTypeError(f"token id {t} is outside 0..{TOKEN_ID_MAX}")
    return ids


def seed(text: str) -> int:
    """``--seed``: a signed 64-bit integer (what the wire carries)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not -(1 << 63) <= value < (1 << 63):
        raise argparse.ArgumentTypeError(f"seed {value} is outside the signed 64-bit range")
    return value


def _generate(args) -> int:
    from agent.client import Client, discover
    from agent.exitcodes import EX_UNAVAILABLE, exit_code

    if (args.prompt is None) == (args.tokens is None):
        logs.error("give a prompt or --tokens ID,ID,... (exactly one)")
        return 2

    if args.consul:
        host, port = _hostport(args.consul)
        found = discover(consul_host=host, consul_port=port)
        if not found:
            logs.error("no healthy rewarm-frontdoor in Consul")
            return EX_UNAVAILABLE
        address = found[0]
    else:
        address = _hostport(args.address)
    try:
        client = Client(*address, token=args.token)
    except Unreachable as err:
        logs.error(f"{err} (is `rewarm up` or `rewarm frontdoor` running there? pass "
                   "--address or --consul)")
        return exit_code(err)
    try:
        done = {}
        out = TextStream(sys.stdout)
        for msg in client.stream(args.model, args.prompt, tokens=args.tokens,
                                 max_tokens=args.max_tokens, seed=args.seed,
                                 deadline_ms=args.deadline_ms):
            if msg["type"] == "tokens":
                out.tokens(msg)
            else:
                done = msg
        out.done(done)
        print()
        print(f"[ttft {done.get('ttft_ms', 0):.1f} ms, total {done.get('total_ms', 0):.1f} ms, "
              f"path {done.get('path')}, replica {done.get('replica')}]", file=sys.stderr)
        return 0
    except RewarmError as err:
        logs.error(f"{err}")
        return exit_code(err)
    finally:
        client.close()
