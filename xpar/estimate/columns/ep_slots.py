"""Each pipeline rank's expert-parallel all-to-alls as part of its own micro-batch (issue 43), for the cost model's
one orchestration (xpar.estimate.columns.step_time.slot_step: the planner's slots and the scalar estimate's ranks).

A rank's all-to-alls run inside its forward and backward of every micro-batch, warm-up and cool-down ones
included: the slowest rank is the one whose compute plus its own all-to-alls is longest, and the pipeline's
fill and drain carry the other ranks' all-to-alls too. Per rank: its MoE blocks (:func:`moe_blocks_on`) x one
MoE layer's dispatch and combine forward and their gradients backward
(xpar.estimate.expert_parallel.ep_layer_times), the forward's again in the recomputed blocks' backward
(xpar.estimate.expert_parallel.ep_replay); ``ep_a2a_overlap`` of them hidden behind that micro-batch's GEMMs
(DualPipe, Megatron-Core's 1F1B all-to-all overlap), with ``ep_shared_expert_overlap`` also behind its shared
experts' GEMMs (xpar.estimate.expert_parallel.shared_expert_share); the routed experts' matmuls stretched by the
busiest rank's load where the kernel model does not price it (xpar.estimate.expert_parallel.imbalance_share).
Units: seconds per micro-batch, arrays (slots, layouts).
"""
from __future__ import annotations

import numpy as np

from xpar.config.resolve import resolve_virtual_stages
from xpar.estimate.columns.keys import by_key, per_slot, spec_at
from xpar.estimate.expert_parallel import ep_layer_times, ep_replay, imbalance_share, moe_blocks_on, shared_expert_share
from xpar.estimate.step_parts import Assumptions, ep_a2a_overlap_of

EP_SLOT_KEYS = ("ep_comm", "ep_imbalance", "ep_issued")
"""Per-micro-batch keys :func:`ep_slot_columns` adds to a rank's terms (exposed, imbalance, issued)."""


def slot_moe_blocks(base, r: dict, s: dict, schedules: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(most, values, counts) of the MoE blocks of the ranks each slot stands for: ``most`` (S, L), the most any
    of them holds; ``values`` and ``counts`` (D, S, L), the distinct numbers and how many of its ranks hold each
    (count 0: padding), for the pipeline's fill. A slot is the rank itself where the slots are a layout's ranks
    (``s['by_rank']``); the planner's three slots stand for rank 0, the middle ranks (1 to pp - 2, or to pp - 1
    under V placement: xpar.estimate.columns.step_time._slots) and the last rank. Stages split and placed as
    :func:`xpar.estimate.columns.keys.spec_at` and each candidate's schedule (``schedules``: the names of
    r['schedule']'s codes) place them."""
    slot = np.broadcast_to(np.arange(s["n"].shape[0])[:, None], s["n"].shape)
    by_rank, seen = bool(s.get("by_rank", False)), {}

    def histogram(pp, v, sched, k) -> list:
        if (pp, v, sched, k) not in seen:
            layout = spec_at(base, 1, pp, 1, 1, 1, v, schedules[sched], 0, False, "none").layout
            if by_rank or pp == 1 or k != 1:
                ranks = [k if by_rank else (0 if k == 0 else pp - 1)]
            else:
                ranks = range(1, pp if layout.schedule_info.v_shaped else pp - 1)
            blocks = [moe_blocks_on(layout, base.model, q) for q in ranks]
            seen[pp, v, sched, k] = sorted((n, blocks.count(n)) for n in set(blocks)) or [(0, 0)]
        return seen[pp, v, sched, k]

    cols = [r["pp"], r["v"], r["schedule"], slot]
    d = int(per_slot(cols, lambda *key: {"d": len(histogram(*key))}, ("d",))["d"].max(initial=1))
    names = tuple(f"{x}{i}" for i in range(d) for x in "vc")
    got = per_slot(cols, lambda *key: {f"{x}{i}": (h[i][j] if i < len(h) else 0) for h in [histogram(*key)]
                                       for i in range(d) for j, x in enumerate("vc")}, names)
    values, counts = (np.stack([got[f"{x}{i}"] for i in range(d)]) for x in "vc")
    return values.max(axis=0), values, counts


def ep_slot_columns(base, a: Assumptions, cols: dict, r: dict, s: dict, matmul: np.ndarray,
                    schedules: tuple) -> dict[str, np.ndarray]:
    """:data:`EP_SLOT_KEYS` per slot and layout, seconds per micro-batch, of layouts ``r`` (``cols``: their
    columns, for the recompute replay) at ``base``'s ep under ``a``, each slot's GEMMs ``matmul`` seconds per
    micro-batch (module docstring), for the rank of the slot that holds the most MoE blocks (``ep_blocks``: how
    many; the slowest rank on a tie of micro-batch times, xpar.estimate.columns.step_time.slot_step); and
    ``ep_fill``: the exposed seconds of all the ranks the slot stands for, less ``s['count']`` times its own (0
    where they hold as many: the pipeline's fill, xpar.estimate.step_parts.fill_time). Zeros at ep = 1."""
    zero = np.zeros(np.shape(matmul))
    if base.layout.ep == 1:
        return {k: zero for k in EP_SLOT_KEYS + ("ep_fill", "ep_blocks")}
    one = by_key([r["b"], r["tp"], r["sp"]], lambda bb, t, sp: ep_layer_times(
        spec_at(base, t, 1, 1, bb, 1, 1, "gpipe", 0, sp, "none"), a.ep_dispatcher), ("f", "b"))
    per_block = one["f"] * (1 + replay_column(base, cols, lambda spec: ep_replay(spec, a))) + one["b"]
    overlap = by_key([r["pp"], r["schedule"]], lambda p, sch: {"o": ep_a2a_overlap_of(a, schedules[sch], p)},
                     ("o",))["o"]
    shared = shared_expert_share(base) if a.ep_shared_expert_overlap else None

    def exposed(issued):
        hidden = np.minimum(issued * overlap, matmul)  # an all-to-all hides only behind the GEMMs it runs beside
        if shared is not None:  # and behind the shared experts' GEMMs on their own stream
            hidden = np.minimum(hidden + matmul * shared, np.minimum(issued, matmul))
        return issued - hidden

    most, values, counts = slot_moe_blocks(base, r, s, schedules)
    issued = most * per_block
    fill = np.where(s["count"] > 0, (counts * exposed(values * per_block)).sum(axis=0) - s["count"] * exposed(issued),
                    0.0)  # a slot standing for no rank (the last under V placement) adds nothing
    return {"ep_comm": exposed(issued), "ep_imbalance": matmul * imbalance_share(base), "ep_issued": issued + zero,
            "ep_fill": fill, "ep_blocks": most + zero}


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
