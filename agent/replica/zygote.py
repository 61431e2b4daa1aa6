"""The ways a replica comes to hold a model: full boot, snapshot restore, restore into a zygote.

A **zygote** is a worker started ahead of need (architecture, "Tiers of warmth"): Python and
torch imported, intra-op threads set, a page-aligned restore buffer allocated
(:class:`~agent.snapshot.reader.HostBuffer`; a :class:`~agent.snapshot.gpu.DeviceBuffer` on a
GPU), its first-call costs paid (agent/replica/warmup.py: for the snapshot it will likely
restore, else for its device), no model.  Restoring a snapshot into it (:func:`restore`) turns
it into a replica, the fast path.

``boot`` reads HF-layout safetensors (agent/replica/weights.py), binds an AOT package when a
release is given (else eager, or ``torch.compile`` just in time), and records the golden check
(fixed prompts, fixed seed).  ``restore`` reads a snapshot (pins and checksums verified by
agent/snapshot), binds the AOT package the snapshot names by digest (else eager) and replays the
golden check before the replica may serve: a difference raises GoldenMismatch (fail closed).
``capture`` writes a snapshot of the warmed state: runtime-layout weights, the AOT package
digest, engine/KV and model configuration, the golden check and the replica's measured speed
(``speed_profile``, agent/speed.py's keys).  A restore starts its speed meter from that recorded
profile; a boot, or a snapshot without one, runs a short profile
(:func:`agent.replica.speedmeter.boot_profile`, phase ``profile_s``) before it may serve, so
the replica's first load report carries measured speed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent.replica import aot
from agent.replica.config import LlamaConfig
from agent.replica.engine import Engine
from agent.replica.speedmeter import SpeedMeter, boot_profile
from agent.speed import SpeedProfile
from agent.replica.golden import DEFAULT_MAX_TOKENS as GOLDEN_MAX_TOKENS
from agent.replica.golden import DEFAULT_SEED as GOLDEN_SEED
from agent.replica.golden import GOLDEN_TEXTS
from agent.replica.restore_checks import (MAX_SEQS_LIMIT, REPLICA_EXTRA_KEYS,  # noqa: F401
                                          check_engine_config, check_package_fits,
                                          check_replica_manifest)
from agent.replica.warmup import _WARMED, Warmed, take_warmed, warm_device, warm_zygote  # noqa: F401
from agent.snapshot.format import GoldenCheck, Manifest, ModelIdentity

log = logging.getLogger(__name__)

DEFAULT_BUFFER_BYTES = 1 << 30


@dataclass
class Loaded:
    """A model ready to serve, with what it took to get there.

    ``path``: how it was loaded ("eager", "jit", "aot", "restore", "zygote_restore");
    ``phases_s``: seconds per phase (weights, compile/package, golden, ...).
    """

    config: LlamaConfig
    weights: dict[str, torch.Tensor]
    engine: Engine
    identity: ModelIdentity
    golden: GoldenCheck
    path: str
    package_digest: str | None = None
    package_dir: str | None = None
    tokenizer_dir: str | None = None
    package_ranges: dict[str, list[int]] | None = None   # compiled [lo, hi] of batch, seq, cache_batch
    phases_s: dict[str, float] = field(default_factory=dict)
    keepalive: Any = None  # the restore buffer the weights are views of
    device: str = "cpu"    # where the weights and the KV cache live ("cpu", "cuda[:N]")
    restore_io: str | None = None   # how a restore read the bytes: staged | gds | compat | host
    fallback: str | None = None     # why a device restore took the host path instead
    warm: dict[str, Any] | None = None   # a restore's warm-up record (warmup.take_warmed)


def prepare_zygote(threads: int | None = None, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                   *, prefault: bool = True, warm: Path | None = None, device: str = "cpu",
                   kvikio: Any = None, shared: bool = False):
    """Do the zygote's work ahead of need: set torch's intra-op threads (all cores when None)
    and allocate the restore buffer of ``buffer_bytes``: on the CPU a page-aligned HostBuffer
    (touched, with ``prefault``).  ``shared`` (CPU only): weights live once per node instead:
    with ``warm`` the buffer is the snapshot's own data file mapped and faulted in
    (:meth:`~agent.snapshot.reader.HostBuffer.map_snapshot`: page-cache pages every replica of
    that snapshot shares; an anonymous buffer where it cannot be mapped), and without ``warm``
    there is no buffer at all (returns None: the restore maps the snapshot it is given, so a
    zygote without a model costs the runtime only).  On ``device`` "cuda[:N]" a
    :class:`~agent.snapshot.gpu.DeviceBuffer` (which makes the CUDA context, pins its restore
    strategy's staging memory and loads kvikio, or records why it could not: the kvikio
    strategy's restores then take the host path).  Then the warm-up
    (agent/replica/warmup.py): with ``warm`` (a snapshot the zygote will likely restore) :func:`~agent.replica.warmup.warm_zygote`, and where there is none
    or it could not be warmed for, :func:`~agent.replica.warmup.warm_device` (the device's
    context, this thread's BLAS handles and the model family's kernels).  Call it on the
    thread that will run the restore and the engine (agent/replica/worker.py
    ``make_engine_thread``: one OpenMP team per process, and a GPU thread's own cuBLAS
    handles).  Returns the buffer.  Raises torch's OutOfMemoryError when the device lacks
    ``buffer_bytes``."""
    from agent.snapshot.reader import HostBuffer

    torch.set_num_threads(threads or os.cpu_count() or 1)
    buffer: Any = None
    if device != "cpu":
        from agent.snapshot.gpu import DeviceBuffer

        buffer = DeviceBuffer.allocate(buffer_bytes, device, kvikio=kvikio)
        if buffer.kvikio is None and buffer.strategy != "staged":   # staged needs no kvikio
            log.warning("zygote on %s: %s; its restores read into host memory and copy",
                        device, buffer.unavailable)
    elif shared and warm is not None:     # an anonymous buffer where the file cannot be mapped
        buffer = HostBuffer.map_snapshot(warm) or HostBuffer.allocate(buffer_bytes,
                                                                      prefault=prefault)
    elif not shared:
        buffer = HostBuffer.allocate(buffer_bytes, prefault=prefault)
    warmed = warm_zygote(buffer, Path(warm)) if warm is not None and buffer is not None else None
    if warmed is None:
        warm_device(device)
    return buffer


def source_identity(model_dir: Path) -> ModelIdentity:
    """Identity of an HF-layout checkpoint: name = directory name; ``source_digest`` = sha256 of
    config.json and every safetensors file's name, size and header (headers hold every tensor's
    name, dtype, shape and offsets; the data is covered by the snapshot's own checksums)."""
    from agent.replica.weights import read_header

    h = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        _, header = read_header(path)
        h.update(f"{path.name}:{path.stat().st_size}:{sorted(header.items())}".encode())
    digest = h.hexdigest()
    return ModelIdentity(name=Path(model_dir).name, version=digest[:12], source_digest="sha256:" + digest)


def golden_prompts(config: LlamaConfig, tokenizer_dir: Path | None) -> list[list[int]]:
    """The fixed golden prompts: GOLDEN_TEXTS tokenized when a tokenizer is there, else fixed
    ids (seeded, in [0, vocab_size))."""
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer.json").is_file():
        from agent.replica.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer_dir)
        return [tok.encode(text).ids for text in GOLDEN_TEXTS]
    gen = torch.Generator().manual_seed(GOLDEN_SEED)
    return [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 7)]


def _record(engine: Engine, prompts: list[list[int]]) -> GoldenCheck:
    from agent.replica.golden import record_golden

    return record_golden(engine, prompts, GOLDEN_SEED, GOLDEN_MAX_TOKENS)


def boot(model_dir: Path, *, release: Path | None = None, compile: bool = False,
         max_seqs: int = aot.DEFAULT_MAX_SEQS, max_seq_len: int = aot.DEFAULT_MAX_SEQ_LEN,
         device: str = "cpu") -> Loaded:
    """Full boot from HF-layout safetensors onto ``device`` ("cpu" or "cuda[:N]": the weights
    are copied there and the engine, its KV cache and the golden check run there).
    ``release``: bind the AOT package for this device's target (sizes come from the package);
    ``compile``: torch.compile just in time (dynamic shapes).  Records the golden check.
    A quantized checkpoint boots dense on a GPU (:func:`agent.replica.aot.weights_for_device`:
    its int4 packing is the CPU kernel's).  Raises InvalidCheckpoint, TargetMismatch,
    WeightSchemeMismatch."""
    from agent.replica.weights import load_hf_weights

    phases: dict[str, float] = {}
    t = time.perf_counter()
    config = LlamaConfig.from_dir(model_dir)
    weights = aot.weights_for_device(load_hf_weights(model_dir, config), config, device)
    phases["weights_s"] = time.perf_counter() - t
    t = time.perf_counter()
    forward, digest, package_dir, path, ranges = None, None, None, "eager", None
    if release is not None:
        packaged = aot.load_package(release, weights, device=device)
        max_seqs, max_seq_len = packaged.manifest["max_seqs"], packaged.manifest["max_seq_len"]
        forward, digest, package_dir, path = packaged, packaged.digest, str(packaged.path), "aot"
        ranges = {k: list(v) for k, v in packaged.ranges.items()}
    else:
        # A KV slot longer than the model's context would be refused when the snapshot is
        # restored (the restore checks engine sizes against the config): cap it here.
        max_seq_len = min(max_seq_len, config.max_position_embeddings)
    # With a package the eager module is not built (building it on the meta device imports
    # torch._dynamo: seconds at every boot).
    engine = Engine(config, None if forward is not None else weights, max_seqs=max_seqs,
                    max_seq_len=max_seq_len, forward=forward, device=device)
    if compile and forward is None:
        engine.forward = torch.compile(engine.model, dynamic=True)  # type: ignore[assignment]  # the compiled module, called as the module is
        path = "jit"
    phases["package_s" if release is not None else "compile_s"] = time.perf_counter() - t
    t = time.perf_counter()
    golden = _record(engine, golden_prompts(config, Path(model_dir)))
    phases["golden_s"] = time.perf_counter() - t
    t = time.perf_counter()
    boot_profile(engine)
    phases["profile_s"] = time.perf_counter() - t
    return Loaded(config, weights, engine, source_identity(Path(model_dir)), golden, path,
                  digest, package_dir, str(Path(model_dir).resolve()), ranges, phases,
                  device=device)


def restore(snapshot: Path, *, buffer=None, release: Path | None = None, verify: bool = True,
            path: str = "restore", threads: int = 2, device: str = "cpu") -> Loaded:
    """Restore a captured replica from ``snapshot`` (into ``buffer`` when given, e.g. a
    zygote's) onto ``device`` (a DeviceBuffer's own device wins): on a GPU through
    :func:`agent.snapshot.gpu.restore_for_device` (kvikio into device memory; a device read that fails takes the host path, the
    reason in ``Loaded.fallback`` and the log).  Binds the AOT package the snapshot names
    (``release`` overrides where to look; a package that is missing or built for another
    target falls back to eager, which the golden check still guards), and replays the golden
    check on ``device``.  Raises SnapshotIncompatible before reading any data when the snapshot
    is not a captured replica snapshot (:func:`check_replica_manifest`: e.g. a weights-only
    ``rewarm import``, or one whose golden check was recorded by another method), what restore_snapshot raises (SnapshotIncompatible,
    SnapshotCorrupt, ...), InvalidCheckpoint (package digest differs) and GoldenMismatch.

    ``Loaded.phases_s`` holds ``weights_s``, ``package_s``, ``golden_s`` and the check's parts
    (``golden_prefill_s``, ``golden_decode_s``, ``golden_sample_s``); ``Loaded.warm`` whether
    the zygote's warmed engine served it and why not (agent/replica/warmup.py ``take_warmed``),
    and ``golden_thread``, the thread the check ran on."""
    from agent.errors import TargetMismatch
    from agent.replica.golden import verify_golden

    phases: dict[str, float] = {}
    device = getattr(buffer, "device", None) or device
    t = time.perf_counter()
    # Refuse what is not a captured replica snapshot (e.g. `rewarm import`'s weights-only
    # snapshots) before any data is read into the buffer.
    from agent.snapshot.gpu import restore_for_device

    restored, io, fallback = restore_for_device(snapshot, buffer, device, verify=verify,
                                                threads=threads,
                                                accept=lambda m: check_replica_manifest(m, snapshot))
    tensors = restored.tensors
    if io == "host" and device != "cpu":     # read into host memory: copy to the device
        tensors = {k: v.to(device) for k, v in tensors.items()}
    phases["weights_s"] = time.perf_counter() - t
    extra = restored.manifest.extra      # checked by check_replica_manifest above
    config = LlamaConfig.from_dict(extra["model_config"], path=snapshot)
    engine_cfg = check_engine_config(extra["engine"], config, snapshot)
    t = time.perf_counter()
    forward, digest, package_dir, ranges = None, None, None, None
    ref = extra.get("aot_package")
    # the engine a warm-up built on views of this buffer (warmed for another snapshot or
    # buffer, or told to look elsewhere for the package: built anew), and what happened
    warmed, warm = take_warmed(buffer, restored.manifest, restored.buffer, release, snapshot)
    if warmed is not None:
        forward = warmed.forward
        if forward is not None:
            assert ref is not None, "a warmed package came from the manifest's aot_package"
            digest, package_dir = ref["digest"], str(forward.path)
            ranges = {k: list(v) for k, v in forward.ranges.items()}
    elif ref:
        where = Path(release) if release is not None else Path(ref["dir"])
        try:
            forward = aot.load_package(where, tensors, expect_digest=ref["digest"], device=device)
            check_package_fits(forward, engine_cfg, ref.get("ranges"), snapshot)
            digest, package_dir = ref["digest"], str(forward.path)
            ranges = {k: list(v) for k, v in forward.ranges.items()}
        except (FileNotFoundError, TargetMismatch) as exc:
            forward = None
            log.warning("%s: AOT package %s not usable here (%s); serving eager", snapshot,
                        ref["digest"], exc)
    # The speed recorded at capture is a measured prior (same pinned hardware class); an
    # unreadable one only costs the short profile below, never the restore.
    recorded = SpeedProfile.from_meta(extra.get("speed_profile") or {})
    meter = SpeedMeter(recorded, measured_prior=True) if recorded else None
    if warmed is not None:   # bound to views of this buffer, which now holds the real weights
        engine = warmed.engine
        if meter is not None:
            engine.meter = meter
    else:
        engine = Engine(config, None if forward is not None else tensors,
                        max_seqs=engine_cfg["max_seqs"], max_seq_len=engine_cfg["max_seq_len"],
                        forward=forward, meter=meter, device=device)
    phases["package_s"] = time.perf_counter() - t
    t = time.perf_counter()
    golden = restored.manifest.golden
    assert golden is not None, "check_replica_manifest refuses a snapshot without one"
    verify_golden(engine, golden, snapshot)
    phases["golden_s"] = time.perf_counter() - t
    replay = engine.replay_phases      # where the check's time went (agent/replica/lockstep.py)
    for part in ("prefill_s", "decode_s", "sample_s"):
        phases[f"golden_{part}"] = replay.get(part, 0.0)
    warm["golden_thread"] = replay.get("thread")
    if recorded is None:
        t = time.perf_counter()
        boot_profile(engine)
        phases["profile_s"] = time.perf_counter() - t
    if buffer is not None and getattr(buffer, "file_key", None) is not None \
            and restored.buffer is not buffer:
        buffer.release()      # the map of the snapshot it was warmed for: unpinned, unmapped
    return Loaded(config, tensors, engine, restored.manifest.model, golden, path, digest,
                  package_dir, extra.get("tokenizer_dir"), ranges, phases, keepalive=restored.buffer,
                  device=device, restore_io=io, fallback=fallback, warm=warm)


def capture(loaded: Loaded, dest: Path) -> Manifest:
    """Write a snapshot of ``loaded`` at ``dest`` (atomic; see agent/snapshot/writer.py),
    pinned to ``loaded.device`` (a GPU replica's snapshot names its driver, GPU and compute
    capability, so it restores only onto the same kind)."""
    from agent.snapshot.pins import machine_pins
    from agent.snapshot.writer import write_snapshot

    extra = {"model_config": loaded.config.to_dict(),
             "engine": {"max_seqs": loaded.engine.kv.max_seqs,
                        "max_seq_len": loaded.engine.kv.max_seq_len},
             "aot_package": ({"digest": loaded.package_digest, "dir": loaded.package_dir,
                              "ranges": loaded.package_ranges}
                             if loaded.package_digest else None),
             "tokenizer_dir": loaded.tokenizer_dir}
    if loaded.engine.meter.measured:
        extra["speed_profile"] = loaded.engine.meter.profile().to_dict()
    return write_snapshot(dest, loaded.weights, model=loaded.identity, golden=loaded.golden,
                          extra=extra, pins=machine_pins(loaded.device))
