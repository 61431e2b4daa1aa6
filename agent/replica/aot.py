"""Compile once, never at boot: torch.export + AOTInductor, one package per target.

``rewarm build MODEL_DIR --out RELEASE_DIR`` exports the model's forward (the KV cache passed
in, see agent/replica/model.py) with three independent dynamic sizes — active batch B, cache
batch C, new tokens S — and compiles it ahead of time with AOTInductor, the path the AOT design
document (seeds/000, "Compiling for multiple targets") takes to cut a 5.6-minute start to 26 s.
Layout of a release::

    RELEASE_DIR/<target>/model.pt2      the AOTInductor package: generated code, no weights
    RELEASE_DIR/<target>/package.json   target, sha256 digest of model.pt2, config, sizes,
                                        and the name, shape and dtype of every weight it binds

Weights stay outside the package (``aot_inductor.package_constants_in_so=False``) and are bound
at load with ``load_constants(..., user_managed=True)``: the compiled code reads the caller's
tensors — the views into a restored snapshot's buffer — without a copy, so one package serves
every checkpoint of the same shape.  A package records its target (agent/replica/targets.py);
:func:`load_package` refuses one built for another CPU or GPU with :class:`TargetMismatch`
before any of its code is loaded (AVX-512 code on a CPU without it dies with SIGILL).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from agent.errors import ConfigError, InvalidCheckpoint, TargetMismatch
from agent.replica.config import LlamaConfig
from agent.replica import DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQS  # noqa: F401 (re-exported)
from agent.replica.targets import current_target

log = logging.getLogger(__name__)

PACKAGE_NAME = "model.pt2"
MANIFEST_NAME = "package.json"
PACKAGE_FORMAT = 1
MAX_MANIFEST_BYTES = 16 << 20


def target_dirname(target: str) -> str:
    """The directory name of a target inside a release (``/`` and ``:`` made safe)."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", target)


def file_digest(path: Path, chunk_bytes: int = 8 << 20) -> str:
    """``sha256:<hex>`` of a file, read in ``chunk_bytes`` pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return "sha256:" + h.hexdigest()


def example_inputs(config: LlamaConfig, max_seqs: int, max_seq_len: int,
                   device: str = "cpu") -> tuple[Any, ...]:
    """Tracing inputs: B=2 active sequences of S=3 tokens in a cache of C=max(2, max_seqs) slots.

    Sizes 0 and 1 are avoided because torch.export specialises them.
    """
    from agent.replica.model import new_kv_caches

    b, s = 2, 3
    tokens = torch.zeros(b, s, dtype=torch.int64, device=device)
    input_pos = torch.arange(s, device=device).repeat(b, 1)
    cache_batch_idx = torch.arange(b, device=device)
    k_caches, v_caches = new_kv_caches(config, max(2, max_seqs), max_seq_len, device)
    return tokens, input_pos, cache_batch_idx, k_caches, v_caches


def dynamic_shapes(config: LlamaConfig, max_seqs: int, max_seq_len: int) -> tuple[Any, ...]:
    """The three independent dynamic sizes: B (batch) ≤ max_seqs, S (seq) ≤ max_seq_len, and
    C (cache_batch) ≤ max(2, max_seqs); T, Hkv and D stay fixed."""
    from torch.export import Dim

    batch = Dim("batch", min=1, max=max(2, max_seqs))
    seq = Dim("seq", min=1, max=max_seq_len)
    cache = Dim("cache_batch", min=1, max=max(2, max_seqs))
    layers = config.num_hidden_layers
    return ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch},
            [{0: cache}] * layers, [{0: cache}] * layers)


def build_from_weights(config: LlamaConfig, weights: Mapping[str, torch.Tensor], out_dir: Path, *,
                       max_seqs: int = DEFAULT_MAX_SEQS, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                       device: str = "cpu", target: str | None = None) -> Path:
    """Export and compile ``config``'s forward; write ``out_dir/<target>/``; return that directory.

    ``weights`` (runtime layout) only give the traced shapes; they are not stored.  Raises
    ConfigError when ``max_seq_len`` exceeds ``config.max_position_embeddings`` or ``max_seqs``
    is below 1.  Takes minutes for a 30-layer model on two CPU cores (C++ compile).
    """
    from agent.replica.model import Transformer

    if not 1 <= max_seq_len <= config.max_position_embeddings:
        raise ConfigError(f"max_seq_len={max_seq_len} must be in [1, max_position_embeddings="
                          f"{config.max_position_embeddings}]", name="max_seq_len",
                          value=max_seq_len, limit=config.max_position_embeddings)
    if max_seqs < 1:
        raise ConfigError(f"max_seqs={max_seqs} must be >= 1", name="max_seqs", value=max_seqs, limit=1)
    target = target or current_target(device)
    dest = Path(out_dir) / target_dirname(target)
    dest.mkdir(parents=True, exist_ok=True)
    from agent.progress import bar

    model = Transformer.from_weights(config, {k: v.to(device) for k, v in weights.items()})
    started = time.perf_counter()
    # Two steps of very different length (export seconds, AOTInductor compile minutes): the
    # bar names the running step and its elapsed time, there is no finer progress to show.
    shown = bar(2, f"build {target}", unit="step")
    shown.set_postfix_str("torch.export")
    with torch.no_grad():
        exported = torch.export.export(
            model, example_inputs(config, max_seqs, max_seq_len, device),
            dynamic_shapes=dynamic_shapes(config, max_seqs, max_seq_len))
    export_s = time.perf_counter() - started
    shown.update(1)
    shown.set_postfix_str("AOTInductor compile")
    package = dest / PACKAGE_NAME
    partial = dest / ("partial-" + PACKAGE_NAME)
    try:
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(partial),
            inductor_configs={"aot_inductor.package_constants_in_so": False,
                              "aot_inductor.metadata": {"rewarm.target": target},
                              # GPU kernels are autotuned here, at build time, never at boot.
                              "max_autotune": device.startswith("cuda")})
    finally:
        shown.update(1)
        shown.close()
    partial.replace(package)
    compile_s = time.perf_counter() - started - export_s
    constants = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                 for name, t in model.state_dict().items()}
    manifest = {
        "format": PACKAGE_FORMAT, "target": target, "device": device,
        "torch": torch.__version__, "digest": file_digest(package),
        "max_seqs": max_seqs, "max_seq_len": max_seq_len,
        "config": config.to_dict(), "constants": constants,
        "export_s": round(export_s, 3), "compile_s": round(compile_s, 3),
    }
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    log.info("built %s for %s in %.1f s (export %.1f s)", package, target,
             export_s + compile_s, export_s)
    return dest


def build(model_dir: Path, out_dir: Path, *, max_seqs: int = DEFAULT_MAX_SEQS,
          max_seq_len: int = DEFAULT_MAX_SEQ_LEN, device: str = "cpu") -> Path:
    """``rewarm build``: read MODEL_DIR (HF layout) and compile its package for this machine's
    target into ``out_dir``.  Returns the package directory.  Raises InvalidCheckpoint for a bad
    checkpoint, ConfigError for sizes out of range or a device this machine lacks."""
    from agent.replica.weights import load_hf_weights

    current_target(device)   # an unusable device is refused before the weights are read
    config = LlamaConfig.from_dir(model_dir)
    return build_from_weights(config, load_hf_weights(model_dir), out_dir, max_seqs=max_seqs,
                              max_seq_len=min(max_seq_len, config.max_position_embeddings),
                              device=device)


def read_package_manifest(package_dir: Path) -> dict[str, Any]:
    """Read and check ``package.json``.  Raises InvalidCheckpoint when missing, too large
    (over MAX_MANIFEST_BYTES) or malformed."""
    path = Path(package_dir) / MANIFEST_NAME
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{path}: no package manifest", path=path, field=MANIFEST_NAME,
                                value=None, limit=None) from None
    if size > MAX_MANIFEST_BYTES:
        raise InvalidCheckpoint(f"{path}: {size} bytes exceeds {MAX_MANIFEST_BYTES}", path=path,
                                field=MANIFEST_NAME, value=size, limit=MAX_MANIFEST_BYTES)
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidCheckpoint(f"{path}: not valid JSON ({exc})", path=path, field=MANIFEST_NAME,
                                value=None, limit=None) from None
    for key in ("format", "target", "digest", "constants", "max_seqs", "max_seq_len", "config"):
        if not isinstance(manifest, dict) or key not in manifest:
            raise InvalidCheckpoint(f"{path}: missing {key!r}", path=path, field=key,
                                    value=None, limit=None)
    if manifest["format"] != PACKAGE_FORMAT:
        raise InvalidCheckpoint(f"{path}: format {manifest['format']!r} is not {PACKAGE_FORMAT}",
                                path=path, field="format", value=manifest["format"],
                                limit=PACKAGE_FORMAT)
    return manifest


def find_package(release_dir: Path, device: str = "cpu") -> Path:
    """The package directory for this machine in a release (or ``release_dir`` itself when it is
    one).  Raises TargetMismatch naming the targets built and this one when none matches, and
    FileNotFoundError when the release holds no package at all."""
    release_dir = Path(release_dir)
    if (release_dir / MANIFEST_NAME).exists():
        return release_dir
    here = current_target(device)
    candidate = release_dir / target_dirname(here)
    if (candidate / MANIFEST_NAME).exists():
        return candidate
    built = sorted(read_package_manifest(p.parent)["target"]
                   for p in release_dir.glob(f"*/{MANIFEST_NAME}"))
    if not built:
        raise FileNotFoundError(f"{release_dir}: no AOT package in this release")
    raise TargetMismatch(f"{release_dir}: packages built for {built}; this machine is {here!r}",
                         built=built, here=here)


@dataclass
class PackagedForward:
    """A loaded package with its weights bound: call it like ``Transformer.forward``.

    ``forward(tokens [B,S] int64, input_pos [B,S] int64, cache_batch_idx [B] int64, k_caches,
    v_caches) -> logits [B,S,V] float32``; the caches are written in place.
    Holds ``weights`` so the bound tensors outlive the compiled model (user-managed constants).
    """

    path: Path
    manifest: dict[str, Any]
    weights: Mapping[str, torch.Tensor] = field(repr=False)
    model: Any = field(repr=False)

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def target(self) -> str:
        return self.manifest["target"]

    def __call__(self, tokens, input_pos, cache_batch_idx, k_caches, v_caches) -> torch.Tensor:
        # The exported signature flattens to [tokens, input_pos, cache_batch_idx, *k, *v] and
        # returns [logits]; boxed_run takes ownership of the list it is given.
        return self.model.boxed_run([tokens, input_pos, cache_batch_idx, *k_caches, *v_caches])[0]


def load_package(path: Path, weights: Mapping[str, torch.Tensor], *, device: str = "cpu",
                 expect_digest: str | None = None) -> PackagedForward:
    """Load the package at ``path`` (a package directory or a release) and bind ``weights``.

    ``weights`` is the runtime layout (agent/replica/model.py), e.g. ``Restored.tensors``; the
    tensors are used in place (no copy) and must stay alive as long as the result.
    Raises TargetMismatch (built for another target; checked before any code is loaded),
    InvalidCheckpoint (digest differs from the manifest or ``expect_digest``; a weight missing or
    of another shape or dtype, naming the tensor and both values).
    """
    package_dir = find_package(Path(path), device)
    manifest = read_package_manifest(package_dir)
    here = current_target(device)
    if manifest["target"] != here:
        raise TargetMismatch(f"{package_dir}: package built for {manifest['target']!r}; this "
                             f"machine is {here!r}", built=manifest["target"], here=here)
    package = package_dir / PACKAGE_NAME
    digest = file_digest(package)
    for expected in (manifest["digest"], expect_digest):
        if expected is not None and digest != expected:
            raise InvalidCheckpoint(f"{package}: digest {digest} is not the expected {expected}",
                                    path=package, field="digest", value=digest, limit=expected)
    bound: dict[str, torch.Tensor] = {}
    for name, spec in manifest["constants"].items():
        tensor = weights.get(name)
        if tensor is None:
            raise InvalidCheckpoint(f"weight {name!r} needed by {package} is missing", path=package,
                                    field=name, value=None, limit=spec["shape"])
        if list(tensor.shape) != spec["shape"] or str(tensor.dtype).removeprefix("torch.") != spec["dtype"]:
            raise InvalidCheckpoint(
                f"weight {name!r}: {tuple(tensor.shape)} {tensor.dtype} does not match the package's "
                f"{tuple(spec['shape'])} {spec['dtype']}", path=package, field=name,
                value=(tuple(tensor.shape), str(tensor.dtype)), limit=(tuple(spec["shape"]), spec["dtype"]))
        bound[name] = tensor if tensor.is_contiguous() else tensor.contiguous()
    # The C++ loader directly: torch._inductor.aoti_load_package would first import the whole
    # of Inductor (seconds of Python imports at every boot) only to wrap this same object.
    model = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
    unknown = set(model.get_constant_fqns()) - set(bound)
    if unknown:
        raise InvalidCheckpoint(f"{package}: constants {sorted(unknown)[:3]} not in its manifest",
                                path=package, field=sorted(unknown)[0], value=None, limit=None)
    # (map, use_inactive, check_full_update, user_managed, allow_h2d_copy)
    model.load_constants(bound, False, True, True, False)
    return PackagedForward(path=package_dir, manifest=manifest, weights=bound, model=model)
