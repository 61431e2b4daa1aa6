"""The very first boot: prefill the first request while the weights are still streaming in.

A model version with no snapshot anywhere pays one full boot, and that boot streams.  A loader thread reads the safetensors group by group (embedding, layer 0 ... layer
L-1, final norm/head; :func:`agent.replica.weights.stream_hf_weights`), converting each to the
runtime layout as it lands; the calling thread runs the first request's prefill through each
layer as soon as that layer is there.  The first token is ready when the last group lands plus
one layer's compute, instead of after the whole load *and* the whole prefill.

The prefill writes the KV cache of slot 0 exactly as :meth:`Engine.step` would, and the engine
built at the end adopts that sequence, so decoding continues without redoing the prompt.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from pathlib import Path
from collections.abc import Sequence

import torch

from agent.replica.config import LlamaConfig
from agent.replica.engine import Engine
from agent.replica.model import Transformer, TransformerBlock, live_context, new_kv_caches
from agent.replica.quant import adopt_quantized
from agent.replica.weights import stream_hf_weights


@dataclasses.dataclass
class FirstBoot:
    """What :func:`streamed_first_boot` returns.  ``seq_id`` is the adopted first request."""

    engine: Engine
    seq_id: int
    first_token: int
    first_token_s: float          # from the call to the first token
    load_done_s: float            # from the call to the last weight group landing


def _block(config: LlamaConfig, i: int, tensors: dict[str, torch.Tensor]) -> TransformerBlock:
    with torch.device("meta"):
        block = TransformerBlock(config)
    prefix = f"layers.{i}."
    own = {k[len(prefix):]: v for k, v in tensors.items()}
    adopt_quantized(block, own)   # int4/int8 weights: the quantized linears (agent/replica/quant.py)
    block.load_state_dict(own, assign=True, strict=True)
    return block.eval()


def _embedding(config: LlamaConfig, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The token embedding of the ``embed`` group: dense, or int8 rows with their scales."""
    with torch.device("meta"):
        holder = torch.nn.Module()
        holder.tok_embeddings = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    adopt_quantized(holder, tensors)
    holder.load_state_dict({k: v for k, v in tensors.items() if k.startswith("tok_embeddings.")},
                           assign=True, strict=True)
    return holder.tok_embeddings


def streamed_first_boot(model_dir: Path | str, prompt: Sequence[int], max_tokens: int, *,
                        max_seqs: int, max_seq_len: int, seed: int | None = None,
                        stop: set[int] | None = None, config: LlamaConfig | None = None) -> FirstBoot:
    """Load ``model_dir`` while prefilling ``prompt`` (token ids [S]) layer by layer.

    Returns the engine (every weight loaded, the first request active in slot 0 with its first
    token already sampled).  Raises what :func:`stream_hf_weights` raises (InvalidCheckpoint),
    from the loader thread, and what :meth:`Engine.submit` raises for the request.
    """
    t0 = time.perf_counter()
    config = config or LlamaConfig.from_dir(model_dir)
    landed: queue.Queue = queue.Queue()

    def load() -> None:
        try:
            for group, tensors in stream_hf_weights(model_dir, config):
                landed.put((group, tensors))
            landed.put(("done", None))
        except BaseException as exc:  # handed to the caller's thread
            landed.put(("error", exc))

    threading.Thread(target=load, name="weights-stream", daemon=True).start()

    def next_group() -> tuple[str, dict]:
        group, tensors = landed.get()
        if group == "error":
            raise tensors
        return group, tensors

    weights: dict[str, torch.Tensor] = {}
    k_caches, v_caches = new_kv_caches(config, max_seqs, max_seq_len)
    tokens = torch.tensor([list(prompt)], dtype=torch.int64)
    pos = torch.arange(len(prompt)).unsqueeze(0)
    idx = torch.zeros(1, dtype=torch.int64)
    with torch.device("meta"):
        shell = Transformer(config)  # RoPE/mask/head helpers only; no weights of its own
    cos, sin = shell.rope_cos_sin(pos)
    mask = shell.causal_mask(pos, live_context(pos, max_seq_len))   # [1, 1, S, L]
    h = None
    with torch.inference_mode():
        while True:
            group, tensors = next_group()
            if group == "done":
                break
            weights.update(tensors)
            if group == "embed":
                h = _embedding(config, tensors)(tokens)
            elif group.startswith("layer.") and h is not None:
                i = int(group.split(".")[1])
                h = _block(config, i, tensors)(h, cos, sin, pos, idx, k_caches[i], v_caches[i], mask)
    load_done_s = time.perf_counter() - t0
    engine = Engine(config, weights, max_seqs=max_seqs, max_seq_len=max_seq_len)
    engine.k_caches, engine.v_caches = k_caches, v_caches
    assert engine.model is not None and h is not None, "built from weights; the plan has layers"
    with torch.inference_mode():
        logits = engine.model.head(h)[0, -1]
    seq_id, token = engine.adopt_prefilled(list(prompt), logits, max_tokens, seed=seed, stop=stop)
    return FirstBoot(engine, seq_id, token, time.perf_counter() - t0, load_done_s)
