"""The cost model's context-parallel (cp) and expert-parallel (ep) terms over columns of layouts,
for the planner and :func:`xpar.estimate.cost.estimate` (a layout is a column of one) alike.

A cp layout is priced as its folded one (:func:`xpar.estimate.context_parallel.fold_cp`: dp x cp
ranks at micro-batch b / cp, a float) plus the K/V exchange as the framework runs it
(:func:`cp_columns`); an ep layout as the layout with E / ep experts per rank (``Layout.ep``: the
memory model's expert states, the FSDP units' sizes), each pipeline rank's all-to-alls and router imbalance in its
own micro-batches (:mod:`xpar.estimate.columns.ep_slots`, inside the step). The planner's candidates are grouped by
(cp, ep, dtype, etp) (:func:`group_columns`); each group's folded columns go through the planner's own vectorised
time and memory (:mod:`xpar.estimate.columns.step_time`, :mod:`xpar.estimate.columns.peak_memory`) with a base spec
of that group (its dtype, ep and cp), then the cp term is added from the scalar functions once per distinct key
(:func:`xpar.estimate.columns.step_time.by_key`), and the rates rescaled (every rate is a count over the step time). tests/plan/test_plan_five.py checks the
figures against the scalar estimate on sampled candidates. Units: seconds, bytes, tokens/s.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from xpar.estimate.columns.peak_memory import memory_columns
from xpar.estimate.columns.step_time import by_key, spec_at, time_columns
from xpar.estimate.context_parallel import cp_layer_times, cp_replay, fold_cp
from xpar.estimate.columns.ep_slots import replay_column
from xpar.estimate.cp_attention import ring_extra_times, ring_rerun
from xpar.estimate.step_parts import assumptions_for
from xpar.estimate.terms import RATE_KEYS, time_key



def grouped(cols: dict[str, np.ndarray]) -> bool:
    """Whether any candidate has cp > 1, ep > 1 or an etp, or the candidates carry a ``dtype`` column."""
    return ("dtype" in cols or ("etp" in cols and bool((np.asarray(cols["etp"]) > 0).any())) or ("cp" in cols and bool((np.asarray(cols["cp"]) > 1).any()))
            or ("ep" in cols and bool((np.asarray(cols["ep"]) > 1).any())))


def group_keys(cols: dict[str, np.ndarray]) -> tuple[list[tuple], np.ndarray]:
    """(The distinct (cp, ep, dtype, etp) of the candidates, each candidate's index into them); dtype ''
    where the column is absent (the context's train.dtype), etp 0 (= tp) where absent."""
    n = len(cols["tp"])
    cp = np.asarray(cols.get("cp", np.ones(n, np.int64)))
    ep = np.asarray(cols.get("ep", np.ones(n, np.int64)))
    etp = np.asarray(cols.get("etp", np.zeros(n, np.int64)), dtype=np.int64)
    dt = np.asarray(cols.get("dtype", np.full(n, "")), dtype=str)
    names, code = np.unique(dt, return_inverse=True)
    key = (cp.astype(np.int64) * (int(ep.max(initial=1)) + 1) + ep) * len(names) + code.ravel()
    key = key * (int(etp.max(initial=0)) + 1) + etp
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    return [(int(cp[i]), int(ep[i]), str(dt[i]), int(etp[i])) for i in first], inverse.ravel()


def folded(cols: dict[str, np.ndarray], cp: int) -> dict[str, np.ndarray]:
    """Candidate columns as the cost model prices them (:func:`fold_cp`): dp x cp ranks at
    micro-batch b / cp (float64 when cp > 1); cp and ep columns left out (the group's base holds them)."""
    out = {k: v for k, v in cols.items() if k not in ("cp", "ep", "dtype", "etp")}
    if cp > 1:
        out.update(dp=np.asarray(cols["dp"]) * cp, b=np.asarray(cols["b"], dtype=np.float64) / cp)
    return out


def with_degrees(spec, cp: int, ep: int, etp: int = 0):
    """``spec`` (a validated candidate's) at context-, expert- and expert-tensor-parallel degrees ``cp``,
    ``ep`` and ``etp`` (0: tp) (layout and parallel group; its dp, tp, pp and batch are replaced per
    candidate downstream)."""
    return replace(spec, layout=replace(spec.layout, cp=cp, ep=ep, etp=etp))


def group_columns(base, sub: dict[str, np.ndarray], cp: int, ep: int) -> dict[str, np.ndarray]:
    """The figures of one (cp, ep, dtype) group: its folded layouts' time and memory (the ep terms included),
    plus the cp term; ``base``: the validated spec of one of its candidates."""
    fbase, fcols = fold_cp(base), folded(sub, cp)
    res = dict(memory_columns(fbase, fcols))
    res.update(time_columns(fbase, fcols, res["memory_optimizer"], res["optimizer_elements"], res["memory_grads"]))
    extra = {}  # the ep terms are each rank's own, inside time_columns (xpar.estimate.columns.ep_slots)
    if cp > 1:
        extra["cp_comm"], _, extra["cp_attention"] = cp_columns(base, sub, cp)
    if extra:
        old = res["time_per_step_s"]
        new = old + sum(extra.values())
        res.update({time_key(k): v for k, v in extra.items()}, time_per_step_s=new)
        scale = np.divide(old, new, out=np.zeros(len(new)), where=new != 0)
        res.update({k: res[k] * scale for k in RATE_KEYS})
    return res


def cp_columns(base, sub: dict[str, np.ndarray], cp: int, a=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Exposed, issued) seconds per step of the cp K/V exchange of unfolded candidates under ``a`` (default
    :func:`assumptions_for` ``base``; its ``cp_comm``: xpar.estimate.cp_exchange), and the seconds its attention
    core's ring steps add (xpar.estimate.cp_attention.ring_extra_times): m micro-batches x the blocks on the fullest
    rank (per distinct (pp, v, schedule)) x the layer's seconds per distinct (b, tp), the forward exchange again in
    the backward of the blocks that replay it (:func:`cp_replay`), the ring's forward again in those that rerun the
    core (xpar.estimate.cp_attention.ring_rerun)."""
    a = assumptions_for(base) if a is None else a

    def unfolded(b, tp):
        s = spec_at(base, tp, 1, 1, b, 1, 1, "gpipe", 0, False, "none")
        return replace(s, layout=replace(s.layout, cp=cp))

    keys = [np.asarray(sub["b"], np.int64), np.asarray(sub["tp"], np.int64)]
    t = by_key(keys, lambda b, tp: cp_layer_times(unfolded(b, tp), a), ("f", "b", "f_issued", "b_issued"))
    ring = by_key(keys, lambda b, tp: ring_extra_times(unfolded(b, tp), a), ("f", "b"))
    replay = replay_column(base, sub, lambda s: cp_replay(s, a))
    rerun = replay_column(base, sub, lambda s: ring_rerun(s, a))
    pp, v = np.asarray(sub["pp"], np.int64), np.asarray(sub["v"], np.int64)
    layers = by_key([pp, v, np.asarray(sub["schedule"], dtype=str)], lambda p, vv, s: {
        "n": fullest_blocks(base, p, vv if p > 1 else 1, s)}, ("n",))["n"]
    per = np.asarray(sub["m"]) * layers
    return (per * (t["f"] * (1 + replay) + t["b"]), per * (t["f_issued"] * (1 + replay) + t["b_issued"]),
            per * (ring["f"] * (1 + rerun) + ring["b"]))


def fullest_blocks(base, pp: int, v: int, schedule: str) -> int:
    """Blocks on the fullest pipeline rank of ``base`` at pp x v stages placed as ``schedule`` places them
    (split as :func:`xpar.estimate.columns.step_time.spec_at` splits them)."""
    layout = spec_at(base, 1, pp, 1, 1, 1, v, schedule, 0, False, "none").layout
    return max(layout.layers_of(r) for r in range(pp))
