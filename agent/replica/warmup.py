"""A zygote's warm-up: the costs of a process's first model calls, paid before it is ready.

A restore into a zygote must reach its first token right after the weights land: the golden
check and the first request then run kernels that have run before, on the same thread.  What
a thread's first calls pay, and so what the warm-up pays instead (agent/replica/zygote.py
``prepare_zygote`` calls it on the engine thread, agent/replica/worker.py
``make_engine_thread``, the thread that later restores and serves):

- on a GPU: the CUDA context (made when the zygote's DeviceBuffer is allocated); the cuBLAS
  handle and workspace of the calling thread (torch keeps a pool of handles per device and
  hands each thread its own: aten/src/ATen/cuda/CublasHandlePool.cpp) and cuBLASLt's (an
  addmm with a 1-D bias goes through cuBLASLt: aten/src/ATen/native/cuda/Blas.cpp,
  ``isInputCompliesAddmmCudaLt``); each kernel's module, loaded at its first launch (torch
  sets ``CUDA_MODULE_LOADING=LAZY`` when it is unset, torch/cuda/__init__.py ``_lazy_init``),
  and cuBLAS picks kernels by shape, so a shape not run before can load one; the caching
  allocator's segments for the activations and the KV cache (a fresh ``cudaMalloc`` each);
- on the CPU: the OpenMP team of the thread and the first call of each operator.

Two warm-ups, both on the calling thread:

- :func:`warm_zygote` for a snapshot the zygote will likely restore: the engine is built on
  views of the zygote's buffer at the snapshot's tensor offsets (the very memory the restore
  fills), the AOT package loaded and bound to them, the golden check's exact calls run (its
  teacher-forced prefill and decode step at the recorded shapes, and its sampling) and the
  serving path's first shapes (:func:`warm_serving`).  The restore reuses that engine
  (:func:`take_warmed`) when the snapshot, buffer and package are the ones warmed for.
- :func:`warm_device` for the device alone (no snapshot yet, or one that could not be warmed
  for): a small Llama-family model of zero weights through the same calls on ``device``.
  Its engine is not reused; the thread, its handles, its loaded kernels and the allocator's
  cached segments are.

Nothing of either is trusted: the restore still reads and checksums every byte into the
buffer and replays the golden check on the real weights.  What happened is recorded for the
restore (``Loaded.warm``: the engine reused or built and why, the seconds each warm-up took
and on which thread), so a device check can tell a warm restore from a cold one.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agent.replica import aot
from agent.replica.config import LlamaConfig
from agent.replica.engine import Engine
from agent.snapshot.format import Manifest

log = logging.getLogger(__name__)

SERVING_SHAPES: dict[str, dict[str, Any]] = {
    "cuda": {"prompt_tokens": (1, 6, 16, 64, 128), "batch": 4},
    "cpu": {"prompt_tokens": (6,), "batch": 1},
}
"""Serving calls a warm-up runs (:func:`warm_serving`): one prompt of each length alone (B=1
prefill, then B=1 decode steps), then ``batch`` prompts decoded together.  On a GPU every
prefill length up to the golden prompts' and a typical chat turn's, since each new M of a
matmul may load a cuBLAS kernel; on the CPU (no lazy loading) one short prompt."""

GENERIC = {
    "cuda": LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                        vocab_size=32000, max_position_embeddings=512, dtype="bfloat16"),
    "cpu": LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                       max_position_embeddings=256, dtype="bfloat16"),
}
""":func:`warm_device`'s model: two Llama layers.  On a GPU of a real model's kind (head dim
128, grouped KV heads, bfloat16, a 32k vocabulary: 88 M parameters, 176 MB of zeros while it
runs); on the CPU a tiny one (its first-call costs do not depend on the shapes)."""


@dataclass
class Warmed:
    """A zygote's engine made ahead of need for one snapshot (:func:`warm_zygote`)."""

    snapshot: str
    layout: tuple         # :func:`layout` of the manifest it was warmed for
    engine: Engine
    forward: Any          # the PackagedForward, or None (eager)
    seconds: float
    thread_id: int = 0    # threading.get_ident() of the thread that warmed it
    thread: str = ""      # that thread's name


_WARMED: weakref.WeakKeyDictionary[Any, Warmed] = weakref.WeakKeyDictionary()
_NOT_WARMED: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
"""Why :func:`warm_zygote` left a buffer unwarmed (read by :func:`take_warmed`)."""
_DEVICE_WARMED: dict[tuple[str, int], dict[str, Any]] = {}
"""(device, thread ident) -> :func:`warm_device`'s record on that thread."""


def layout(manifest: Manifest) -> tuple:
    """What must agree for a warmed engine to serve a restore: every tensor's place in the
    buffer, the package digest, the engine sizes and the model configuration."""
    extra = manifest.extra if isinstance(manifest.extra, dict) else {}
    ref = extra.get("aot_package") or {}
    return (manifest.total_bytes,
            tuple((t.name, t.offset, t.nbytes, t.dtype, tuple(t.shape)) for t in manifest.tensors),
            ref.get("digest"), repr(extra.get("engine")), repr(extra.get("model_config")))


def _device_key(device: str) -> str:
    dev = torch.device(device)
    return f"{dev.type}:{dev.index if dev.index is not None else 0}" if dev.type != "cpu" else "cpu"


def warm_serving(engine: Engine, device: str) -> int:
    """Run the serving path's first shapes (:data:`SERVING_SHAPES` for ``device``'s kind)
    through ``engine`` greedily, outside its speed meter (the meter is swapped for a scratch
    one and put back, so a restored replica reports only what it served).  Writes only into
    free KV slots, which no later sequence reads before writing.  Returns the forward calls
    (prefills and decode steps).  Raises RuntimeError when the engine is left busy (a call
    that failed and did not free its sequences: the engine is not fit to serve)."""
    from agent.replica.speedmeter import SpeedMeter, boot_profile

    shapes = SERVING_SHAPES["cpu" if torch.device(device).type == "cpu" else "cuda"]
    saved, engine.meter = engine.meter, SpeedMeter()
    try:
        taken = boot_profile(engine, prompt_tokens=shapes["prompt_tokens"],
                             batch=shapes["batch"], new_tokens=2)
    except Exception as exc:   # noqa: BLE001 - the golden calls ran; these are a bonus
        log.warning("zygote: the serving shapes' warm-up failed (%s: %s); its first request "
                    "pays them", type(exc).__name__, exc)
        taken = {"prefill": 0, "decode": 0}
    finally:
        engine.meter = saved
    if engine.busy:
        raise RuntimeError("the serving warm-up left sequences in the engine")
    return taken["prefill"] + taken["decode"]


def warm_zygote(buffer, snapshot: Path) -> Warmed | None:
    """Pay ahead of need the first-call costs a restore of ``snapshot`` into ``buffer`` would
    otherwise pay inside its golden check and first request (module docstring), on zeros (a
    fresh zygote's buffer).  Reads the manifest only.  Returns None (logged, and the reason
    kept for the restore's ``warm`` record) when the snapshot cannot be warmed for
    (unreadable manifest, too large for the buffer, package unusable here, a golden record it
    cannot check, a forward that fails): the restore then does it all."""
    from agent.errors import RewarmError
    from agent.replica.model_text import preload_tokenizer
    from agent.replica.restore_checks import (check_engine_config, check_package_fits,
                                              check_replica_manifest)
    from agent.snapshot.reader import read_manifest, tensor_views

    t = time.perf_counter()
    device = getattr(buffer, "device", "cpu")
    try:
        manifest = read_manifest(snapshot)
        extra = check_replica_manifest(manifest, snapshot)
        config = LlamaConfig.from_dict(extra["model_config"], path=snapshot)
        engine_cfg = check_engine_config(extra["engine"], config, snapshot)
        if manifest.total_bytes > buffer.capacity_bytes:
            raise ValueError(f"{manifest.total_bytes} bytes do not fit the "
                             f"{buffer.capacity_bytes}-byte buffer")
        views = tensor_views(manifest, buffer.as_tensor(manifest.total_bytes))
        forward = None
        ref = extra.get("aot_package")
        if ref:
            forward = aot.load_package(Path(ref["dir"]), views, expect_digest=ref["digest"],
                                       device=device)
            check_package_fits(forward, engine_cfg, ref.get("ranges"), snapshot)
        engine = Engine(config, None if forward is not None else views,
                        max_seqs=engine_cfg["max_seqs"], max_seq_len=engine_cfg["max_seq_len"],
                        forward=forward, device=device)
        golden = manifest.golden
        assert golden is not None, "check_replica_manifest refuses a snapshot without one"
        engine.teacher_forced([list(p) for p in golden.prompts],
                              [list(r) for r in golden.expected], seed=golden.seed)
        warm_serving(engine, device)
        if isinstance(extra.get("tokenizer_dir"), str):   # the first request's text, too
            preload_tokenizer(extra["tokenizer_dir"])
    except (RewarmError, OSError, ValueError, RuntimeError) as exc:
        _NOT_WARMED[buffer] = f"warm-up for {snapshot} failed: {type(exc).__name__}: {exc}"
        log.warning("zygote: cannot warm for %s (%s); the restore will do it all", snapshot, exc)
        return None
    me = threading.current_thread()
    warmed = Warmed(str(snapshot), layout(manifest), engine, forward, time.perf_counter() - t,
                    threading.get_ident(), me.name)
    _WARMED[buffer] = warmed
    _NOT_WARMED.pop(buffer, None)
    log.info("zygote warmed for %s in %.2f s on thread %s", snapshot, warmed.seconds, me.name)
    return warmed


def warm_device(device: str) -> dict[str, Any]:
    """Warm ``device`` on the calling thread without a snapshot (module docstring): a
    :data:`GENERIC` model of zero weights (its golden-check shapes: three prompts of 5, 7 and
    12 tokens replayed teacher-forced over 8 tokens with a seed, then :func:`warm_serving`),
    and on a GPU one addmm with a bias (cuBLASLt).  Once per device and thread; later calls
    return the first one's record.  Returns ``{"seconds", "thread", "calls"}``, or with
    ``error`` when the warm-up failed (logged; the zygote still restores, paying the costs
    then)."""
    from agent.replica.golden import DEFAULT_MAX_TOKENS, DEFAULT_SEED
    from agent.replica.model import runtime_shapes

    key = (_device_key(device), threading.get_ident())
    if key in _DEVICE_WARMED:
        return _DEVICE_WARMED[key]
    t = time.perf_counter()
    kind = "cpu" if torch.device(device).type == "cpu" else "cuda"
    record: dict[str, Any] = {"thread": threading.current_thread().name, "calls": 0}
    try:
        config = GENERIC[kind]
        weights = {name: torch.zeros(shape, dtype=config.torch_dtype, device=device)
                   for name, shape in runtime_shapes(config).items()}
        engine = Engine(config, weights, max_seqs=4, max_seq_len=config.max_position_embeddings,
                        device=device)
        prompts = [[(7 * i + n) % config.vocab_size for i in range(n)] for n in (5, 7, 12)]
        engine.teacher_forced(prompts, [[0] * DEFAULT_MAX_TOKENS for _ in prompts],
                              seed=DEFAULT_SEED)
        record["calls"] = 2 + warm_serving(engine, device)
        if kind == "cuda":
            x = torch.zeros(16, config.hidden_size, dtype=config.torch_dtype, device=device)
            bias = torch.zeros(config.hidden_size, dtype=config.torch_dtype, device=device)
            torch.addmm(bias, x, weights["layers.0.attention.wo.weight"])
            torch.cuda.synchronize(device)
        del engine, weights
    except Exception as exc:   # noqa: BLE001 - torch's errors, out of memory, no CUDA build:
        # the zygote still restores (paying these costs then); the restore's record says why
        record["error"] = f"{type(exc).__name__}: {exc}"
        log.warning("zygote: warming %s failed (%s); its restore pays the first-call costs",
                    device, record["error"])
    record["seconds"] = time.perf_counter() - t
    _DEVICE_WARMED[key] = record
    return record


def take_warmed(buffer, manifest: Manifest, restored_buffer, release: Path | None,
                where: Any) -> tuple[Warmed | None, dict[str, Any]]:
    """The warmed engine a restore of ``manifest`` into ``buffer`` may serve with (used once:
    it leaves the registry), or None; and the ``warm`` record of the restore: ``engine``
    ("reused" | "built"), ``why`` it was built, ``warm_s`` and ``warm_thread`` of the
    snapshot's warm-up, ``device`` (:func:`warm_device`'s record on this thread, if it ran),
    ``thread`` (this one's name).  A warmed engine is reused only for the same layout in the
    same buffer (the restore read into it), and not when ``release`` names another place for
    its package."""
    me = threading.current_thread()
    info: dict[str, Any] = {"thread": me.name}
    warmed = _WARMED.pop(buffer, None) if buffer is not None else None
    why = None
    if buffer is None:
        why = "no zygote buffer"
    elif warmed is None:
        why = _NOT_WARMED.pop(buffer, "the zygote was not told a snapshot to warm for")
    elif warmed.layout != layout(manifest):
        why = f"warmed for {warmed.snapshot}, whose layout differs"
    elif restored_buffer is not buffer:
        why = "the restore read into another buffer than the one warmed"
    elif release is not None and warmed.forward is not None:
        why = "told to load the package from another release"
    if warmed is not None:
        info.update(warm_s=round(warmed.seconds, 4), warm_thread=warmed.thread)
    if why is not None:
        warmed = None
    info["engine"] = "built" if warmed is None else "reused"
    if why is not None:
        info["why"] = why
    device = getattr(buffer, "device", None) or "cpu"
    dev = _DEVICE_WARMED.get((_device_key(device), threading.get_ident()))
    if dev is not None:
        info["device"] = dict(dev)
    if warmed is not None and warmed.thread_id != threading.get_ident():
        log.warning("%s: restored on another thread than the zygote's warm-up: two OpenMP "
                    "teams in one process slow every forward call, and a GPU thread's cuBLAS "
                    "handles are its own (run both on the engine thread, "
                    "agent/replica/worker.py make_engine_thread)", where)
    return warmed, info
