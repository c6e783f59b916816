"""One layout as a column of length one: the step time of :func:`xpar.estimate.cost.estimate`
through the planner's own orchestration (:func:`xpar.estimate.columns.step_time.slot_step`), with
every pipeline rank a slot of its own (its blocks from the layout's split, whatever the split).
Units: seconds. No torch import.
"""
from __future__ import annotations

import numpy as np

from xpar.config.spec import RunSpec
from xpar.estimate.columns.act_offload import offload_column
from xpar.estimate.columns.step_time import Step, candidate_rows, slot_step
from xpar.estimate.step_parts import Assumptions


def layout_columns(spec: RunSpec) -> dict[str, np.ndarray]:
    """``spec``'s layout as candidate columns of length one (the keys of :mod:`xpar.plan.context`'s
    columns: degrees, micro-batch size and count, v, ZeRO stage, sp, schedule, recompute)."""
    lay = spec.layout
    b = spec.train.micro_batch_size
    return {"tp": np.array([lay.tp]), "pp": np.array([lay.pp]), "dp": np.array([lay.dp]),
            "b": np.array([b], dtype=np.float64 if isinstance(b, float) else np.int64),
            "m": np.array([lay.micro_batches]), "v": np.array([lay.virtual_stages]), "zero": np.array([lay.zero_stage]),
            "sp": np.array([lay.sequence_parallel]), "schedule": np.array([lay.schedule]),
            "recompute": np.array([lay.recompute])}


def layout_slots(spec: RunSpec) -> dict[str, np.ndarray]:
    """Every pipeline rank of ``spec`` as a slot (axis 0, shape (pp, 1)): the rank, whether it holds
    the first / last stage, count 1 and its blocks (``Layout.layers_of``); ``by_rank`` marks that a
    slot is the rank itself (xpar.estimate.columns.mixed_blocks.UnitTimes)."""
    lay = spec.layout
    ranks = range(lay.pp)
    col = lambda values, dtype: np.array(list(values), dtype=dtype)[:, None]  # noqa: E731
    return {"rank": col(ranks, np.int64), "first": col((lay.has_first_stage(r) for r in ranks), bool),
            "last": col((lay.has_last_stage(r) for r in ranks), bool), "count": np.ones((lay.pp, 1), np.int64),
            "n": col((lay.layers_of(r) for r in ranks), np.int64), "by_rank": True}


def layout_step(spec: RunSpec, assume: Assumptions, optimizer_bytes: float, optimizer_elements: float,
                grad_bytes: float) -> Step:
    """The :class:`xpar.estimate.columns.step_time.Step` of ``spec`` (a cp-folded layout: cp = 1) under
    ``assume``, its arrays of length one, ``slot`` the slowest pipeline rank. ``optimizer_bytes``,
    ``optimizer_elements``, ``grad_bytes``: the memory model's optimizer states, optimizer elements
    and gradients on the most loaded device (bytes, elements), for the optimizer term."""
    cols = layout_columns(spec)
    r = candidate_rows(cols, assume.cpu_offload_optimizer)
    _, r["act_offload"] = offload_column(spec, cols)  # parallel.activation_offload_layers
    return slot_step(spec, assume, cols, r, layout_slots(spec), np.array([float(optimizer_bytes)]),
                     np.array([float(optimizer_elements)]), np.array([float(grad_bytes)]))
