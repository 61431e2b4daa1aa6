"""``rewarm model ...`` (model engineer) and ``rewarm build`` / ``rewarm replica`` (AOT/worker).

Each group registers itself in :func:`register`; the AOT/worker engineer adds theirs in the
marked place.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _import_gguf(args: argparse.Namespace) -> int:
    from agent.replica.gguf_import import import_gguf

    out = import_gguf(Path(args.path), Path(args.out_dir), dtype=args.dtype)
    print(out)
    return 0


def _make_synthetic(args: argparse.Namespace) -> int:
    from agent.replica.synthetic import make_synthetic

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
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=_import_gguf)

    p = msub.add_parser("make-synthetic", help="write deterministic seeded weights")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "13b-shaped"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=int, default=1, help="13b-shaped: divide hidden/MLP/vocab (1 or 5)")
    p.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    p.add_argument("out_dir")
    p.set_defaults(func=_make_synthetic)

    p = msub.add_parser("generate", help="eager greedy (or seeded) generation, for a quick check")
    p.add_argument("model_dir")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=_generate)


def register(sub: argparse._SubParsersAction) -> None:
    _register_model(sub)
    # --- AOT/worker engineer: register `rewarm build` and `rewarm replica` below -----------
