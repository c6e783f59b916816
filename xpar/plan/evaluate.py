"""The cost model over every candidate: step time and throughput
(:mod:`xpar.estimate.columns.step_time`) joined with memory per device
(:mod:`xpar.estimate.columns.peak_memory`), cp/ep/dtype candidates grouped by those degrees
(:mod:`xpar.estimate.columns.cp_ep`); every figure equals :func:`xpar.estimate.cost.estimate` on
each candidate's RunSpec, and its key comes from :mod:`xpar.estimate.terms`."""
from __future__ import annotations

from typing import Optional

import numpy as np

from xpar.estimate.columns.cp_ep import group_columns, group_keys, grouped, with_degrees
from xpar.estimate.columns.peak_memory import memory_columns
from xpar.estimate.columns.step_time import time_columns
from xpar.estimate.terms import AXIS_TIME_TERMS, SETTING_TIME_TERMS, time_key
from xpar.estimate.terms import PLAN_MEMORY_KEYS as MEMORY_KEYS
from xpar.estimate.terms import PLAN_TIME_KEYS as TIME_KEYS
from xpar.plan.context import PlanContext, spec_of


def evaluate(ctx: PlanContext, cols: dict[str, np.ndarray], bases: Optional[dict] = None) -> dict[str, np.ndarray]:
    """Candidate columns plus :data:`TIME_KEYS` and :data:`MEMORY_KEYS`, one entry per candidate
    (arrays of length L >= 1); with cp/ep degrees also ``time_<term>`` of the axis terms.
    ``fits`` compares with the usable memory (device memory less ``ctx.hardware['memory_headroom']``);
    ``host_fits`` whether an offloaded optimizer's states fit the node's host memory (True without
    offload). ``bases``: the validated specs of earlier calls on the same context (:func:`base_spec`), filled."""
    bases = {} if bases is None else bases
    if grouped(cols):  # cp, ep or dtype columns: grouped by them
        return evaluate_groups(ctx, cols, bases)
    base = base_spec(ctx, cols, 0, bases)
    if base.layout.cp != 1 or base.layout.ep != 1 or base.layout.etp:  # cached from a cp/ep group
        base = with_degrees(base, 1, 1, 0)
    out = dict(cols)
    mem = memory_columns(base, cols)
    out.update({k: np.asarray(mem[k]) for k in MEMORY_KEYS})
    res = time_columns(base, cols, out["memory_optimizer"], out["optimizer_elements"], out["memory_grads"])
    out.update({k: np.asarray(res[k]) for k in TIME_KEYS + setting_keys(cols)})
    return out


def base_spec(ctx: PlanContext, cols: dict[str, np.ndarray], i: int, bases: dict):
    """The validated spec of candidate ``i`` (:func:`xpar.plan.context.spec_of`, without activation offload) that
    the column model prices its dtype's candidates with (it reads the model, hardware, sequence, dtype and
    framework; the layout per candidate), once per dtype ('' without a dtype column) in ``bases``."""
    key = str(cols["dtype"][i]) if "dtype" in cols else ""
    if key not in bases:
        bases[key] = spec_of(ctx, {k: v for k, v in cols.items() if k != "act_offload"}, i)
    return bases[key]


def setting_keys(cols: dict[str, np.ndarray]) -> tuple[str, ...]:
    """The time columns of a setting the candidates carry: ``time_act_offload`` with the column ``act_offload``
    (xpar.plan.offload_fit)."""
    return tuple(map(time_key, SETTING_TIME_TERMS)) if "act_offload" in cols else ()


def evaluate_groups(ctx: PlanContext, cols: dict[str, np.ndarray], bases: dict) -> dict[str, np.ndarray]:
    """:func:`evaluate` of candidates with cp, ep or dtype columns: each (cp, ep, dtype) group's
    figures from :func:`xpar.estimate.columns.cp_ep.group_columns` on a validated spec of the
    group (one validation per dtype, milliseconds each)."""
    keys, inverse = group_keys(cols)
    n = len(cols["tp"])
    out = dict(cols)
    parts = {k: np.zeros(n) for k in TIME_KEYS + tuple(map(time_key, AXIS_TIME_TERMS)) + setting_keys(cols)}
    parts.update({k: np.zeros(n, dtype=bool if k in ("fits", "host_fits") else np.float64) for k in MEMORY_KEYS})
    for g, (cp, ep, dtype, etp) in enumerate(keys):
        idx = np.flatnonzero(inverse == g)
        sub = {k: np.asarray(v)[idx] for k, v in cols.items()}
        res = group_columns(with_degrees(base_spec(ctx, cols, int(idx[0]), bases), cp, ep, etp), sub, cp, ep)
        for k in parts:
            parts[k][idx] = res.get(k, 0.0)
    out.update(parts)
    return out
