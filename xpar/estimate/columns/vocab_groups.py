"""The planner's candidates where the framework pads the vocabulary (framework.make_vocab_size_divisible_by:
Megatron-LM's 128 x tp, xpar.config.vocab): the padded vocabulary depends on each candidate's tp,
while the vectorised cost model (xpar.plan.vtime, xpar.plan.vmemory) prices every candidate with one
base model. The candidates are grouped by their padded vocabulary and each group priced with the
model at that size (padding a padded vocabulary again changes nothing), so the figures stay equal
to :func:`xpar.estimate.cost.estimate` on each candidate's validated RunSpec.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import numpy as np

from xpar.config.vocab import padded_vocab


def padded_column(vocab: int, multiple: Optional[int], tp: np.ndarray) -> np.ndarray:
    """The padded vocabulary of each candidate (rows), from its tp column (once per distinct tp)."""
    degrees, inverse = np.unique(np.asarray(tp), return_inverse=True)
    return np.array([padded_vocab(vocab, multiple, int(t)) for t in degrees], dtype=np.int64)[inverse.ravel()]


def _join(parts: list[tuple[np.ndarray, dict]], n: int) -> dict[str, np.ndarray]:
    """Per-group result dicts (row indices, arrays) joined back in the candidates' order."""
    out: dict[str, np.ndarray] = {}
    for idx, res in parts:
        for k, x in res.items():
            x = np.asarray(x)
            if k not in out:
                out[k] = np.empty(n, dtype=x.dtype) if x.dtype.kind != "U" else np.empty(n, dtype=object)
            out[k][idx] = x
    return {k: (v.astype(str) if v.dtype == object else v) for k, v in out.items()}


def columns_by_vocab(base, cols: dict[str, np.ndarray], fn: Callable, *rows) -> Optional[dict[str, np.ndarray]]:
    """``fn(base, cols, *rows)`` (xpar.plan.vtime.time_columns, xpar.plan.vmemory.memory_columns) once per
    padded vocabulary, ``base.model`` at that size and ``rows`` (arrays per candidate, or None) cut to
    the group, joined; None where every candidate runs ``base``'s vocabulary."""
    raw = getattr(base, "vocab_unpadded", None)
    if raw is None or not len(cols["tp"]):
        return None
    vocab = padded_column(raw, base.framework.make_vocab_size_divisible_by, cols["tp"])
    if (vocab == base.model.vocab_size).all():
        return None
    parts = []
    for v in np.unique(vocab):
        idx = np.flatnonzero(vocab == v)
        part = replace(base, model=replace(base.model, vocab_size=int(v)))
        parts.append((idx, fn(part, {k: np.asarray(c)[idx] for k, c in cols.items()},
                              *(None if x is None else np.asarray(x)[idx] for x in rows))))
    return _join(parts, len(vocab))
