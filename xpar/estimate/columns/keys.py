"""Helpers of the cost model's column orchestration (xpar.estimate.columns.step_time, re-exported there): a
candidate's spec as the scalar functions read it (:func:`spec_at`), and a function evaluated once per distinct
key of some columns (:func:`by_key`, :func:`per_slot`). No torch import.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from xpar.config.layout import Layout
from xpar.config.spec import RunSpec, with_fields
from xpar.estimate.columns.stage_split import plan_split


def spec_at(base: RunSpec, tp: int, pp: int, dp: int, b: int, m: int, v: int, schedule: str, zero: int,
            sp: bool, recompute: str) -> RunSpec:
    """``base`` with another layout, as the scalar functions read it: the layout and the micro-batch
    size. Its pp x v stages split as ``base``'s where it has as many (a
    layout's own split: :func:`xpar.estimate.columns.one_layout.layout_step`), else as
    :func:`xpar.estimate.columns.stage_split.plan_split` (even, else lighter ends)."""
    own = base.layout.layer_split
    split = tuple(own) if len(own) == pp * v else tuple(plan_split(base.model.n_layers, pp * v))
    layout = Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=b, micro_batches=m, seq_len=base.seq_len,
                    layer_split=split, schedule=schedule, zero_stage=zero,
                    sequence_parallel=sp, recompute=recompute, ep=base.layout.ep, etp=base.layout.etp)
    train = with_fields(base.train, micro_batch_size=b, global_batch_size=b * m * dp)
    return with_fields(base, train=train, layout=layout)


def by_key(columns: list[np.ndarray], fn: Callable[..., dict], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """``fn(*key)`` once per distinct row of ``columns`` (plain Python values), each of its
    ``names`` broadcast back to every row (float64 arrays)."""
    first, inverse = unique_rows(_combined(columns))
    keys = zip(*(c[first].tolist() for c in columns))
    values = [fn(*k) for k in keys]
    return {k: np.array([x[k] for x in values], dtype=np.float64)[inverse] for k in names}


def per_slot(columns: list[np.ndarray], fn: Callable[..., dict], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """:func:`by_key` over slot-and-layout columns (each shape (S, L) or (L,) for every slot; S:
    :data:`SLOTS`, or a layout's pipeline ranks), one call for all slots; results shaped (S, L)."""
    shape = np.broadcast_shapes(*(np.shape(c) for c in columns))
    flat = [np.broadcast_to(c, shape).ravel() for c in columns]
    return {k: x.reshape(shape) for k, x in by_key(flat, fn, names).items()}


def unique_rows(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first index of each distinct key in increasing key order, each row's position in that
    list): numpy.unique's return_index and return_inverse for non-negative int keys; by
    direct indexing (no sort) when the keys are below 4 L + 1024."""
    key = np.asarray(key, dtype=np.int64)
    top = int(key.max(initial=0)) + 1
    if top > 4 * len(key) + 1024:
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        return first, inverse
    first = np.full(top, len(key), dtype=np.int64)
    np.minimum.at(first, key, np.arange(len(key)))
    present = first < len(key)
    return first[present], (np.cumsum(present) - 1)[key]


def _combined(columns: list[np.ndarray]) -> np.ndarray:
    """One non-negative int64 key per row, equal for rows equal in every column (small-range
    int columns by offset, others by their rank among the column's values)."""
    key = np.zeros(len(columns[0]), dtype=np.int64)
    for c in columns:
        lo = int(c.min()) if c.dtype.kind in "biu" and len(c) else 0
        if c.dtype.kind in "biu" and int(c.max(initial=0)) - lo < 4 * len(c) + 1024:
            code = c.astype(np.int64) - lo
        else:
            _, code = np.unique(c, return_inverse=True)
        radix = int(code.max(initial=0)) + 1
        if int(key.max(initial=0)) * radix >= 2 ** 62:  # renumber before the key overflows
            _, key = unique_rows(key)
        key = key * radix + code
    return key
