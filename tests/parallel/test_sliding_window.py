"""Sliding-window attention executed (issue 42): the tiny model's local layers attend within the band (causal and
within the window) in one process and under context parallelism, and an executed run with a window equals the
single-process reference (xpar.run.reference.reference_run), as tests/parallel/test_context_parallel.py checks."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import spawn, spec_for
from tests.parallel.test_clipping import _norms as _train
from xpar.config.schema import ModelConfig
from xpar.models.transformer import Transformer, causal_attention

WINDOW = ["model=tiny", "train.steps=3", "train.warmup_steps=1", "parallel.micro_batches=2",
          "model.sliding_window=8", "model.sliding_window_pattern=2"]
RUNS = {"dp2": ["parallel.dp=2"], "cp2": ["parallel.dp=1", "parallel.cp=2"]}


def _explicit(q, k, v, window):
    """Softmax attention written out: scores over keys j with i - window < j <= i, grouped K/V repeated."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    S = q.shape[2]
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~((j <= i) & (j > i - window)), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_windowed_core_is_softmax_over_the_band(window):
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(2, n, 24, 8, generator=g) for n in (4, 2, 2))
    torch.testing.assert_close(causal_attention(q, k, v, window=window), _explicit(q, k, v, window))


def test_local_layers_change_the_output_and_a_window_over_the_sequence_does_not():
    """The tiny model with windows of 4 on every other layer differs from full attention; with windows of the
    whole sequence it is the same function. Only the local blocks carry a window."""
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for w in (0, 4, 32):
        m = Transformer(ModelConfig(sliding_window=w, sliding_window_pattern=2 if w else 0))
        m.init_weights(0)
        out[w] = m(x)
        assert [b.attention.window for b in m.layers.values()] == ([w, 0, w, 0] if w else [0] * 4)
    assert not torch.allclose(out[4], out[0]) and torch.allclose(out[32], out[0], atol=1e-6)


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_ranks_attend_within_the_window(cp):
    """Each cp rank's queries at their global positions over the gathered K/V give its rows of the windowed
    attention of the whole sequence."""
    from xpar.parallel.context import attend_local_queries, order_chunks, shard_sequence

    g = torch.Generator().manual_seed(cp)
    S = 12 * cp
    q, k, v = (torch.randn(2, n, S, 8, generator=g) for n in (4, 2, 2))
    full = causal_attention(q, k, v, window=5)
    shard = lambda t: [shard_sequence(t.transpose(1, 2), cp, r).transpose(1, 2) for r in range(cp)]
    k_all, v_all = order_chunks(shard(k), cp), order_chunks(shard(v), cp)
    for r in range(cp):
        torch.testing.assert_close(attend_local_queries(shard(q)[r], k_all, v_all, cp, r, window=5), shard(full)[r],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_executed_runs_with_a_window_equal_the_reference():
    """dp 2 and cp 2 on 2 workers, 3 steps of the tiny model with windows of 8 on every other layer: the loss and
    every rank's gradient norm equal the single-process reference's (fp32: relative 1e-4)."""
    from xpar.run.reference import reference_run

    specs = {k: spec_for(*WINDOW, *v) for k, v in RUNS.items()}
    out = dict(zip(RUNS, spawn(_train, 2, [specs[k].to_dict() for k in RUNS])))
    for name, spec in specs.items():
        assert spec.model.sliding_window == 8, name
        ref = reference_run(spec)
        for step in range(3):
            seen = [r[0][step] for r in out[name] if r[0][step] is not None]
            assert seen and sum(seen) / len(seen) == pytest.approx(ref["losses"][step], rel=1e-4), (name, step)
        for rank, (_, norms, _) in enumerate(out[name]):
            assert norms == pytest.approx(ref["grad_norms"], rel=1e-4), (name, rank)
