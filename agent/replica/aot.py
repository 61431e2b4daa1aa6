"""Compile once, never at boot: torch.export + AOTInductor, one package per target.

``rewarm build MODEL_DIR --out RELEASE_DIR`` exports the model's forward (the KV cache passed
in, see agent/replica/model.py) with four independent dynamic sizes — active batch B, cache
batch C, new tokens S, logit positions K — and compiles it ahead of time with AOTInductor,
per CPU or GPU target, so that a start loads compiled code instead of compiling it.
Layout of a release::

    RELEASE_DIR/<target>/model.pt2      the AOTInductor package: generated code, no weights
    RELEASE_DIR/<target>/package.json   target, sha256 digest of model.pt2, config, sizes,
                                        the name, shape and dtype of every weight it binds,
                                        the compiled ranges and KV layout of its inputs, and
                                        the build's check at their edges

Every dynamic size's range starts at 1: the engine prefills with B=1, decodes with S=1 and
samples one position per row (K=1).
torch.export assumes a backed size is never 0 or 1 unless told otherwise, and Inductor then
compiles (and, with ``AOTI_RUNTIME_CHECK_INPUTS=1``, enforces) ``>= 2``; so the export runs
with ``backed_size_oblivious`` and the model avoids the ops whose stride reasoning would guard
``!= 1`` (agent/replica/model.py, ``attend``).  The export is refused when a range comes out
narrower than asked, and the compiled package is run at the edges of its ranges against eager
with input checks on before it is published (agent/replica/aot_check.py).  The ranges are
recorded in ``package.json`` and inside the package (its AOTInductor metadata, covered by the
digest); :class:`PackagedForward` checks every call against them (agent/replica/aot_inputs.py).
K is compiled over S's range and recorded with it (``aot_inputs.LOGITS_RANGE``).

A package is bound to the forward's signature: :func:`load_package` refuses one whose compiled
call takes other inputs than :data:`FORWARD_INPUTS` (read from the package's own call spec),
and ``package.json``'s ``format`` says which signature its rewarm built (:data:`PACKAGE_FORMAT`),
so a package of an older forward is rebuilt, never called with inputs it does not take.

On a GPU the package runs dense weights in the checkpoint's dtype (bfloat16): an int4
checkpoint's packing is the CPU kernel's (``_weight_int4pack_mm_for_cpu``), so the build and a
GPU boot dequantize it first (:func:`weights_for_device`).  Matmuls stay cuBLAS calls and the
rest is fused into Triton kernels by Inductor's defaults, without ``max_autotune``: autotuning
every matmul of a 30-layer model makes the build minutes long on the node (it benchmarks Triton
templates against cuBLAS at each shape), where the GPU device check gives the build about 100
s, and for the batch sizes a replica serves the matmuls are memory-bound, where cuBLAS is at
the bandwidth limit already.  A build that fails raises PackageBuildFailed naming its stage
(export, compile or check) and the error torch raised, chained.

Weights stay outside the package (``aot_inductor.package_constants_in_so=False``) and are bound
at load with ``load_constants(..., user_managed=True)``: the compiled code reads the caller's
tensors — the views into a restored snapshot's buffer — without a copy, so one package serves
every checkpoint of the same shape.  A package records its target (agent/replica/targets.py);
:func:`load_package` refuses one built for another CPU or GPU with :class:`TargetMismatch`
before any of its code is loaded (AVX-512 code on a CPU without it dies with SIGILL).
"""

from __future__ import annotations

import hashlib
import contextlib
import json
import stat
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping

import torch

from agent.errors import (ConfigError, InvalidCheckpoint, PackageBuildFailed, PackageCheckFailed,
                          TargetMismatch, WeightSchemeMismatch)
from agent.replica.aot_check import load_runner
from agent.replica.aot_inputs import DIMS, LOGITS_RANGE, InputSpec, parse_ranges
from agent.replica.config import LlamaConfig
from agent.replica import DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQS  # noqa: F401 (re-exported)
from agent.replica.targets import current_target

log = logging.getLogger(__name__)

PACKAGE_NAME = "model.pt2"
MANIFEST_NAME = "package.json"
FORWARD_SOURCES = ("model.py", "quant.py", "config.py", "shapes.py")
"""The replica modules whose code a package compiles (the forward, its quantized layers, the
config and the shape checks): :func:`forward_source_digest` covers them."""
PACKAGE_FORMAT = 3
"""3: the forward takes ``logit_pos`` and returns logits at those positions only (2: logits at
every position, without it; 1 lacked the recorded ranges and refused B=1 and S=1)."""
FORWARD_INPUTS = ("tokens", "input_pos", "cache_batch_idx", "k_caches", "v_caches", "logit_pos")
"""The positional inputs of the exported forward (agent/replica/model.py), in order."""
RANGES_METADATA = "rewarm.ranges"
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


def size_ranges(max_seqs: int, max_seq_len: int) -> dict[str, tuple[int, int]]:
    """The compiled range of each dynamic size: batch and cache batch in [1, max(2, max_seqs)],
    seq in [1, max_seq_len] (an upper bound of 1 would make export treat the size as static,
    hence max_seq_len >= 2 at build)."""
    return {"batch": (1, max(2, max_seqs)), "seq": (1, max_seq_len),
            "cache_batch": (1, max(2, max_seqs))}


def example_inputs(config: LlamaConfig, max_seqs: int, max_seq_len: int,
                   device: str = "cpu") -> tuple[Any, ...]:
    """Tracing inputs: B=2 active sequences of S=2 tokens in a cache of C=max(2, max_seqs)
    slots of max_seq_len positions, logits asked at K=2 positions (example sizes of 1 would be
    specialised)."""
    from agent.replica.model import every_position, new_kv_caches

    b, s = 2, 2
    tokens = torch.zeros(b, s, dtype=torch.int64, device=device)
    input_pos = torch.arange(s, device=device).repeat(b, 1)
    cache_batch_idx = torch.arange(b, device=device)
    k_caches, v_caches = new_kv_caches(config, max(2, max_seqs), max_seq_len, device)
    return tokens, input_pos, cache_batch_idx, k_caches, v_caches, every_position(b, s, device)


def dynamic_shapes(config: LlamaConfig, max_seqs: int, max_seq_len: int) -> tuple[Any, ...]:
    """The four independent dynamic sizes: B (dim 0 of tokens, input_pos, cache_batch_idx,
    logit_pos), S (dim 1 of tokens, input_pos), C (dim 0 of every cache) over the ranges of
    :func:`size_ranges`, and K (dim 1 of logit_pos) over S's; T, Hkv and D stay fixed."""
    from torch.export import Dim

    ranges = size_ranges(max_seqs, max_seq_len)
    batch, seq, cache = (Dim(name, min=ranges[name][0], max=ranges[name][1]) for name in DIMS)
    lo, hi = ranges[LOGITS_RANGE]
    logits = Dim("logits", min=lo, max=hi)
    layers = config.num_hidden_layers
    return ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch},
            [{0: cache}] * layers, [{0: cache}] * layers, {0: batch, 1: logits})


def _size_oblivious():
    """torch.export without its 0/1 specialisation (``backed_size_oblivious``), where this torch
    has it; where it does not, the range check after export says what was narrowed."""
    config = getattr(torch.fx.experimental, "_config", None)
    if config is None or not hasattr(config, "backed_size_oblivious"):
        log.warning("torch %s has no backed_size_oblivious; export may narrow ranges",
                    torch.__version__)
        return contextlib.nullcontext()
    return config.patch(backed_size_oblivious=True)


def exported_ranges(exported, config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """The range export gave each dynamic size, read from the traced inputs' symbols
    (tokens: B, S; the first cache: C; logit_pos: K, as ``"logits"``); a size export made
    static reads as (n, n)."""
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    user = placeholders[-(4 + 2 * config.num_hidden_layers):]  # after the lifted weights
    tokens, cache, picked = user[0].meta["val"], user[3].meta["val"], user[-1].meta["val"]
    out = {}
    for name, size in (("batch", tokens.shape[0]), ("seq", tokens.shape[1]),
                       ("cache_batch", cache.shape[0]), ("logits", picked.shape[1])):
        if isinstance(size, int):
            out[name] = (size, size)
            continue
        vr = exported.range_constraints[size.node.expr]
        out[name] = (int(vr.lower), int(vr.upper))
    return out


def exported_ask(ranges: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """What :func:`exported_ranges` must read for a package of ``ranges``: those, and K
    (``"logits"``) over S's."""
    return {**ranges, "logits": ranges[LOGITS_RANGE]}


def weights_for_device(weights: Mapping[str, torch.Tensor], config: LlamaConfig,
                       device: str) -> dict[str, torch.Tensor]:
    """Runtime-layout ``weights`` as ``device`` runs them: unchanged on the CPU; on a GPU,
    dense in ``config.dtype`` (a quantized matrix replaced by its values,
    agent/replica/quant.py ``dense_runtime``, computed on the host where its kernel runs) and
    moved there.  The GPU has no kernel for the CPU's int4 packing."""
    from agent.replica.quant import dense_runtime, scheme_of

    if device == "cpu":
        return dict(weights)
    if scheme_of(weights) != "dense":
        weights = {k: v.to(config.torch_dtype) for k, v in dense_runtime(dict(weights)).items()}
    return {k: v.to(device) for k, v in weights.items()}


def build_from_weights(config: LlamaConfig, weights: Mapping[str, torch.Tensor], out_dir: Path, *,
                       max_seqs: int = DEFAULT_MAX_SEQS, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                       device: str = "cpu", target: str | None = None) -> Path:
    """Export and compile ``config``'s forward; write ``out_dir/<target>/``; return that directory.

    ``weights`` (runtime layout) give the traced shapes and the build check's weights; they
    are not stored (on a GPU, :func:`weights_for_device`).  Raises ConfigError when
    ``max_seq_len`` is outside [2, ``config.max_position_embeddings``] or ``max_seqs`` is below
    1, PackageCheckFailed when export narrows a range or the compiled package fails
    :func:`aot_check.check_package`, PackageBuildFailed when torch.export or AOTInductor raise
    (no package is left then).  Takes minutes for a 30-layer model on two CPU cores (C++
    compile).
    """
    from agent.replica import aot_check
    from agent.replica.model import Transformer
    from agent.replica.quant import scheme_of

    if not 2 <= max_seq_len <= config.max_position_embeddings:
        raise ConfigError(f"max_seq_len={max_seq_len} must be in [2, max_position_embeddings="
                          f"{config.max_position_embeddings}]", name="max_seq_len",
                          value=max_seq_len, limit=config.max_position_embeddings)
    if max_seqs < 1:
        raise ConfigError(f"max_seqs={max_seqs} must be >= 1", name="max_seqs", value=max_seqs, limit=1)
    target = target or current_target(device)
    dest = Path(out_dir) / target_dirname(target)
    dest.mkdir(parents=True, exist_ok=True)
    from agent.progress import bar

    model = Transformer.from_weights(config, weights_for_device(weights, config, device))
    ranges = size_ranges(max_seqs, max_seq_len)
    package = dest / PACKAGE_NAME
    partial = dest / ("partial-" + PACKAGE_NAME)
    started = time.perf_counter()
    # Two steps of very different length (export seconds, AOTInductor compile minutes): the
    # bar names the running step and its elapsed time, there is no finer progress to show.
    shown = bar(2, f"build {target}", unit="step")
    shown.set_postfix_str("torch.export")
    try:
        with torch.no_grad(), _size_oblivious(), _stage("export", dest, target, partial):
            exported = torch.export.export(
                model, example_inputs(config, max_seqs, max_seq_len, device),
                dynamic_shapes=dynamic_shapes(config, max_seqs, max_seq_len))
        got, asked = exported_ranges(exported, config), exported_ask(ranges)
        if got != asked:
            raise PackageCheckFailed(f"{dest}: export narrowed the dynamic sizes to {got}, "
                                     f"asked for {asked}", package=dest, sizes=None,
                                     field="ranges", value=got, limit=asked)
        export_s = time.perf_counter() - started
        shown.update(1)
        shown.set_postfix_str("AOTInductor compile")
        with torch.no_grad(), _size_oblivious(), _stage("compile", dest, target, partial):
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(partial),
                inductor_configs={"aot_inductor.package_constants_in_so": False,
                                  "aot_inductor.metadata": {"rewarm.target": target,
                                                            RANGES_METADATA: json.dumps(ranges)},
                                  # round every bfloat16/float16 intermediate where eager does,
                                  # so the package gives eager's tokens (not only its accuracy)
                                  "emulate_precision_casts": True})
        shown.update(1)
    finally:
        shown.close()
    compile_s = time.perf_counter() - started - export_s
    t = time.perf_counter()
    state = model.state_dict()
    with _stage("check", dest, target, partial):
        derived = derived_constants(partial, state, config, device)
        checked = aot_check.check_package(partial, model, {**state, **bind_derived(derived)},
                                          ranges, max_seq_len, device=device)
    check_s = time.perf_counter() - t
    partial.replace(package)
    constants = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                 for name, t in state.items()}
    manifest = {
        "format": PACKAGE_FORMAT, "target": target, "device": device,
        "torch": torch.__version__, "digest": file_digest(package),
        "source": forward_source_digest(),
        "max_seqs": max_seqs, "max_seq_len": max_seq_len,
        "ranges": {k: list(v) for k, v in ranges.items()},
        "kv": {"layers": config.num_hidden_layers, "max_seq_len": max_seq_len,
               "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
               "dtype": config.dtype},
        "checked": {"env": f"{aot_check.CHECK_ENV}=1", "runs": checked},
        "config": config.to_dict(), "constants": constants,
        "weight_scheme": scheme_of(state), "derived_constants": derived,
        "export_s": round(export_s, 3), "compile_s": round(compile_s, 3),
        "check_s": round(check_s, 3),
    }
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    log.info("built %s for %s in %.1f s (export %.1f s, check %.1f s)", package, target,
             export_s + compile_s + check_s, export_s, check_s)
    return dest


@contextlib.contextmanager
def _stage(stage: str, dest: Path, target: str, partial: Path):
    """Run one stage of a build: whatever it raises leaves no partial package; a typed error
    passes as it is, anything else (torch.export's, Inductor's, the C++ compiler's, a CUDA
    error) becomes PackageBuildFailed naming the stage, the target and the error's first
    lines, chained to it (``rewarm build`` prints the message; ``--log-level DEBUG`` the
    traceback)."""
    from agent.errors import RewarmError

    try:
        yield
    except BaseException as exc:
        partial.unlink(missing_ok=True)
        if isinstance(exc, (RewarmError, KeyboardInterrupt, SystemExit)):
            raise
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        error = f"{type(exc).__name__}: {' | '.join(lines[:6])[:1500]}"
        raise PackageBuildFailed(f"{dest}: building the package for {target} failed at "
                                 f"{stage}: {error}", package=dest, target=target, stage=stage,
                                 error=error) from exc


def derived_constants(package: Path, state: Mapping[str, torch.Tensor],
                      config: LlamaConfig, device: str = "cpu") -> dict[str, dict[str, Any]]:
    """The constants Inductor added to ``package`` beyond the module's own (``state``), with
    the value each must be bound to.  The only ones this model makes: Inductor's CPU lowering
    of ``_weight_int4pack_mm_for_cpu`` (torch/_inductor/quantized_lowerings.py,
    ``int4pack_mm_cpu``) turns the group size into an unnamed 0-d int64 constant, which a
    package built with ``package_constants_in_so=False`` does not carry, so it is recorded in
    ``package.json`` and bound at load.  The build check then runs the package with it.
    Raises PackageCheckFailed for any other unknown constant."""
    from agent.replica.quant import GROUP_SIZE, scheme_of

    loader = load_runner(package, device)
    extra = sorted(set(loader.get_constant_fqns()) - set(state))
    if extra and scheme_of(state) != "int4":
        raise PackageCheckFailed(f"{package}: constants {extra} not in the module", package=package,
                                 sizes=None, field="constants", value=extra, limit=sorted(state)[:3])
    return {name: {"dtype": "int64", "shape": [], "value": GROUP_SIZE} for name in extra}


def bind_derived(derived: Mapping[str, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """The tensors of :func:`derived_constants`' records (0-d int64 values)."""
    return {name: torch.tensor(int(rec["value"]), dtype=torch.int64) for name, rec in derived.items()}


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
        st = path.stat()
    except FileNotFoundError:
        raise InvalidCheckpoint(f"{path}: no package manifest", path=path, field=MANIFEST_NAME,
                                value=None, limit=None) from None
    if not stat.S_ISREG(st.st_mode):    # a FIFO would block the read forever
        raise InvalidCheckpoint(f"{path}: not a regular file", path=path, field=MANIFEST_NAME,
                                value=stat.filemode(st.st_mode), limit="a regular file")
    size = st.st_size
    if size > MAX_MANIFEST_BYTES:
        raise InvalidCheckpoint(f"{path}: {size} bytes exceeds {MAX_MANIFEST_BYTES}", path=path,
                                field=MANIFEST_NAME, value=size, limit=MAX_MANIFEST_BYTES)
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidCheckpoint(f"{path}: not valid JSON ({type(exc).__name__}: {exc})",
                                path=path, field=MANIFEST_NAME, value=None, limit=None) from None
    if not isinstance(manifest, dict) or "format" not in manifest:
        raise InvalidCheckpoint(f"{path}: missing 'format'", path=path, field="format",
                                value=None, limit=PACKAGE_FORMAT)
    if manifest["format"] != PACKAGE_FORMAT:
        raise InvalidCheckpoint(f"{path}: format {manifest['format']!r} is not {PACKAGE_FORMAT} "
                                "(built by an older rewarm: run `rewarm build` again)",
                                path=path, field="format", value=manifest["format"],
                                limit=PACKAGE_FORMAT)
    for key in ("target", "digest", "constants", "max_seqs", "max_seq_len", "config", "ranges", "kv"):
        if key not in manifest:
            raise InvalidCheckpoint(f"{path}: missing {key!r}", path=path, field=key,
                                    value=None, limit=None)
    parse_ranges(manifest["ranges"], path)
    return manifest


def forward_source_digest() -> str:
    """sha256 (hex) over the bytes of :data:`FORWARD_SOURCES`, in that order: recorded in
    ``package.json`` as ``source``, so a package compiled from other forward code (an older
    rewarm) is told apart from one this code would build."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in FORWARD_SOURCES:
        h.update(name.encode() + b"\0" + (here / name).read_bytes())
    return h.hexdigest()


def find_package(release_dir: Path, device: str = "cpu") -> Path:
    """The package directory for this machine in a release (or ``release_dir`` itself when it is
    one).  Raises TargetMismatch naming the targets built and this one when none matches,
    InvalidCheckpoint when its manifest is malformed or of another format (an old build), and
    FileNotFoundError when the release holds no package at all."""
    release_dir = Path(release_dir)
    if (release_dir / MANIFEST_NAME).exists():
        read_package_manifest(release_dir)
        return release_dir
    here = current_target(device)
    candidate = release_dir / target_dirname(here)
    if (candidate / MANIFEST_NAME).exists():
        read_package_manifest(candidate)
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
    v_caches, logit_pos [B,K] int64) -> logits [B,K,V] float32``; the caches are written in
    place.  Every call is
    checked first against what the package was compiled for (``spec``: ranks, each dynamic size
    against its recorded range, fixed sizes, dtypes, device, index values); a wrong one raises
    PackageInputError and runs nothing, so the package serves the next call as before.
    Holds ``weights`` so the bound tensors outlive the compiled model (user-managed constants).
    """

    path: Path
    manifest: dict[str, Any]
    weights: Mapping[str, torch.Tensor] = field(repr=False)
    model: Any = field(repr=False)
    spec: InputSpec = field(repr=False)

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def target(self) -> str:
        return self.manifest["target"]

    @property
    def ranges(self) -> dict[str, tuple[int, int]]:
        return dict(self.spec.ranges)

    def __call__(self, tokens, input_pos, cache_batch_idx, k_caches, v_caches,
                 logit_pos) -> torch.Tensor:
        self.spec.check(tokens, input_pos, cache_batch_idx, k_caches, v_caches, logit_pos)
        # The exported signature flattens to [tokens, input_pos, cache_batch_idx, *k, *v,
        # logit_pos] (checked at load: check_call_spec) and returns [logits]; boxed_run takes
        # ownership of the list it is given.
        return self.model.boxed_run([tokens, input_pos, cache_batch_idx, *k_caches, *v_caches,
                                     logit_pos])[0]


def check_call_spec(loader: Any, layers: int, package: Path) -> None:
    """Raise InvalidCheckpoint unless the compiled call of ``loader`` (an
    ``AOTIModelPackageLoader``) takes :data:`FORWARD_INPUTS`: positional tensors, the KV caches
    as two lists of ``layers`` tensors, no keyword inputs.  Read from the package's own input
    spec (``get_call_spec()[0]``: the pytree spec torch.export flattened the example inputs
    by, which torch's own ``AOTICompiledModel`` also reads, torch/export/pt2_archive/_package.py),
    so a package compiled from a forward of another signature is refused before any call,
    whatever its ``package.json`` says."""
    from torch.utils import _pytree as pytree

    leaf = 0
    want = pytree.tree_flatten(((leaf, leaf, leaf, [leaf] * layers, [leaf] * layers, leaf), {}))[1]
    try:
        text = loader.get_call_spec()[0]
        got = pytree.treespec_loads(text)
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise InvalidCheckpoint(f"{package}: its call spec cannot be read ({type(exc).__name__}: "
                                f"{exc})", path=package, field="inputs", value=None,
                                limit=FORWARD_INPUTS) from None
    if got != want:
        have, need = _describe_inputs(text), _describe_inputs(pytree.treespec_dumps(want))
        raise InvalidCheckpoint(
            f"{package}: compiled for inputs ({have}) where this rewarm's forward takes "
            f"{', '.join(FORWARD_INPUTS)} ({need}): built by another rewarm, run `rewarm build` "
            "again", path=package, field="inputs", value=have, limit=need)


def _describe_inputs(spec_json: str) -> str:
    """The positional inputs of a serialized call spec (``torch.utils._pytree.treespec_dumps``
    JSON: ``[protocol, {"type", "context", "children_spec"}]``, the arguments first), e.g.
    ``tensor, tensor, list of 30 tensors``; the raw text's start when it is not that."""

    def node(spec: Any) -> str:
        kids = spec.get("children_spec") or []
        if spec.get("type") is None:
            return "tensor"
        name = str(spec["type"]).rsplit(".", 1)[-1]
        if kids and all(k.get("type") is None for k in kids):
            return f"{name} of {len(kids)} tensors"
        return f"{name}({', '.join(node(k) for k in kids)})"

    try:
        args = json.loads(spec_json)[1]["children_spec"][0]
        return ", ".join(node(k) for k in args["children_spec"])
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return spec_json[:120]


def load_package(path: Path, weights: Mapping[str, torch.Tensor], *, device: str = "cpu",
                 expect_digest: str | None = None) -> PackagedForward:
    """Load the package at ``path`` (a package directory or a release) and bind ``weights``.

    ``weights`` is the runtime layout (agent/replica/model.py), e.g. ``Restored.tensors``; the
    tensors are used in place (no copy) and must stay alive as long as the result.
    Raises TargetMismatch (built for another target; checked before any code is loaded),
    WeightSchemeMismatch (built for weights stored another way, agent/replica/quant.py),
    InvalidCheckpoint (an older format, :data:`PACKAGE_FORMAT`; digest differs from the manifest
    or ``expect_digest``; a weight missing or of another shape or dtype, naming the tensor and
    both values; compiled for other inputs than :data:`FORWARD_INPUTS`,
    :func:`check_call_spec`; the manifest's ranges differ from those compiled into the package).
    """
    package_dir = find_package(Path(path), device)
    manifest = read_package_manifest(package_dir)
    spec = InputSpec.from_manifest(manifest, device, package_dir)
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
    from agent.replica.quant import scheme_of

    built, here = manifest.get("weight_scheme", "dense"), scheme_of(weights)
    if built != here:
        raise WeightSchemeMismatch(f"{package_dir}: package built for {built!r} weights; these "
                                   f"weights are {here!r}", package=package_dir, built=built,
                                   here=here)
    bound: dict[str, torch.Tensor] = {}
    for name, want in manifest["constants"].items():
        tensor = weights.get(name)
        if tensor is None:
            raise InvalidCheckpoint(f"weight {name!r} needed by {package} is missing", path=package,
                                    field=name, value=None, limit=want["shape"])
        if list(tensor.shape) != want["shape"] or str(tensor.dtype).removeprefix("torch.") != want["dtype"]:
            raise InvalidCheckpoint(
                f"weight {name!r}: {tuple(tensor.shape)} {tensor.dtype} does not match the package's "
                f"{tuple(want['shape'])} {want['dtype']}", path=package, field=name,
                value=(tuple(tensor.shape), str(tensor.dtype)), limit=(tuple(want["shape"]), want["dtype"]))
        bound[name] = tensor if tensor.is_contiguous() else tensor.contiguous()
    # The C++ loader directly: torch._inductor.aoti_load_package would first import the whole
    # of Inductor (seconds of Python imports at every boot) only to wrap this same object.
    model = load_runner(package, device)
    check_call_spec(model, spec.layers, package)
    compiled = model.get_metadata().get(RANGES_METADATA)
    try:
        same = compiled is not None and parse_ranges(json.loads(compiled), package) == spec.ranges
    except (json.JSONDecodeError, InvalidCheckpoint):
        same = False
    if not same:
        raise InvalidCheckpoint(f"{package}: compiled ranges {compiled} are not the manifest's "
                                f"{manifest['ranges']}", path=package, field="ranges",
                                value=compiled, limit=manifest["ranges"])
    bound.update(bind_derived(manifest.get("derived_constants") or {}))
    unknown = set(model.get_constant_fqns()) - set(bound)
    if unknown:
        raise InvalidCheckpoint(f"{package}: constants {sorted(unknown)[:3]} not in its manifest",
                                path=package, field=sorted(unknown)[0], value=None, limit=None)
    # (map, use_inactive, check_full_update, user_managed, allow_h2d_copy)
    model.load_constants(bound, False, True, True, False)
    return PackagedForward(path=package_dir, manifest=manifest, weights=bound, model=model,
                           spec=spec)
