"""No recompiles in steady state: torch.compile with the four dynamic dims marked, warmed up
once (Engine.warmup), then every batch size 1..max and every length 1..max, with the logits of
the last position (serving) and of every position (the golden replay), runs on the graphs
already compiled, counted with torch's recompile log and dynamo's graph counter.

The backend is ``aot_eager`` by default: dynamo's guards and AOT autograd are the real ones, only
Inductor's code generation is skipped (it costs ~35 s per graph on the 2 shared CI cores).
``REWARM_RECOMPILE_BACKEND=inductor`` runs the same test through Inductor (passes; ~2.5 min).
"""

import logging
import os

import pytest
import torch
from torch._dynamo.utils import counters

from agent.replica.engine import Engine, jit_forward
from agent.replica.model import every_position, last_positions
from agent.replica.synthetic import preset_config, synthetic_tensors

pytestmark = pytest.mark.slow
MAX_SEQS, MAX_SEQ_LEN = 4, 12


class RecompileLog(logging.Handler):
    """Collects torch's recompile log records (TORCH_LOGS=recompiles)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def test_every_batch_and_length_after_warmup_without_recompiling(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    counters.clear()   # reset() keeps dynamo's counters: graphs compiled by earlier tests count
    torch._logging.set_logs(recompiles=True)
    log = RecompileLog()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(log)
    try:
        config = preset_config("tiny")
        weights = synthetic_tensors(config, seed=0)
        eager = Engine(config, weights, max_seqs=MAX_SEQS, max_seq_len=MAX_SEQ_LEN)
        engine = Engine(config, weights, max_seqs=MAX_SEQS, max_seq_len=MAX_SEQ_LEN,
                        forward=jit_forward(eager.model, backend=os.environ.get("REWARM_RECOMPILE_BACKEND", "aot_eager")))
        assert engine.warmup() == 6
        graphs = counters["stats"]["unique_graphs"]
        warm_log = len(log.records)
        assert 1 <= graphs <= 6
        # every active batch 1..MAX_SEQS and every new-token count 1..MAX_SEQ_LEN
        for b in range(1, MAX_SEQS + 1):
            for s in range(1, MAX_SEQ_LEN + 1):
                with torch.inference_mode():  # inputs made as the engine makes them
                    tokens = torch.randint(0, config.vocab_size, (b, s))
                    pos = torch.arange(s).repeat(b, 1)
                    idx = torch.arange(MAX_SEQS - b, MAX_SEQS)
                    for picked in (last_positions([s] * b), every_position(b, s)):
                        got = engine.forward(tokens, pos, idx, engine.k_caches, engine.v_caches,
                                             picked)
                        want = eager.forward(tokens, pos, idx, eager.k_caches, eager.v_caches,
                                             picked)
                        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
        # the engine's own mix of prefill (B=1) and batched decode (S=1)
        prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
        assert engine.generate(prompts, 6) == eager.generate(prompts, 6)
        recompiles = [m for m in log.records[warm_log:] if "Recompiling" in m or "guard" in m]
        assert recompiles == []
        assert counters["stats"]["unique_graphs"] == graphs
        recompiles = [m for m in log.records[warm_log:] if "Recompiling" in m]
        assert recompiles == []
    finally:
        logger.removeHandler(log)
        torch._logging.set_logs()
        torch._dynamo.reset()
