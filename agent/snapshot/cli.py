"""``rewarm snapshot inspect|verify PATH`` and ``rewarm import HF_DIR SNAPSHOT_DIR``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from agent import logs
from agent.argtypes import positive_int
from agent.errors import RewarmError
from agent.exitcodes import exit_code


def _key(args) -> bytes | None:
    """The node key: --key-file, else $REWARM_NODE_KEY_FILE, else none (digest only)."""
    path = args.key_file or os.environ.get("REWARM_NODE_KEY_FILE")
    return Path(path).read_bytes().strip() if path else None


def _inspect(args) -> int:
    from agent.snapshot.manifest import read_manifest
    m = read_manifest(args.path, _key(args))
    summary = {
        "path": str(args.path), "format_version": m.format_version, "model": vars(m.model),
        "pins": vars(m.pins), "total_bytes": m.total_bytes, "tensors": len(m.tensors),
        "chunks": len(m.chunks), "created_s": m.created_s, "golden": m.golden is not None,
        "extra_keys": sorted(m.extra),
    }
    if args.tensors:
        summary["tensor_table"] = [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in m.tensors]
    print(json.dumps(summary, indent=2, default=str))
    return 0


def _verify(args) -> int:
    from agent.snapshot.manifest import read_manifest
    from agent.snapshot.reader import verify_chunks
    m = read_manifest(args.path, _key(args))
    n = verify_chunks(args.path, m, threads=args.threads)
    print(f"{args.path}: OK, {len(m.chunks)} chunks, {n} bytes verified")
    return 0


def _import(args) -> int:
    from agent.snapshot.safetensors_import import import_hf
    m = import_hf(args.hf_dir, args.snapshot_dir, key=_key(args), name=args.name, version=args.version)
    print(f"{args.snapshot_dir}: {m.model.name} {m.model.version}, {len(m.tensors)} tensors, "
          f"{m.total_bytes} bytes ({m.model.source_digest}); weights only: replicas do not "
          f"restore it (serve with `rewarm replica --model-dir {args.hf_dir}`)")
    return 0


def _guard(func):
    def run(args) -> int:
        try:
            return func(args)
        except RewarmError as exc:
            logs.error(f"{exc}")
            return exit_code(exc)
    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    snap = subparsers.add_parser("snapshot", help="inspect or verify a snapshot directory")
    ssub = snap.add_subparsers(dest="snapshot_command", required=True, metavar="ACTION")
    for name, func, doc in (("inspect", _inspect, "print the manifest"),
                            ("verify", _verify, "read and check every chunk")):
        p = ssub.add_parser(name, help=doc)
        p.add_argument("path", type=Path, help="snapshot directory (holds manifest.json)")
        p.add_argument("--key-file", help="node key; the manifest's HMAC must verify under it")
        if name == "inspect":
            p.add_argument("--tensors", action="store_true", help="include the tensor table")
        else:
            p.add_argument("--threads", type=positive_int, default=2, help="reader threads")
        p.set_defaults(func=_guard(func))
    imp = subparsers.add_parser(
        "import", help="store an HF-layout checkpoint as a weights-only snapshot (not restorable "
                       "by a replica)",
        description="Store config.json + *.safetensors as a weights-only snapshot: HF-layout "
                    "tensors, no golden check, for storage and restore-throughput measurements. "
                    "A replica refuses to restore it; replicas restore snapshots captured from a "
                    "warmed replica (the node agent's). To serve the weights: rewarm replica "
                    "--model-dir HF_DIR.")
    imp.add_argument("hf_dir", type=Path, help="config.json + *.safetensors")
    imp.add_argument("snapshot_dir", type=Path, help="where to write the snapshot")
    imp.add_argument("--name", help="model name in the manifest (default: the directory's)")
    imp.add_argument("--version", help="model version in the manifest")
    imp.add_argument("--key-file", help="node key the manifest's HMAC is signed with")
    imp.set_defaults(func=_guard(_import))
