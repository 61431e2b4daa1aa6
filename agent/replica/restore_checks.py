"""What a captured replica snapshot must say before a restore reads a byte of it.

:func:`check_replica_manifest` (a captured replica snapshot, not a weights-only import),
:func:`check_engine_config` (KV-cache sizes within limits) and :func:`check_package_fits` (the
engine fits the AOT package the snapshot names).  Used by the restore and by a zygote's
warm-up (agent/replica/zygote.py, agent/replica/warmup.py), which must refuse the same
snapshots.
"""

from __future__ import annotations

from typing import Any

from agent.replica import aot
from agent.replica.config import LlamaConfig
from agent.snapshot.format import Manifest

MAX_SEQS_LIMIT = 4096
"""Most KV slots a snapshot may ask for (a 13B model holds ~80 sequences per A100:
docs/architecture.md, "Sizing")."""


def check_package_fits(forward: aot.PackagedForward, engine: dict[str, int],
                       recorded: Any, where: Any) -> None:
    """The engine a snapshot describes must be one the package was compiled for: ``max_seqs``
    slots within the batch and cache-batch ranges, slots of exactly the package's T positions,
    and the snapshot's recorded ranges (when it has them) those of the package.  Raises
    TargetMismatch (the restore then serves eager, still golden-checked) naming both."""
    from agent.errors import TargetMismatch

    ranges, spec = forward.ranges, forward.spec
    fits = (ranges["batch"][0] <= 1 and engine["max_seqs"] <= ranges["batch"][1]
            and ranges["cache_batch"][0] <= engine["max_seqs"] <= ranges["cache_batch"][1]
            and engine["max_seq_len"] == spec.max_seq_len)
    if recorded is not None and {k: tuple(v) for k, v in dict(recorded).items()} != ranges:
        fits = False
    if not fits:
        raise TargetMismatch(f"{where}: engine {engine} (ranges {recorded}) does not fit package "
                             f"{forward.path} (ranges {ranges}, T={spec.max_seq_len})",
                             built=ranges, here=engine)


REPLICA_EXTRA_KEYS = ("model_config", "engine")
"""Manifest ``extra`` keys every captured replica snapshot carries (see :func:`capture`)."""


def check_replica_manifest(manifest: Manifest, where: Any) -> dict[str, Any]:
    """Check that ``manifest`` is a captured replica snapshot and return its ``extra``.

    A captured snapshot carries ``model_config``, ``engine`` and a golden check; its
    ``aot_package`` is absent/None or ``{"digest": str, "dir": str, "ranges": ...}`` (the
    package's compiled ranges, :func:`agent.replica.aot_inputs.parse_ranges`); its ``tokenizer_dir`` is
    absent/None or a string.  A weights-only snapshot (``rewarm import``: HF-layout tensors,
    ``extra`` = ``config`` + ``source_files``, no golden check) is not one: nothing proves its
    tokens right, so it must not serve.  Raises SnapshotIncompatible naming the snapshot, the
    missing or malformed keys (``missing``; ``mismatches``: ``{key: (found, expected)}``),
    and when its golden check was recorded by a method this rewarm does not verify
    (agent/replica/golden.py, ``check_method``: a snapshot of an earlier release is recaptured).
    """
    from agent.errors import SnapshotIncompatible

    extra = manifest.extra if isinstance(manifest.extra, dict) else {}
    missing = [k for k in REPLICA_EXTRA_KEYS if extra.get(k) is None]
    if manifest.golden is None:
        missing.append("golden")
    if not missing and manifest.golden is not None:
        from agent.replica.golden import check_method

        check_method(manifest.golden, where)   # a record this rewarm cannot check: recapture
    if missing:
        kind = ("a weights-only snapshot made by `rewarm import`, "
                if "source_files" in extra and "model_config" not in extra else "")
        raise SnapshotIncompatible(
            f"{where}: {kind}not a captured replica snapshot: the manifest lacks "
            f"{', '.join(missing)} (its extra keys: {', '.join(sorted(map(str, extra))) or 'none'}). "
            f"A replica restores only snapshots captured from a warmed replica (the node agent's, "
            f"or the capture op of `rewarm replica --model-dir MODEL_DIR`); to serve these "
            f"weights, boot their checkpoint with `rewarm replica --model-dir MODEL_DIR`",
            path=where, missing=missing, mismatches={k: (None, "present") for k in missing})
    bad: dict[str, tuple[Any, str]] = {}
    if not isinstance(extra["model_config"], dict):
        bad["model_config"] = (type(extra["model_config"]).__name__, "map")
    ref = extra.get("aot_package")
    if ref is not None and not (isinstance(ref, dict) and isinstance(ref.get("digest"), str)
                                and isinstance(ref.get("dir"), str)):
        bad["aot_package"] = (ref, "None or {digest: str, dir: str, ranges: {...}}")
    elif isinstance(ref, dict) and ref.get("ranges") is not None:
        from agent.replica.aot_inputs import parse_ranges

        try:
            parse_ranges(ref["ranges"], where)
        except ValueError:
            bad["aot_package.ranges"] = (ref["ranges"], "{batch|seq|cache_batch: [lo, hi]}")
    tok = extra.get("tokenizer_dir")
    if tok is not None and not isinstance(tok, str):
        bad["tokenizer_dir"] = (tok, "None or str")
    if bad:
        detail = "; ".join(f"{k}={v!r:.80} (expected {want})" for k, (v, want) in bad.items())
        raise SnapshotIncompatible(f"{where}: malformed replica manifest: {detail}",
                                   path=where, missing=[], mismatches=bad)
    return extra


def check_engine_config(engine: Any, config: LlamaConfig, where: Any = None) -> dict[str, int]:
    """Validate a snapshot's engine sizes before they size the KV cache: ``max_seqs`` in
    [1, MAX_SEQS_LIMIT], ``max_seq_len`` in [1, config.max_position_embeddings].
    Raises ConfigError naming the field, the value and the limit."""
    from agent.errors import ConfigError

    if not isinstance(engine, dict):
        raise ConfigError(f"{where}: engine configuration missing", name="engine",
                          value=type(engine).__name__, limit="map")
    limits = {"max_seqs": MAX_SEQS_LIMIT, "max_seq_len": config.max_position_embeddings}
    for name, limit in limits.items():
        value = engine.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
            raise ConfigError(f"{where}: engine {name}={value!r} must be an integer in [1, {limit}]",
                              name=name, value=value, limit=limit)
    return {name: engine[name] for name in limits}
