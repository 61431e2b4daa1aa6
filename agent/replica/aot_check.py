"""The check every AOT build ends with: the package run at the edges of its ranges, against eager.

``rewarm build`` compiles one package for all four dynamic sizes (agent/replica/aot.py).  A
range that the compiler narrowed (e.g. a guard ``S != 1`` from a stride comparison) or code
that is wrong at one of its edges would otherwise show only when a replica serves; so before
the package is published it runs, with AOTInductor's own input checks on
(``AOTI_RUNTIME_CHECK_INPUTS=1``), at:

    every minimum          B = lo,  S = lo,  C = lo,  K = lo   (a one-token step of a one-slot cache)
    the longest prefill    B = lo,  S = hi,  C = lo,  K = lo   (a whole slot in one call, its
                                                                last position's logits)
    the longest replay     B = lo,  S = hi,  C = lo,  K = hi   (the same call, logits at hi
                                                                positions drawn from [0, S))
    the fullest decode     B = hi,  S = lo,  C = hi,  K = lo   (every slot, one token each)

which covers the minimum and the maximum of each of batch, sequence length, cache batch and
logit positions (K, ``"logits"``, compiled over S's range), with K = 1 at S > 1 as serving's
prefill calls run it.  Each run starts from the same seeded, non-zero caches (so masking
matters).  The package must
be as accurate as eager: its logits' and cache writes' largest error against a float64 run of
the same eager module may be at most ``MULTIPLIER`` times eager's own error plus a floor of
``FLOOR`` (relative to the largest reference logit) -- the rule torch uses to judge compiled
code (``torch._dynamo.utils.same`` with an fp64 reference: multiplier 2 or 3, tol/10), since a
fixed tolerance is either loose for a small model or tight for a deep one (SmolLM2's 30 layers
turn reordered float32 sums into ~1e-4 relative differences).  Failure raises
:class:`~agent.errors.PackageCheckFailed`; the build then publishes nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Mapping

import torch

from agent.errors import PackageCheckFailed

CHECK_ENV = "AOTI_RUNTIME_CHECK_INPUTS"
SEED = 20240601


def load_runner(package: Path, device: str = "cpu") -> Any:
    """The package's runner: ``AOTIModelPackageLoader(path, model_name, run_single_threaded,
    num_runners, device_index)`` (torch/csrc/inductor/aoti_package/pybind.cpp) with one
    runner, not single-threaded (its container takes a lock per run), on ``device``'s index
    (-1 for the CPU and for an unnumbered "cuda": the current device, which a worker's
    CUDA_VISIBLE_DEVICES makes its own GPU).  Raises RuntimeError when the package cannot be
    loaded (a zip it cannot read, a device it was not built for)."""
    index = torch.device(device).index
    return torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1,
                                                 -1 if index is None else index)


def corner_sizes(ranges: Mapping[str, tuple[int, int]]) -> list[dict[str, int]]:
    """The four size combinations of the module docstring (B <= C in each; ``"logits"`` is K,
    over ``ranges[aot_inputs.LOGITS_RANGE]``)."""
    from agent.replica.aot_inputs import LOGITS_RANGE

    (b_lo, b_hi), (s_lo, s_hi), (c_lo, c_hi) = (ranges[k] for k in ("batch", "seq", "cache_batch"))
    k_lo, k_hi = ranges[LOGITS_RANGE]
    return [{"batch": b_lo, "seq": s_lo, "cache_batch": max(c_lo, b_lo), "logits": k_lo},
            {"batch": b_lo, "seq": s_hi, "cache_batch": max(c_lo, b_lo), "logits": k_lo},
            {"batch": b_lo, "seq": s_hi, "cache_batch": max(c_lo, b_lo), "logits": k_hi},
            {"batch": min(b_hi, c_hi), "seq": s_lo, "cache_batch": c_hi, "logits": k_lo}]


MULTIPLIER = 3.0
FLOOR = 1e-5


@contextlib.contextmanager
def input_checks_on() -> Iterator[None]:
    """Set AOTI_RUNTIME_CHECK_INPUTS=1 for packages loaded inside the block (the generated code
    reads it once, at a loaded package's first call) and restore the old value after."""
    old = os.environ.get(CHECK_ENV)
    os.environ[CHECK_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(CHECK_ENV, None)
        else:
            os.environ[CHECK_ENV] = old


def _inputs(config, sizes: Mapping[str, int], max_seq_len: int, device: str):
    """Seeded inputs at ``sizes``: ``((tokens, input_pos, idx, logit_pos), k, v)``; K = 1 asks
    for each row's last position (as serving does), a larger K for positions drawn from
    [0, S) with repeats (any order the gather must follow)."""
    from agent.replica.model import new_kv_caches

    b, s, c, n = sizes["batch"], sizes["seq"], sizes["cache_batch"], sizes["logits"]
    gen = torch.Generator().manual_seed(SEED + 1000 * b + 10 * s + c)
    tokens = torch.randint(0, config.vocab_size, (b, s), generator=gen)
    start = torch.randint(0, max_seq_len - s + 1, (b, 1), generator=gen)
    input_pos = start + torch.arange(s)
    idx = torch.randperm(c, generator=gen)[:b]
    k, v = new_kv_caches(config, c, max_seq_len)
    for cache in (*k, *v):
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))
    logit_pos = (torch.full((b, 1), s - 1, dtype=torch.int64) if n == 1
                 else torch.randint(0, s, (b, n), generator=gen))
    return tuple(x.to(device) for x in (tokens, input_pos, idx, logit_pos)), k, v


def _run(forward: Callable, inputs, k, v, device: str, dtype: torch.dtype | None = None):
    k = [c.clone().to(device, dtype) for c in k]
    v = [c.clone().to(device, dtype) for c in v]
    tokens, input_pos, idx, logit_pos = inputs
    with torch.inference_mode():
        logits = forward(tokens, input_pos, idx, k, v, logit_pos)
    return logits.double().cpu(), [c.double().cpu() for c in (*k, *v)]


def _error(got, got_caches, ref, ref_caches) -> tuple[float, float]:
    """Largest absolute error of the logits and of the written caches against the reference."""
    return (float((got - ref).abs().max()),
            max(float((a - b).abs().max()) for a, b in zip(got_caches, ref_caches, strict=True)))


def float64_reference(eager: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of ``eager``; for weight-only int4/int8 modules (agent/replica/quant.py)
    a dense float64 model over the same dequantized values, since the kernels take no float64."""
    import copy
    import dataclasses

    from agent.replica.model import Transformer
    from agent.replica.quant import dense_runtime, scheme_of

    state = dict(eager.state_dict())
    if scheme_of(state) == "dense":
        return copy.deepcopy(eager).double()
    assert isinstance(eager, Transformer), type(eager)   # quantized weights: a Transformer
    config = dataclasses.replace(eager.config, dtype="float32", weight_scheme="dense")
    return Transformer.from_weights(config, dense_runtime(state)).double()


def check_package(package: Path, eager: torch.nn.Module, weights: Mapping[str, torch.Tensor],
                  ranges: Mapping[str, tuple[int, int]], max_seq_len: int, *,
                  device: str = "cpu") -> list[dict[str, Any]]:
    """Run ``package`` (a model.pt2, weights bound from ``weights``), ``eager`` and a float64
    copy of ``eager`` (norms and softmax stay float32, as the module computes them) at
    :func:`corner_sizes` with input checks on.  Returns one record per run
    (sizes, ``error`` and ``eager_error`` of the logits against float64, ``limit``,
    ``seconds`` of the package's call).  Raises PackageCheckFailed naming the sizes and what
    was off (the package refusing the shape, its logits, or its cache writes)."""
    reference = float64_reference(eager)
    records = []
    with input_checks_on():
        loader = load_runner(package, device)
        names = set(loader.get_constant_fqns())
        loader.load_constants({n: t.contiguous() for n, t in weights.items() if n in names},
                              False, True, True, False)

        def packaged(tokens, input_pos, idx, k, v, logit_pos):
            return loader.boxed_run([tokens, input_pos, idx, *k, *v, logit_pos])[0]

        for sizes in corner_sizes(ranges):
            inputs, k, v = _inputs(eager.config, sizes, max_seq_len, device)
            started = time.perf_counter()
            try:
                got = _run(packaged, inputs, k, v, device)
            except RuntimeError as exc:
                raise PackageCheckFailed(
                    f"{package}: refused sizes {sizes} inside its ranges {dict(ranges)}: "
                    f"{str(exc).strip().splitlines()[0][:200]}", package=package, sizes=sizes,
                    field="shape", value=sizes, limit=dict(ranges)) from None
            seconds = time.perf_counter() - started
            ref = _run(reference, inputs, k, v, device, torch.float64)
            base = _error(*_run(eager, inputs, k, v, device), *ref)
            mine = _error(*got, *ref)
            floor = FLOOR * max(1.0, float(ref[0].abs().max()))
            for field, value, eager_value in (("logits", mine[0], base[0]),
                                              ("kv cache", mine[1], base[1])):
                limit = MULTIPLIER * eager_value + floor
                if not value <= limit:   # NaN fails too
                    raise PackageCheckFailed(
                        f"{package}: at sizes {sizes} the {field} are off the float64 reference "
                        f"by {value:.3g}, eager by {eager_value:.3g} (limit {limit:.3g})",
                        package=package, sizes=sizes, field=field, value=value, limit=limit)
            records.append({**sizes, "error": mine[0], "eager_error": base[0],
                            "limit": MULTIPLIER * base[0] + floor, "seconds": round(seconds, 3)})
    return records
