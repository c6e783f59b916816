"""The cost model's context-parallel (cp) and expert-parallel (ep) terms over columns of layouts,
for the planner and :func:`xpar.estimate.cost.estimate` (a layout is a column of one) alike.

A cp layout is priced as its folded one (:func:`xpar.estimate.context_parallel.fold_cp`: dp x cp
ranks at micro-batch b / cp, a float) plus the K/V exchange as the framework runs it
(:func:`cp_columns`); an ep layout as the layout with E / ep experts per rank (``Layout.ep``: the
memory model's expert states, the FSDP units' sizes) plus its all-to-alls and router imbalance
(:func:`ep_columns`). The planner's candidates are grouped by (cp, ep, dtype, etp) (:func:`group_columns`);
each group's folded columns go through
the planner's own vectorised time and memory (:mod:`xpar.estimate.columns.step_time`, :mod:`xpar.estimate.columns.peak_memory`)
with a base spec of that group (its dtype, ep and cp), then the ep and cp terms are added, each
from the scalar functions once per distinct key (:func:`xpar.estimate.columns.step_time.by_key`), and the rates
rescaled (every rate is a count over the step time). tests/plan/test_plan_five.py checks the
figures against the scalar estimate on sampled candidates. Units: seconds, bytes, tokens/s.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from xpar.estimate.columns.peak_memory import memory_columns
from xpar.estimate.columns.step_time import by_key, spec_at, time_columns
from xpar.config.resolve import resolve_virtual_stages
from xpar.estimate.context_parallel import cp_layer_times, cp_replay, fold_cp
from xpar.estimate.cp_attention import ring_extra_times, ring_rerun
from xpar.estimate.step_parts import assumptions_for, ep_a2a_overlap_of
from xpar.estimate.expert_parallel import ep_layer_times, ep_replay, imbalance_share, shared_expert_share
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
    """The figures of one (cp, ep, dtype) group: its folded layouts' time and memory, plus the ep
    and cp terms; ``base``: the validated spec of one of its candidates."""
    fbase, fcols = fold_cp(base), folded(sub, cp)
    res = dict(memory_columns(fbase, fcols))
    res.update(time_columns(fbase, fcols, res["memory_optimizer"], res["optimizer_elements"], res["memory_grads"]))
    extra = {}
    if ep > 1:
        extra.update(ep_columns(fbase, fcols, res["time_matmul"])[0])
    if cp > 1:
        extra["cp_comm"], _, extra["cp_attention"] = cp_columns(base, sub, cp)
    if extra:
        old = res["time_per_step_s"]
        new = old + sum(extra.values())
        res.update({time_key(k): v for k, v in extra.items()}, time_per_step_s=new)
        scale = np.divide(old, new, out=np.zeros(len(new)), where=new != 0)
        res.update({k: res[k] * scale for k in RATE_KEYS})
    return res


def moe_layers_per_rank(base, pp: int, v: int, schedule: str) -> int:
    """MoE layers on the fullest pipeline rank of the pp x v split (xpar.estimate.columns.stage_split.plan_split: even,
    else lighter ends) placed as ``schedule`` places its stages (the max in
    :func:`xpar.estimate.expert_parallel.ep_terms`)."""
    layout = spec_at(base, 1, pp, 1, 1, 1, v, schedule, 0, False, "none").layout
    return max(sum(base.model.is_moe_layer(i) for s in layout.stages_of(r) for i in layout.stage_layers(s))
               for r in range(pp))


def ep_columns(fbase, fcols: dict[str, np.ndarray], matmul: np.ndarray, a=None) -> tuple[dict, np.ndarray]:
    """(``ep_comm`` and ``ep_imbalance``: seconds per step; the all-to-all seconds issued per step) of
    folded candidates whose matmul term is ``matmul``, under ``a`` (default :func:`assumptions_for`
    ``fbase``): the fullest rank's all-to-alls, m per step, ep_a2a_overlap of them hidden but at most the
    step's matmul seconds (DualPipe and Megatron-Core's 1F1B overlap run one micro-batch's all-to-alls beside
    another's GEMMs: DeepSeek-AI 2024 Sec. 3.2.1), and with ``ep_shared_expert_overlap`` also behind the shared
    experts' share of the matmul seconds (:func:`xpar.estimate.expert_parallel.shared_expert_share`), at most all
    of them, the rest exposed; and its routed
    experts' matmuls stretched (:func:`xpar.estimate.expert_parallel.imbalance_share`); one MoE layer's
    all-to-alls (:func:`xpar.estimate.expert_parallel.ep_layer_times`) per distinct (b, tp, sp), the
    fullest rank's MoE layers per distinct (pp, v, schedule)."""
    a = assumptions_for(fbase) if a is None else a
    b = np.asarray(fcols["b"])
    tp, sp = np.asarray(fcols["tp"], np.int64), np.asarray(fcols["sp"], bool)
    one = by_key([b, tp, sp], lambda bb, t, s: ep_layer_times(
        spec_at(fbase, t, 1, 1, bb, 1, 1, "gpipe", 0, s, "none"), a.ep_dispatcher), ("f", "b"))
    pp, v = np.asarray(fcols["pp"], np.int64), np.asarray(fcols["v"], np.int64)
    sched = np.asarray(fcols["schedule"], dtype=str)
    layers = by_key([pp, v, sched], lambda p, vv, s: {"n": moe_layers_per_rank(fbase, p, vv if p > 1 else 1, s)},
                    ("n",))["n"]
    issued = np.asarray(fcols["m"]) * layers * (one["f"] * (1 + replay_column(fbase, fcols, lambda s: ep_replay(s, a)))
                                                + one["b"])
    share = imbalance_share(fbase)
    overlap = by_key([pp, sched], lambda p, s: {"o": ep_a2a_overlap_of(a, s, p)}, ("o",))["o"]
    hidden = np.minimum(issued * overlap, matmul)  # an all-to-all hides only behind the GEMMs it runs beside
    if a.ep_shared_expert_overlap:  # and behind the shared experts' GEMMs on their own stream
        hidden = np.minimum(hidden + matmul * shared_expert_share(fbase), np.minimum(issued, matmul))
    return {"ep_comm": issued - hidden, "ep_imbalance": matmul * share}, issued


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


def replay_column(base, cols: dict[str, np.ndarray], replay) -> np.ndarray:
    """``replay(spec)`` of each candidate (a share of blocks: :func:`xpar.estimate.expert_parallel.ep_replay`,
    :func:`xpar.estimate.context_parallel.cp_replay`), once per distinct recompute policy, and pipeline
    stages pp x v where parallel.recompute_layers makes the share depend on them."""
    n = len(cols["tp"])
    names, code = np.unique(np.asarray(cols["recompute"], dtype=str), return_inverse=True)
    stages = np.ones(n, dtype=np.int64)
    if base.parallel.recompute_layers is not None:
        pp, v = np.asarray(cols["pp"], np.int64), np.asarray(cols["v"], np.int64)
        sched = np.unique(np.asarray(cols["schedule"], dtype=str), return_inverse=True)
        stages = pp * by_key([sched[1].ravel(), pp, v], lambda s, p, vv: {
            "v": resolve_virtual_stages(str(sched[0][s]), p, vv)}, ("v",))["v"].astype(np.int64)
    return by_key([code.ravel(), stages], lambda c, st: {"x": replay(spec_at(
        base, 1, st, 1, 1, 1, 1, "gpipe", 0, False, str(names[c])))}, ("x",))["x"]
