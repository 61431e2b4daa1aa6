"""``rewarm model ...`` (import and synthesise models) and ``rewarm build`` / ``rewarm replica``
(the AOT package and the replica process); :func:`register` adds both groups.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agent.argtypes import (device_name, host_port, listen_address, nonneg_float, positive_float,
                            positive_int)


def itl_target_ms(text: str) -> float:
    """``--itl-target-ms``: a finite number of milliseconds >= 0, at most what a load report
    may carry (agent/speed.py ``MAX_PROFILE_S``)."""
    from agent.speed import MAX_PROFILE_S

    value = nonneg_float(text)
    if value > MAX_PROFILE_S * 1000.0:
        raise argparse.ArgumentTypeError(f"{text} is above the limit {MAX_PROFILE_S * 1000.0:g} ms")
    return value


def _import_gguf(args: argparse.Namespace) -> int:
    from agent.replica.gguf_import import import_gguf

    out = import_gguf(Path(args.path), Path(args.out_dir), dtype=args.dtype)
    print(out)
    return 0


def _make_synthetic(args: argparse.Namespace) -> int:
    import math

    from agent.replica.synthetic import hf_expected_shapes, make_synthetic, preset_config

    config = preset_config(args.preset, args.scale, args.dtype)
    params = sum(math.prod(shape) for shape in hf_expected_shapes(config).values())
    size_bytes = params * config.torch_dtype.itemsize
    print(f"writing {args.preset} (scale {args.scale}): {params:,} parameters, "
          f"{size_bytes / 1e6:,.1f} MB {config.dtype} to {args.out_dir}", file=sys.stderr,
          flush=True)
    out = make_synthetic(Path(args.out_dir), args.preset, seed=args.seed, scale=args.scale,
                         dtype=args.dtype)
    print(out)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from agent.replica.config import LlamaConfig
    from agent.replica.engine import Engine
    from agent.replica.tokenizer import load_tokenizer
    from agent.replica.weights import load_hf_weights

    config = LlamaConfig.from_dir(args.model_dir)
    tok = load_tokenizer(args.model_dir)
    ids = tok.encode(args.prompt).ids
    engine = Engine(config, load_hf_weights(args.model_dir), max_seqs=1,
                    max_seq_len=len(ids) + args.max_tokens)
    stop = {config.eos_token_id} if config.eos_token_id is not None else None
    out = engine.generate([ids], args.max_tokens, seed=args.seed, stop=stop)[0]
    print(json.dumps({"prompt": args.prompt, "text": tok.decode(out), "tokens": out}))
    return 0


def _register_model(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="import, synthesise and try models")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")

    p = msub.add_parser("import-gguf", help="convert a llama GGUF file to the Hugging Face layout")
    p.add_argument("path", help="the .gguf file")
    p.add_argument("out_dir", help="directory to write (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="widen every matrix to this dtype (default: keep the GGUF's Q4_0/Q4_1/Q8_0 "
                        "as weight-only int4/int8 with bfloat16 activations)")
    p.set_defaults(func=_import_gguf)

    p = msub.add_parser("make-synthetic", help="write deterministic seeded weights")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "13b-shaped"],
                   help="model shape (agent/replica/synthetic.py)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed")
    p.add_argument("--scale", type=positive_int, default=1,
                   help="13b-shaped: divide hidden/MLP/vocab (1: 11.3 B parameters, 22.7 GB; 5)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights' dtype (default: the preset's own)")
    p.add_argument("out_dir", help="HF-layout directory to write")
    p.set_defaults(func=_make_synthetic)

    p = msub.add_parser("generate", help="eager greedy (or seeded) generation, for a quick check")
    p.add_argument("model_dir", help="HF-layout model directory")
    p.add_argument("prompt", help="text (the model's tokenizer encodes it)")
    p.add_argument("--max-tokens", type=positive_int, default=16, help="tokens to generate")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: greedy)")
    p.set_defaults(func=_generate)


def register(sub: argparse._SubParsersAction) -> None:
    _register_model(sub)
    _register_build_and_replica(sub)


def _build(args: argparse.Namespace) -> int:
    from agent.replica.aot import build

    print(build(Path(args.model_dir), Path(args.out), max_seqs=args.max_seqs,
                max_seq_len=args.max_seq_len, device=args.device))
    return 0


def _replica(args: argparse.Namespace) -> int:
    from agent.replica.worker import run_replica

    return run_replica(args.listen, model_dir=args.model_dir, snapshot=args.snapshot,
                       zygote_mode=args.zygote, release=args.release, compile=args.compile,
                       buffer_bytes=args.buffer_mib << 20, threads=args.threads,
                       replica_id=args.replica_id, tcp_control=args.tcp_control,
                       data_listen=args.data_listen,
                       drain_grace_s=args.drain_grace_s, metrics_listen=args.metrics_listen, warm=args.warm,
                       device=args.device, shared=not args.private_buffer,
                       itl_target_s=None if args.itl_target_ms is None
                       else args.itl_target_ms / 1000.0)


def _register_build_and_replica(sub: argparse._SubParsersAction) -> None:
    from agent.replica import DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQS
    from agent.speed import DEFAULT_ITL_SLO_S

    p = sub.add_parser("build", help="torch.export + AOTInductor: one package for this machine's target")
    p.add_argument("model_dir", help="HF-layout model directory (config.json, *.safetensors)")
    p.add_argument("--out", required=True, help="release directory; the package goes to OUT/<target>/")
    p.add_argument("--max-seqs", type=positive_int, default=DEFAULT_MAX_SEQS, help="KV slots (largest batch)")
    p.add_argument("--max-seq-len", type=positive_int, default=DEFAULT_MAX_SEQ_LEN, help="tokens per KV slot")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.set_defaults(func=_build)

    p = sub.add_parser("replica", help="run one replica (or a zygote) speaking msgpack")
    p.add_argument("--listen", required=True, type=listen_address, help="HOST:PORT (port 0: any free port) or unix:PATH")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--model-dir", help="full boot from HF-layout safetensors")
    mode.add_argument("--snapshot", help="restore a captured snapshot into this fresh process")
    mode.add_argument("--zygote", action="store_true", help="start empty; wait for a restore op")
    p.add_argument("--release", help="release directory of AOT packages (rewarm build --out)")
    p.add_argument("--compile", action="store_true", help="with --model-dir: torch.compile just in time")
    p.add_argument("--buffer-mib", type=positive_int, default=1024, help="zygote restore buffer size")
    p.add_argument("--warm", default=None, metavar="SNAPSHOT",
                   help="with --zygote: the snapshot it will likely restore; its package is bound "
                        "to the buffer and its golden calls run once before the zygote is ready, "
                        "so a restore of it pays no first-call costs (any snapshot still restores)")
    p.add_argument("--private-buffer", action="store_true",
                   help="with --zygote on the CPU: a prefaulted anonymous buffer of --buffer-mib "
                        "(a private copy of the weights) instead of the default, the --warm "
                        "snapshot's page-cache pages shared by every replica of it on the node "
                        "(and no buffer without --warm)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (all cores)")
    p.add_argument("--itl-target-ms", type=itl_target_ms, default=None, metavar="MS",
                   help="inter-token latency each engine step plans for: the prompt tokens a "
                        "step prefills beside the running streams' decode are what fits in it "
                        f"(default {DEFAULT_ITL_SLO_S * 1000:g}, MLPerf's Llama 2 70B TPOT "
                        "limit; 0: each waiting prompt whole, no per-step budget; at most "
                        "3600000, an hour)")
    p.add_argument("--device", type=device_name, default="cpu",
                   help="cpu or cuda[:N]: where the model runs (a zygote there holds a CUDA "
                        "context and a device restore buffer; restores read with kvikio)")
    p.add_argument("--replica-id", default=None, help="the id its answers and stats carry (default: replica)")
    p.add_argument("--data-listen", type=listen_address, default=None, metavar="HOST:PORT",
                   help="a second, TCP listener for generate/health/stats only (a node agent "
                        "gives its host's address so front doors on other hosts reach it)")
    p.add_argument("--tcp-control", action="store_true",
                   help="on a HOST:PORT listener, also accept restore/capture/shutdown (they "
                        "touch this host's files and process; trusted networks only)")
    p.add_argument("--drain-grace-s", type=positive_float, default=30.0,
                   help="at SIGTERM: refuse new requests (503), let those in flight finish "
                        "for at most this long, then exit")
    p.add_argument("--metrics-listen", type=host_port, default=None, metavar="HOST:PORT",
                   help="serve /metrics, /healthz and /readyz here")
    p.set_defaults(func=_replica)
