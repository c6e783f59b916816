"""Step time, its terms and the rates of many layouts at once: the cost model's one orchestration
of a step, for the planner's candidate columns (:mod:`xpar.plan.context`) and for
:func:`xpar.estimate.cost.estimate` (one layout, every pipeline rank a slot: xpar.estimate.columns.one_layout).

Sub-results that depend on a few columns (layer costs, FSDP unit sizes and times, pipeline sends,
bubble, ...) come from the parts' functions once per distinct key (:func:`by_key`); the rest is
array arithmetic (:mod:`xpar.estimate.step_parts`, :func:`xpar.estimate.comm.dp.dp_exposure`). The
planner's pipeline ranks are three slots per layout (rank 0, a middle rank, the last rank), each
with its count of ranks and blocks; the slowest slot gives the breakdown, the others the bubble's
fill (:func:`xpar.estimate.step_parts.fill_time`): :func:`slot_step`.

Keys: :data:`xpar.estimate.terms.COLUMN_TIME_KEYS`. Units: seconds, tokens/s, 1e12 FLOP/s,
fractions of peak. No torch import. Speed: benchmarks/plan_speed.py, benchmarks/README.md.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from xpar.config.layout import SCHEDULES, Layout
from xpar.config.remat import RECOMPUTE as REMAT_NAMES
from xpar.config.remat import spec_recompute
from xpar.config.resolve import resolve_virtual_stages
from xpar.config.spec import RunSpec
from xpar.estimate.compute import flops as fl
from xpar.estimate.columns.mixed_blocks import UNIT_TIMES, UnitTimes, blocks_vary, unit_columns
from xpar.estimate.columns.peak_memory import memory_columns
from xpar.estimate.columns.stage_split import plan_split, rank_blocks, split_key, splittable
from xpar.estimate.step_parts import (
    Assumptions,
    assumptions_for,
    compute_peak,
    fill_time,
    kv_grad_reduce_time,
    layer_costs,
    microbatch_time,
    optimizer_term,
    pp_exposed,
    pp_overlap_of,
    pp_send_latency,
    pp_send_time,
    rank_compute,
    rates,
    step_time,
    tp_times,
    waits_unstretched,
)
from xpar.estimate.comm.volume import pp_sends
from xpar.estimate.frameworks.deepspeed_zero3 import persist_time
from xpar.estimate.compute.kernel_costs import kernel_layer_columns, kernel_priced
from xpar.estimate.comm.dp import dp_exposure, grad_bytes, unit_elements, unit_expert_elements, unit_times
from xpar.estimate.compute.host import (
    HOST_KEYS,
    host_costs,
    host_step,
    oversubscription,
    rank_host,
)
from xpar.estimate.memory.model_states import root_tail_elements, state_widths
from xpar.estimate.memory.offload import (
    OFFLOAD_TERMS,
    devices_per_node,
    gradient_copies,
    offload_figures_known,
    offload_time,
)
from xpar.estimate.schedule import bubble_theory
from xpar.estimate.terms import COLUMN_TIME_KEYS
from xpar.estimate.columns.vocab_groups import columns_by_vocab
from xpar.estimate.columns.ep_slots import ep_slot_columns
from xpar.estimate.columns.act_offload import act_offload_columns, offload_column
from xpar.estimate.memory.activation_offload import offload_layers
from xpar.estimate.columns.mtp import last_stage_work
from xpar.estimate.columns.keys import _combined, by_key, per_slot, spec_at, unique_rows  # noqa: F401 (re-exported)

TIME_KEYS = COLUMN_TIME_KEYS
"""Keys of :func:`time_columns` (:data:`xpar.estimate.terms.COLUMN_TIME_KEYS`), and at ep > 1 :data:`EP_TIME_KEYS`."""
EP_TIME_KEYS = ("time_ep_comm", "time_ep_imbalance")
"""The expert-parallel terms of an ep layout's step (xpar.estimate.columns.ep_slots)."""


def time_keys(base: RunSpec, cols: Optional[dict] = None) -> tuple[str, ...]:
    """Keys of :func:`time_columns` for candidates of ``base``'s ep: :data:`TIME_KEYS`, plus :data:`EP_TIME_KEYS`
    at ep > 1 and ``time_act_offload`` with activation offload (parallel.activation_offload_layers, or the
    candidates' column ``act_offload``)."""
    offload = offload_layers(base) or (cols is not None and "act_offload" in cols)
    return TIME_KEYS + (EP_TIME_KEYS if base.layout.ep > 1 else ()) + (("time_act_offload",) if offload else ())
SLOTS = 3
"""Rank classes per layout: rank 0, a middle rank, the last rank (module docstring)."""
SCHEDULE_NAMES = tuple(SCHEDULES)
RECOMPUTE = REMAT_NAMES


def candidate_rows(cols: dict[str, np.ndarray], offload: bool = False) -> dict[str, np.ndarray]:
    """The candidate columns as arrays (v resolved: :func:`xpar.config.resolve.resolve_virtual_stages`;
    schedule and recompute as indices into :data:`SCHEDULE_NAMES`, :data:`RECOMPUTE`), plus
    ``v_shaped`` (V placement, pp > 1) and ``offload`` (the optional column, else ``offload``)."""
    r = {k: np.asarray(cols[k]) for k in ("tp", "pp", "dp", "b", "m", "v", "zero", "sp")}
    r = {k: x.astype(bool if k == "sp" else x.dtype if k == "b" and x.dtype.kind == "f" else np.int64)
         for k, x in r.items()}  # b: a float on a cp-folded layout (xpar.estimate.columns.cp_ep)
    r["offload"] = np.asarray(cols["offload"], dtype=bool) if "offload" in cols else np.full(len(r["tp"]), offload)
    for k, names in (("schedule", SCHEDULE_NAMES), ("recompute", RECOMPUTE)):
        given, r[k] = np.asarray(cols[k]), np.full(len(r["tp"]), -1, dtype=np.int64)
        for i, name in enumerate(names):  # codes: names.index
            r[k][given == name] = i
        if (r[k] < 0).any():
            raise KeyError(f"{k}={given[r[k] < 0][0]!r}; expected one of {names}")
    r["v"] = by_key([r["schedule"], r["pp"], r["v"]], lambda sch, pp, v: {
        "v": resolve_virtual_stages(SCHEDULE_NAMES[sch], pp, v)}, ("v",))["v"].astype(np.int64)  # 1 without pp
    shaped = np.array([SCHEDULES[x].v_shaped for x in SCHEDULE_NAMES], dtype=bool)
    r["v_shaped"] = shaped[r["schedule"]] & (r["pp"] > 1)
    return r


def _slots(r: dict, n_layers: int) -> dict[str, np.ndarray]:
    """Per slot (axis 0, :data:`SLOTS`) and layout: a representative pipeline rank, whether it
    holds the first / last stage, how many ranks it stands for (0: no such rank) and the blocks
    it holds (``n``: :func:`xpar.estimate.columns.stage_split.rank_blocks`)."""
    pp, vs = r["pp"], r["v_shaped"]
    one = pp == 1
    return {"rank": np.stack([np.zeros_like(pp), np.minimum(1, pp - 1), pp - 1]),
            "first": np.stack([np.ones_like(vs), np.zeros_like(vs), np.zeros_like(vs)]),
            "last": np.stack([one | vs, np.zeros_like(vs), ~one & ~vs]),
            "count": np.stack([np.ones_like(pp), np.where(one, 0, np.where(vs, pp - 1, pp - 2)),
                               (~one & ~vs).astype(np.int64)]),
            "n": rank_blocks(n_layers, pp, r["v"], vs)}


def _placement(base: RunSpec, pp: int, v: int, v_shaped: bool) -> Layout:
    """A layout of pp x v stages placed as the candidates' (loop or V placement)."""
    return Layout(dp=1, tp=1, pp=pp, micro_batch_size=1, micro_batches=1, seq_len=base.seq_len,
                  layer_split=tuple(plan_split(base.model.n_layers, pp * v)), schedule="zbv" if v_shaped else "gpipe")


@dataclass(frozen=True)
class RankClass:
    """A pipeline rank by the stage ends it holds, as rank ``rank`` of a layout of ``pp`` ranks and
    ``v`` stages per rank with one block per stage (V placement where ``v_shaped``)."""

    pp: int
    v: int
    v_shaped: bool
    rank: int


RANK_CLASSES = (RankClass(1, 1, False, 0), RankClass(3, 1, False, 0), RankClass(3, 1, False, 1),
                RankClass(3, 1, False, 2), RankClass(2, 2, True, 0))
"""Rank classes by index -- 0: the one stage (pp = 1: tied embeddings held once), 1: the first
stage's, 2: none (middle), 3: the last stage's, 4: both (V placement)."""


def _unit_sizes(base: RunSpec, tp: int, rank_class: int) -> dict[str, int]:
    """Elements of the root unit and of one block (``experts``: the block's routed experts) on a rank of
    ``rank_class`` (:data:`RANK_CLASSES`), from :func:`unit_elements` on a layout of one block per stage: a
    rank's root depends on the stage ends it holds, a block on tp, neither on the blocks held."""
    c = RANK_CLASSES[rank_class]
    pp, v, v_shaped, rank = c.pp, c.v, c.v_shaped, c.rank
    layout = Layout(dp=1, tp=tp, pp=pp, micro_batch_size=1, micro_batches=1, seq_len=base.seq_len,
                    layer_split=(1,) * (pp * v), schedule="zbv" if v_shaped else "gpipe", ep=base.layout.ep,
                    etp=base.layout.etp)
    u, x = unit_elements(replace(base, layout=layout), rank), unit_expert_elements(replace(base, layout=layout), rank)
    return {"root": u[0], "block": u[1], "experts": x[1]}


def _head_shares(base: RunSpec, a: Assumptions, tp: np.ndarray, pp: np.ndarray) -> np.ndarray:
    """Per row: the share of the root's elements that are the output head, a dp unit of its own
    (``framework.head_unit_last``, an untied model on one stage: xpar.estimate.comm.head_unit); 0 elsewhere."""
    out = np.zeros(len(tp))
    if not a.head_unit_last or base.model.tied_embeddings:
        return out
    for t in np.unique(tp[pp == 1]).tolist():
        c = RANK_CLASSES[0]
        layout = Layout(dp=1, tp=t, pp=1, micro_batch_size=1, micro_batches=1, seq_len=base.seq_len, layer_split=(1,),
                        schedule="gpipe", ep=base.layout.ep, etp=base.layout.etp)
        one = replace(base, layout=layout)
        out[(pp == 1) & (tp == t)] = root_tail_elements(one, c.rank) / max(1, unit_elements(one, c.rank)[0])
    return out


def _dp_unit_times(base: RunSpec, a: Assumptions, r: dict, s: dict) -> dict[str, np.ndarray]:
    """Per slot (axis 0): seconds of the root's and of one block's all-gather and reduction
    (:func:`xpar.estimate.comm.dp.unit_times` of the rank's units: the root, then its ``s["n"]`` blocks;
    columns ``<key>_root``, ``<key>_block`` per key of :data:`xpar.estimate.columns.mixed_blocks.UNIT_TIMES`)."""
    specs: dict[tuple, RunSpec] = {}

    def times(dp, tp, zero, rec, root, block, n, experts):
        if (dp, tp, zero, rec) not in specs:
            specs[dp, tp, zero, rec] = spec_at(base, tp, 1, dp, 1, 1, 1, "gpipe", zero, False, RECOMPUTE[rec])
        t = unit_times(specs[dp, tp, zero, rec], a, [int(root)] + [int(block)] * int(n), None,
                       [0] + [int(experts)] * int(n))
        return {f"{k}_{u}": t[name][i] for k, name in UNIT_TIMES.items() for u, i in (("root", 0), ("block", -1))}

    first, last = s["first"], s["last"]
    cls = np.where(r["pp"] == 1, 0, np.where(first & last, 4, np.where(first, 1, np.where(last, 3, 2))))
    el = per_slot([r["tp"], cls], lambda tp, c: _unit_sizes(base, tp, c), ("root", "block", "experts"))
    n = np.broadcast_to(s["n"], cls.shape)
    root, block = el["root"].astype(np.int64), el["block"].astype(np.int64)  # element counts
    rec = r["recompute"] if a.zero3_reuse_distance is not None else np.zeros_like(r["recompute"])  # else unread
    experts = el["experts"].astype(np.int64)  # of one block (xpar.estimate.comm.dp.expert_split_times)
    return per_slot([r["dp"], r["tp"], r["zero"], rec, root, block, n, experts], times,
                    tuple(f"{k}_{u}" for k in UNIT_TIMES for u in ("root", "block")))


def _dp_columns(base: RunSpec, a: Assumptions, r: dict, s: dict, x: dict) -> dict[str, np.ndarray]:
    """Per slot (axis 0): dp communication exposed per micro-batch (``dp_comm``), at the end of
    the step (``dp_end``) and issued per step (``dp_issued``), seconds. The unit timeline
    (:func:`dp_exposure`) runs once per distinct input (rank class, tp, dp, b, ZeRO stage, sp,
    recompute, one stage or more, the split; not m or the schedule), in one timeline per kind of row
    (:func:`_dp_rows`; one stage or more, per-chunk overlap or not: the passes a row needs)."""
    shape = s["count"].shape
    flat = {k: np.broadcast_to(x[k], shape).ravel() for k in ("unit_f", "unit_b", "root_f", "root_b")}
    # dense and MoE blocks (xpar.estimate.columns.mixed_blocks); by_rank: one layout, a slot per rank
    het = UnitTimes(base, a, spec_at, bool(s.get("by_rank"))) if blocks_vary(base) else None
    if het is None:
        flat.update({k: v.ravel() for k, v in _dp_unit_times(base, a, r, s).items()})
    live = ((r["dp"] > 1) & (s["count"] > 0)).ravel()
    one_stage = r["pp"] * r["v"] == 1  # first and last stage one module: tied embeddings held once
    row_key = _combined([r[k] for k in ("pp", "tp", "dp", "b", "zero", "sp", "recompute", "v_shaped")]
                        + [one_stage, _stages(base, r), split_key(base.model.n_layers, r["pp"], r["v"])]
                        + ([r["v"]] if het or a.dp_overlap_per_chunk else []))
    key = (row_key * shape[0] + np.arange(shape[0])[:, None]).ravel()
    rep, inverse = unique_rows(np.where(live, key + 1, 0))
    res = {k: np.zeros(len(rep)) for k in ("per_microbatch", "end", "issued_per_microbatch", "issued_once",
                                           "first_backward")}
    rows = rep[live[rep]]
    rec = r["recompute"] if a.zero3_reuse_distance is not None else np.zeros_like(r["recompute"])  # else unread
    cols = {k: np.broadcast_to(r[k] if k != "recompute" else rec, shape).ravel()[rows]
            for k in ("dp", "tp", "zero", "recompute", "pp", "v", "v_shaped")}
    cols |= {"slot": rows // shape[1], "n": np.broadcast_to(s["n"], shape).ravel()[rows]}
    cols["head"] = _head_shares(base, a, cols["tp"], cols["pp"])  # xpar.estimate.comm.head_unit
    at = np.flatnonzero(live[rep])
    chunked = (cols["v"] > 1) & bool(a.dp_overlap_per_chunk)  # xpar.estimate.frameworks.dp_chunks
    kind = (cols["pp"] == 1) * 2 + chunked  # the passes a row needs (xpar.estimate.comm.dp._exposure)
    if het is None:  # identical blocks: a timeline per block count, no units of no time (cheaper than padding)
        kind = kind * (int(cols["n"].max(initial=0)) + 1) + cols["n"]
    for one in np.unique(kind).tolist():
        sel = np.flatnonzero(kind == one)
        out = _dp_rows(a, het, {k: c[rows[sel]] for k, c in flat.items()}, {k: c[sel] for k, c in cols.items()})
        for k in res:
            res[k][at[sel]] = out[k]
    every = {k: v[inverse].reshape(shape) for k, v in res.items()}
    persist = _persist_column(base, a, r, s) * live.reshape(shape)
    return {"dp_comm": every["per_microbatch"] + every["first_backward"] / r["m"], "dp_end": every["end"] + persist,
            "dp_issued": r["m"] * every["issued_per_microbatch"] + every["issued_once"] + persist}


def _dp_rows(a: Assumptions, het: Optional[UnitTimes], f: dict, rows: dict) -> dict:
    """:func:`dp_exposure` of representative rows (arrays over them: ``f`` their unit computes and, without
    ``het``, unit times; ``rows`` their dp, tp, zero, recompute code, pp, v, v_shaped, slot and blocks ``n``)
    in one timeline over the most blocks: a row's units are followed by units of no compute and no
    communication (forward order; first in backward order), which change no time. Seconds."""
    n = rows["n"]
    top = int(n.max())
    pad = [k <= n for k in range(top + 1)]  # forward order: the root, then the row's blocks

    def fwd(root: np.ndarray, block: np.ndarray) -> list:
        if pad[top].all():  # every row holds the most blocks
            return [root] + [block] * top
        return [root] + [np.where(pad[k], block, 0.0) for k in range(1, top + 1)]

    units = ({k: fwd(f[f"{k}_root"], f[f"{k}_block"]) for k in UNIT_TIMES} if het is None
             else unit_columns(het, rows, top))
    chunks = rows["v"] if a.dp_overlap_per_chunk else 1  # xpar.estimate.frameworks.dp_chunks
    return dp_exposure(rows["zero"], rows["pp"], a, fwd(f["root_f"], f["unit_f"]), fwd(f["root_b"], f["unit_b"])[::-1],
                       units["g"], units["r"], units["cg"], units["cr"], units["gb"], chunks, n + 1, rows["head"])


def _persist_column(base: RunSpec, a: Assumptions, r: dict, s: dict) -> np.ndarray:
    """Per slot (axis 0): seconds per step of ZeRO-3's persistent tensors (DeepSpeed 2021:
    xpar.estimate.frameworks.deepspeed_zero3.persist_time, once per step); zeros elsewhere."""
    if not a.zero3_persist_numel:
        return np.zeros(s["count"].shape)

    def one(dp, tp, zero, m, n):
        if zero != 3:
            return {"p": 0.0}
        return {"p": persist_time(spec_at(base, tp, 1, dp, 1, m, 1, "gpipe", zero, False, "none"), a, n)}
    return per_slot([r["dp"], r["tp"], r["zero"], r["m"], s["n"]], one, ("p",))["p"]


def _state_bytes(base: RunSpec, cols: dict, r: dict, a: Assumptions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Optimizer-state bytes on the most loaded device (Estimate.memory.optimizer), the
    optimizer's elements there (offloaded or not), gradient bytes there (Estimate.memory.grads)):
    from :func:`xpar.estimate.columns.peak_memory.memory_columns`."""
    res = memory_columns(base, cols)
    return tuple(np.asarray(res[k], dtype=np.float64) for k in ("memory_optimizer", "optimizer_elements",
                                                                 "memory_grads"))


def _offload_columns(base: RunSpec, a: Assumptions, r: dict, pick: dict, elements: np.ndarray) -> dict:
    """:func:`xpar.estimate.memory.offload.offload_time` of every candidate (zeros where it does not
    offload, or the hardware has no host figures: the scalar estimate's note), with the slowest
    slot's micro-batch compute (``pick``) and the optimizer's ``elements`` on the memory peak."""
    hw = base.hardware
    zero = {k: np.zeros(len(r["tp"])) for k in OFFLOAD_TERMS}
    if not r["offload"].any() or not offload_figures_known(hw):
        return zero
    param_bytes, grad_bytes, _ = state_widths(base, a)
    copies = gradient_copies(r["zero"], r["dp"], r["m"])
    out = offload_time(np.asarray(elements, float), copies, grad_bytes, param_bytes,
                       pick["matmul"] + pick["memory_bound"], hw.pcie_gb_per_s, hw.host_mem_gb_per_s,
                       devices_per_node(hw))
    return {k: np.where(r["offload"], out[k], 0.0) for k in OFFLOAD_TERMS}


def time_columns(base: RunSpec, cols: dict[str, np.ndarray], memory_optimizer: Optional[np.ndarray] = None,
                 optimizer_elements: Optional[np.ndarray] = None,
                 memory_grads: Optional[np.ndarray] = None) -> dict[str, np.ndarray]:
    """Step time and throughput of every candidate (:data:`TIME_KEYS`, float64 arrays of the
    candidates' length), each equal to :func:`xpar.estimate.cost.estimate` of the candidate's
    spec (:func:`xpar.plan.context.spec_of`). ``base``: the RunSpec of any candidate of the same
    context (its model, hardware, seq_len, dtype and framework are used). ``memory_optimizer``:
    bytes of optimizer states on the most loaded device per candidate (xpar.estimate.columns.peak_memory's
    ``memory_optimizer``), for the optimizer term; computed when None (pass it when the memory
    columns are computed anyway), with ``optimizer_elements`` (peak_memory's: the optimizer's
    elements on that device, what an offloaded optimizer moves; needed when a candidate
    offloads), and ``memory_grads`` (peak_memory's gradient bytes there, for the passes over the
    gradients: xpar.estimate.cost.gradient_time). The optional column ``offload`` (bool; default the framework's
    ``cpu_offload_optimizer``) adds the offloaded step (xpar.estimate.memory.offload) to the optimizer
    term. Units: seconds, tokens/s, 1e12 FLOP/s, fractions of peak.

    Raises:
        ValueError: a candidate whose pp x v stages split the layers neither evenly nor with lighter
            ends (xpar.estimate.columns.stage_split; the space's rule ``balanced`` drops them).
        KeyError: a schedule not in :data:`xpar.config.layout.SCHEDULES` or a recompute policy not in
            :data:`RECOMPUTE`."""
    if (padded := columns_by_vocab(base, cols, time_columns, memory_optimizer, optimizer_elements,
                                   memory_grads)) is not None:  # the vocabulary padded per tp (xpar.estimate.columns.vocab_groups)
        return padded
    world = cols["tp"] * cols["pp"] * cols["dp"]
    if base.hardware.sync_wait_us and len(np.unique(world)) > 1:  # the waits depend on the workers
        return _by_world(base, cols, world, memory_optimizer, optimizer_elements, memory_grads)
    if len(world):
        base = waits_unstretched(base, int(world[0]))
    a = assumptions_for(base)
    r = candidate_rows(cols, a.cpu_offload_optimizer)
    keys = time_keys(base, cols)
    base, r["act_offload"] = offload_column(base, cols)  # activation offload's N per candidate
    bad = np.flatnonzero(~splittable(base.model.n_layers, r["pp"] * r["v"]))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"time_columns: n_layers={base.model.n_layers} split over pp*v={r['pp'][i]}*{r['v'][i]} "
                         f"stages neither evenly nor with lighter ends (candidate {i}; {len(bad)} such candidates)")
    step = slot_step(base, a, cols, r, _slots(r, base.model.n_layers), memory_optimizer, optimizer_elements,
                     memory_grads)
    pick, off = step.slowest, step.offload
    out = {"time_per_step_s": step.time, **{f"time_{k}": v * np.ones(len(step.time))
                                            for k, v in step.breakdown.items()},
           "bubble_ratio": step.beta, "dp_comm_issued_s": pick["dp_issued"],
           "tp_comm_issued_s": r["m"] * pick["tp_issued"] + pick["tp_step"],
           "pp_comm_issued_s": r["m"] * pick["pp_issued"], "offload_host_step_s": off["host_step_s"],
           "offload_pcie_s": off["grad_to_host_exposed_s"] + off["param_to_device_s"]}
    out.update(_rates(base, r, step.time))
    out.setdefault("time_act_offload", np.zeros(len(step.time)))  # a column of N = 0 only
    return {k: np.asarray(out[k], dtype=np.float64) for k in keys}


@dataclass(frozen=True)
class Step:
    """A step of each layout (arrays over layouts): seconds per step (``time``), by term
    (``breakdown``, :data:`xpar.estimate.terms.TIME_TERMS`), the bubble ratio ``beta``, the slowest
    rank's terms (``slowest``: :func:`_rank_columns`'s keys, seconds per micro-batch but ``dp_end``,
    ``tp_step``, ``dp_issued`` and ``host_step`` per step), its slot ``slot`` (axis 0 of the slots: the pipeline
    rank for one layout's every rank) and the offloaded optimizer's seconds (``offload``,
    xpar.estimate.memory.offload.OFFLOAD_TERMS; zeros without offload)."""

    time: np.ndarray
    breakdown: dict
    beta: np.ndarray
    slowest: dict
    slot: np.ndarray
    offload: dict


def slot_step(base: RunSpec, a: Assumptions, cols: dict, r: dict, s: dict, memory_optimizer: Optional[np.ndarray],
              optimizer_elements: Optional[np.ndarray], memory_grads: Optional[np.ndarray]) -> Step:
    """The :class:`Step` of layouts ``r`` (:func:`candidate_rows` of ``cols``) under ``a`` from their pipeline
    ranks ``s`` (slots: :func:`_slots`, or one layout's every rank): the slowest rank's terms, the
    fill of the others (:func:`xpar.estimate.step_parts.fill_time`), the bubble (of a run of
    parallel.pipeline_micro_batches micro-batches where set: m x that run's ratio is m / k runs' bubbles), the optimizer
    term (memory arguments: :func:`time_columns`), stretched when workers outnumber cores."""
    x = _rank_columns(base, a, r, s)
    if base.layout.ep > 1:  # each rank's own all-to-alls, in its micro-batch (xpar.estimate.columns.ep_slots)
        x.update(ep_slot_columns(base, a, cols, r, s, x["matmul"], SCHEDULE_NAMES))
    mb = microbatch_time(x)
    key = np.where(s["count"] > 0, mb, -np.inf)
    if "ep_blocks" in x:  # on a tie, the rank with the most MoE blocks (xpar.estimate.columns.mixed_blocks.slot_rank_moe)
        key = np.where(key == key.max(axis=0), x["ep_blocks"], -np.inf)
    slow = np.argmax(key, axis=0)[None]
    pick = {k: np.take_along_axis(np.broadcast_to(v, mb.shape), slow, axis=0)[0] for k, v in x.items()}
    fill = fill_time((s["count"] * mb + x.get("ep_fill", 0.0)).sum(axis=0), microbatch_time(pick), r["pp"])
    runs = base.parallel.pipeline_micro_batches  # m / k schedule runs a step, each with its fill and drain
    m_run = r["m"] if runs is None else np.minimum(r["m"], runs)
    beta = by_key([r["schedule"], r["pp"], m_run, r["v"]], lambda sch, pp, m, v: {
        "b": bubble_theory(SCHEDULE_NAMES[sch], pp, m, v) if pp > 1 else 0.0}, ("b",))["b"]
    t_opt, off = _optimizer_columns(base, cols, a, r, pick, memory_optimizer, optimizer_elements, memory_grads)
    time, breakdown = step_time(pick, r["m"], beta, fill, t_opt)
    stretch = oversubscription(base.hardware.cpu_cores, r["tp"] * r["pp"] * r["dp"], base.train.threads_per_worker or 1)
    return Step(time * stretch, {k: v * stretch for k, v in breakdown.items()}, beta, pick, slow[0], off)


def _optimizer_columns(base: RunSpec, cols: dict, a: Assumptions, r: dict, pick: dict,
                       memory_optimizer: Optional[np.ndarray], optimizer_elements: Optional[np.ndarray],
                       memory_grads: Optional[np.ndarray]) -> tuple[np.ndarray, dict]:
    """(The optimizer term per candidate: the optimizer step, the passes over the gradients
    (xpar.estimate.cost.gradient_time) and an offloaded step's exposed time, seconds; the offload
    columns), from the memory model's columns where given (:func:`time_columns`)."""
    if (memory_optimizer is None or (optimizer_elements is None and r["offload"].any())
            or (memory_grads is None and a.gradient_passes)):
        opt, elements, grads = _state_bytes(base, cols, r, a)
    else:
        opt, elements = np.asarray(memory_optimizer, float), optimizer_elements
        grads = np.zeros(len(opt)) if memory_grads is None else np.asarray(memory_grads, float)  # unread then
    off = _offload_columns(base, a, r, pick, elements)
    return optimizer_term(base, a, opt, grads, r["dp"], r["pp"], r["zero"], r["m"]) + off["exposed_s"], off


def _by_world(base: RunSpec, cols: dict, world: np.ndarray, *state: Optional[np.ndarray]) -> dict[str, np.ndarray]:
    """:func:`time_columns` of candidates of several device counts, one count at a time (``state``:
    its memory_optimizer, optimizer_elements and memory_grads, each None or per candidate)."""
    out = {k: np.zeros(len(world)) for k in time_keys(base, cols)}
    for w in np.unique(world):
        i = np.flatnonzero(world == w)
        part = time_columns(base, {k: np.asarray(v)[i] for k, v in cols.items()},
                            *(None if x is None else np.asarray(x)[i] for x in state))
        for k in out:
            out[k][i] = part[k]
    return out


def _rank_columns(base: RunSpec, a: Assumptions, r: dict, s: dict) -> dict[str, np.ndarray]:
    """Per slot (axis 0), a pipeline rank's terms: seconds per micro-batch (matmul, memory_bound,
    tp_comm, pp_comm, dp_comm, host) and per step (dp_end, tp_step, host_step), issued tp/pp/dp."""
    c = _layer_columns(base, a, r)

    def one_send(t, d, b, sp):
        spec = spec_at(base, t, 1, d, b, 1, 1, "gpipe", 0, sp, "none")
        return {"t": pp_send_time(spec, a), "lat": pp_send_latency(spec)}

    send = by_key([r["tp"], r["dp"], r["b"], r["sp"]], one_send, ("t", "lat"))
    n, heads = last_stage_work(base.model, s["n"], s["last"])  # + multi-token prediction (xpar.estimate.columns.mtp)
    x = rank_compute(c, {k: c[f"tp_{k}"] for k in ("f", "b", "end", "b_async", "cross")}, n, s["first"], heads, a)
    sends = per_slot([r["pp"], r["v"], r["v_shaped"], s["rank"]], lambda p, v, vs, rank: {
        "n": pp_sends(_placement(base, p, v, vs), rank)}, ("n",))["n"]
    pp = np.where(r["pp"] > 1, sends * send["t"], 0.0)
    overlap = np.array([pp_overlap_of(a, name) for name in SCHEDULE_NAMES])[r["schedule"]]
    x.update(pp_comm=pp_exposed(pp, np.where(r["pp"] > 1, sends * send["lat"], 0.0), overlap), pp_issued=pp)
    v = r["v"] if _staged(base) else np.ones_like(r["v"])  # v matters through recompute_layers only
    h = by_key([r["tp"], r["dp"], r["pp"], r["zero"], r["recompute"], v], lambda t, d, p, z, rec, v: host_costs(
        spec_at(base, t, p, d, 1, 1, v, "interleaved_1f1b" if v > 1 else "gpipe", z, False, RECOMPUTE[rec]),
        a.layer_overhead_ms * 1e-3), HOST_KEYS)
    x.update(host=rank_host(h, n, s["first"], s["last"]) + x["overhead"], host_step=host_step(h, n, s["first"], s["last"]))
    x.update(_dp_columns(base, a, r, s, x))
    reduced = grad_bytes(base, a)  # the dp reduction's width: Megatron reduces its main gradients at it
    kv_end = by_key([r["tp"], r["sp"]], lambda t, sp: {"s": kv_grad_reduce_time(
        spec_at(base, t, 1, 1, 1, 1, 1, "gpipe", 0, sp, "none"), reduced)}, ("s",))["s"]
    x["tp_step"] = n * kv_end  # replicated K/V weight gradients all-reduced over tp once a step
    if r["act_offload"].any():  # pp 1 only (xpar.estimate.memory.activation_offload)
        x["act_offload"] = act_offload_columns(base, a, r, c)
    return x


LAYER_KEYS = ("mm_f", "mm_b", "mem_f", "mem_b", "logits_mm_f", "logits_mm_b", "logits_mem_f", "logits_mem_b", "ovh_f",
              "ovh_b")
"""Keys of :func:`xpar.estimate.cost.layer_costs`."""


def _layer_columns(base: RunSpec, a: Assumptions, r: dict) -> dict[str, np.ndarray]:
    """:func:`xpar.estimate.cost.layer_costs` and :func:`xpar.estimate.cost.tp_times` (``tp_*``) of every
    candidate, once per distinct (tp, b, sp, recompute, stages); the kernel model's in one vectorised call
    (xpar.estimate.compute.kernel_costs.kernel_layer_columns) where it prices the hardware."""
    columns = [r["tp"], r["b"], r["sp"], r["recompute"], _stages(base, r)]

    def layer(tp, b, sp, rec, stages):
        spec = spec_at(base, tp, stages, 1, b, 1, 1, "gpipe", 0, sp, RECOMPUTE[rec])
        out = {f"tp_{k}": v for k, v in tp_times(spec, a.checkpoint_early_stop).items()}
        if kernel:
            return dict(out, **dict(zip(("policy", "share"), spec_recompute(spec, a.selective_recompute,
                                                                            a.recompute_layer_fraction))))
        return dict(out, **layer_costs(spec, a))

    kernel = kernel_priced(base.hardware, base.train.dtype)
    tp_keys = ("tp_f", "tp_b", "tp_end", "tp_b_async", "tp_cross")
    if not kernel:
        return by_key(columns, layer, LAYER_KEYS + tp_keys)
    first, inverse = unique_rows(_combined(columns))
    keys = list(zip(*(col[first].tolist() for col in columns)))
    values = [layer(*k) for k in keys]
    out = {k: np.array([x[k] for x in values], dtype=np.float64)[inverse] for k in tp_keys}
    cols = kernel_layer_columns(base, a, [k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys],
                                [x["policy"] for x in values], [x["share"] for x in values])
    return dict(out, **{k: v[inverse] for k, v in cols.items()})


def _rates(base: RunSpec, r: dict, time: np.ndarray) -> dict[str, np.ndarray]:
    """Throughput fields of :func:`xpar.estimate.cost.rates` for steps of ``time`` seconds."""
    cfg, s = base.model, base.seq_len
    tokens = r["b"] * r["m"] * r["dp"] * s
    hw = by_key([r["recompute"], _stages(base, r)], lambda rec, stages: {"f": fl.spec_hardware_flops_per_token(
        spec_at(base, 1, stages, 1, 1, 1, 1, "gpipe", 0, False, RECOMPUTE[rec]))}, ("f",))["f"]
    return rates(time, tokens, r["tp"] * r["pp"] * r["dp"], fl.model_flops_per_token(cfg, s) * tokens, hw * tokens,
                 compute_peak(base.hardware, base.train.dtype) / 1e12)


def _staged(base: RunSpec) -> bool:
    """Whether the share of blocks recomputed depends on the stages (``parallel.recompute_layers``
    set: of n_layers / (pp v) blocks per stage); else it is ``framework.recompute_layer_fraction``."""
    return base.parallel.recompute_layers is not None


def _stages(base: RunSpec, r: dict) -> np.ndarray:
    """Pipeline stages (pp x v) of each candidate where :func:`_staged`, else 1 for all (fewer keys)."""
    return r["pp"] * r["v"] if _staged(base) else np.ones(len(r["pp"]), dtype=np.int64)

