"""Activation offload in the plan (``parallel.activation_offload_layers``, xpar.estimate.memory.activation_offload):
each layout is searched with offload N in {0, the fewest N that fits}, the second only where the layout does not
fit without it, the framework runs it (``framework.activation_offload``: megatron_core, Megatron-Core's
--cpu-offloading-num-layers; xpar, torch's save_on_cpu) and the hardware gives the host link's bandwidth
(``hardware.pcie_gb_per_s``: the copies are timed over it). Megatron-Core's rules hold: pp 1, no recompute,
N < the blocks; context parallelism is left out (cp 1: the offload is priced on unfolded blocks).

A layout that does not fit at N = 0 is dropped for memory anyway, so its row is replaced by its offloaded form
(the space's size stays; the memory-dropped count falls by the layouts offload makes fit). The peak falls by one
block's saved bytes (xpar.estimate.columns.act_offload.block_column) per block offloaded beyond the group in
flight (one under Transformer Engine's side stream, none under save_on_cpu), so
N = ceil((peak(0) - usable) / block) + in flight; the rows are then priced at N by the same column model, and a
row that still does not fit (rounding) is priced again at N + 1.
"""
from __future__ import annotations

import numpy as np

from xpar.estimate.columns.act_offload import block_column
from xpar.estimate.columns.cp_ep import with_degrees
from xpar.estimate.memory.model_states import MemoryOptions
from xpar.estimate.step_parts import assumptions_for
from xpar.plan.context import PlanContext
from xpar.plan.evaluate import base_spec, evaluate

def offload_rows(ctx: PlanContext, res: dict[str, np.ndarray]) -> np.ndarray:
    """Indices of the rows of ``res`` searched with offload (module docstring); empty where the framework or the
    hardware does not run it."""
    fw, hw, blocks = ctx.framework, ctx.hardware, int(ctx.model["n_layers"])
    if not fw.get("activation_offload") or not (hw.get("pcie_gb_per_s") or 0) > 0:
        return np.zeros(0, dtype=np.int64)
    cp = np.asarray(res["cp"]) if "cp" in res else np.ones(len(res["tp"]), dtype=np.int64)
    return np.flatnonzero(~np.asarray(res["fits"], bool) & (np.asarray(res["pp"]) == 1) & (cp == 1)
                          & (np.asarray(res["recompute"]) == "none"))


def with_offload(ctx: PlanContext, cols: dict[str, np.ndarray], res: dict[str, np.ndarray],
                 bases: dict) -> dict[str, np.ndarray]:
    """``res`` (:func:`xpar.plan.evaluate.evaluate` of ``cols``, whose validated specs are in ``bases``) with the
    rows of :func:`offload_rows` that fit with offload replaced by their offloaded form, priced by the same
    evaluation: the column ``act_offload`` (N, 0 elsewhere) and ``time_act_offload`` (seconds per step) added;
    ``res`` itself where no row is searched."""
    idx = offload_rows(ctx, res)
    if not len(idx):
        return res
    blocks, flight = int(ctx.model["n_layers"]), int(bool(ctx.framework.get("activation_offload_overlap", True)))
    over = res["memory_total"][idx] - res["memory_usable"][idx]
    n = np.ceil(over / block_bytes(ctx, cols, idx, bases)).astype(np.int64) + flight
    keep = n < blocks
    out = {k: np.array(v) for k, v in res.items()}  # copies: ``res`` stays as evaluated
    out.update(act_offload=np.zeros(len(res["tp"]), dtype=np.int64), time_act_offload=np.zeros(len(res["tp"])))
    for _ in range(2):  # N, then N + 1 where rounding left a row just over
        rows, n = idx[keep], n[keep]
        if not len(rows):
            break
        new = evaluate(ctx, dict({k: np.asarray(v)[rows] for k, v in cols.items()}, act_offload=n), bases)
        ok = np.asarray(new["fits"], bool)
        for k in out:  # a term the rows' groups do not have (cp's, ep's) is 0 there
            out[k][rows[ok]] = np.asarray(new[k])[ok] if k in new else 0
        idx, n, keep = rows, n + 1, ~ok & (n + 1 < blocks)
    return out


def block_bytes(ctx: PlanContext, cols: dict[str, np.ndarray], idx: np.ndarray, bases: dict) -> np.ndarray:
    """One block's saved bytes of each row ``idx`` of ``cols`` (:func:`block_column`), under its dtype's spec
    (:func:`xpar.plan.evaluate.base_spec`) at its ep and etp (the optional columns that change a block's bytes).
    Bytes, > 0."""
    n = len(idx)
    ep = np.asarray(cols["ep"])[idx] if "ep" in cols else np.ones(n, dtype=np.int64)
    etp = np.asarray(cols["etp"])[idx] if "etp" in cols else np.zeros(n, dtype=np.int64)
    dtype = np.asarray(cols["dtype"])[idx].astype(str) if "dtype" in cols else np.full(n, "")
    keys = np.stack([ep.astype(str), etp.astype(str), dtype]).T
    _, first, groups = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    out = np.zeros(n)
    for g, f in enumerate(first):
        part = groups.ravel() == g
        base = with_degrees(base_spec(ctx, cols, int(idx[f]), bases), 1, int(ep[f]), int(etp[f]))
        out[part] = block_column(base, MemoryOptions.of(assumptions_for(base)),
                                 {k: np.asarray(cols[k])[idx[part]] for k in ("tp", "b", "sp", "zero")})
    return out
