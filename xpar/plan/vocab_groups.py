"""The planner's candidates where the framework pads the vocabulary (framework.make_vocab_size_divisible_by:
Megatron-LM's 128 x tp, xpar.config.vocab): the padded vocabulary depends on each candidate's tp,
while the vectorised cost model (xpar.plan.vtime, xpar.plan.vmemory) prices every candidate with one
model. The candidates are grouped by their padded vocabulary and each group evaluated with the
model at that size (padding a padded vocabulary changes nothing), so the figures stay equal to
:func:`xpar.estimate.cost.estimate` on each candidate's validated RunSpec.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from xpar.config.vocab import padded_vocab


def vocab_columns(ctx, cols: dict[str, np.ndarray]) -> np.ndarray:
    """The padded vocabulary of each candidate (rows), from its tp column."""
    multiple = (ctx.framework or {}).get("make_vocab_size_divisible_by")
    vocab = int(ctx.model["vocab_size"])
    return np.array([padded_vocab(vocab, multiple, int(t)) for t in np.asarray(cols["tp"])], dtype=np.int64)


def needs_groups(ctx, cols: dict[str, np.ndarray]) -> bool:
    """Whether any candidate's padded vocabulary differs from the model's."""
    return bool(len(cols["tp"])) and bool((vocab_columns(ctx, cols) != int(ctx.model["vocab_size"])).any())


def evaluate_by_vocab(ctx, cols: dict[str, np.ndarray], evaluate: Callable) -> dict[str, np.ndarray]:
    """``evaluate(ctx, cols)`` once per padded vocabulary, with ``ctx.model`` at that size, joined
    back in the candidates' order (same keys and dtypes as ``evaluate``'s)."""
    vocab = vocab_columns(ctx, cols)
    out: dict[str, np.ndarray] = {}
    for v in np.unique(vocab):
        idx = np.flatnonzero(vocab == v)
        sub = {k: np.asarray(c)[idx] for k, c in cols.items()}
        res = evaluate(replace(ctx, model=dict(ctx.model, vocab_size=int(v))), sub)
        for k, x in res.items():
            x = np.asarray(x)
            if k not in out:
                out[k] = np.zeros(len(vocab), dtype=x.dtype) if x.dtype.kind != "U" else np.asarray(cols.get(k, x)).copy()
            out[k][idx] = x
    return out
