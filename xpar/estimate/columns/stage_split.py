"""The pipeline split of a plan's candidate: even where pp x v divides the blocks, else the split
with lighter ends (:func:`xpar.config.layout.lighter_ends`; BLOOM 176B's 5, 10 x 6, 5 of 70
blocks over 12 stages), which the config states as ``parallel.first_stage_layers`` and
``last_stage_layers`` (Megatron-LM's --decoder-first/last-pipeline-num-layers,
:func:`xpar.config.layout.edge_split` filling the stages between). Candidates with neither are
dropped by the space's rule ``balanced`` (xpar.plan.space).

Here: one candidate's split and the config keys that state it (scalar), and the same as numpy
arrays over candidates for the vectorised cost model (xpar.estimate.columns.peak_memory, step_time, cp_ep): blocks
on each pipeline rank class, a grouping key, and how the memory model may prune its schedule
rows. Units: blocks (transformer layers). No torch import.
"""
from __future__ import annotations

import numpy as np

from xpar.config.layout import (
    SCHEDULES,
    Layout,
    balanced_split,
    edge_split,
    even_split,
    lighter_ends,
)
from xpar.config.remat import RECOMPUTE
from xpar.config.spec import with_fields

_SCHED = tuple(SCHEDULES)


def plan_split(n_layers: int, n_stages: int) -> list[int]:
    """Blocks per stage of a candidate with ``n_stages`` = pp x v stages: even, else lighter ends
    (:func:`xpar.config.layout.lighter_ends`); where neither exists (a candidate the space drops),
    the balanced split as a placeholder, as :func:`xpar.config.resolve.resolve_layer_split` gives."""
    if n_stages == 1:
        return [n_layers]
    ends = lighter_ends(n_layers, n_stages)
    return (even_split(n_layers, n_stages) or (edge_split(n_layers, n_stages, *ends) if ends else None)
            or balanced_split(n_layers, n_stages))


def split_fields(n_layers: int, pp: int, v: int) -> dict[str, int]:
    """The ``parallel.*`` keys that set a candidate's split: none where pp x v divides the blocks
    (or pp = 1), else ``first_stage_layers`` and ``last_stage_layers`` of the lighter ends (none
    where those do not exist either: validation then refuses the layout)."""
    if pp == 1 or n_layers % (pp * v) == 0:
        return {}
    ends = lighter_ends(n_layers, pp * v)
    return {} if ends is None else {"first_stage_layers": ends[0], "last_stage_layers": ends[1]}


def stage_blocks(n_layers: int, n_stages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first, middle, last) blocks per stage of :func:`plan_split` as int64 arrays over
    ``n_stages`` (pp x v per candidate): ceil(n_layers / n_stages) on every middle stage; the
    first and last may be negative where the split does not exist (:func:`splittable`)."""
    n = np.asarray(n_stages, dtype=np.int64)
    mid = -(-n_layers // n)
    rest = n_layers - (n - 2) * mid
    return (rest + 1) // 2, mid, rest // 2


def splittable(n_layers: int, n_stages: np.ndarray) -> np.ndarray:
    """Whether ``n_stages`` stages split the blocks evenly or with lighter ends (bool array)."""
    last = stage_blocks(n_layers, n_stages)[2]
    return (np.asarray(n_stages) == 1) | (last >= 0)


def rank_blocks(n_layers: int, pp: np.ndarray, v: np.ndarray, v_shaped: np.ndarray) -> np.ndarray:
    """Blocks held by rank 0, a middle rank and the last rank (xpar.estimate.columns.step_time's slots, axis 0)
    of each candidate (axis 1; v resolved, 1 without pipelining): loop placement, rank 0 the first
    stage and v - 1 middle ones, the last rank the last stage and v - 1 middle ones; V placement
    (``v_shaped``: zbv, dualpipev), rank 0 both end stages; every middle rank v middle stages.
    n_layers / pp on every rank of an even split; n_layers without pipelining."""
    pp, v = np.asarray(pp, dtype=np.int64), np.asarray(v, dtype=np.int64)
    first, mid, last = stage_blocks(n_layers, pp * v)
    rank0 = np.where(np.asarray(v_shaped, dtype=bool), first + last, first + (v - 1) * mid)
    out = np.stack([rank0, v * mid, last + (v - 1) * mid])
    return np.where(pp == 1, n_layers, out)


def split_key(n_layers: int, pp: np.ndarray, v: np.ndarray) -> np.ndarray:
    """A grouping column: v where pp x v does not divide the blocks (the split then depends on v
    beside pp), else 0 (every rank holds n_layers / pp blocks whatever v)."""
    v = np.asarray(v, dtype=np.int64)
    return np.where(n_layers % (np.asarray(pp, dtype=np.int64) * v) != 0, v, 0)


def prune_modes(coef: tuple, stab: np.ndarray, grp: np.ndarray, simple: np.ndarray) -> np.ndarray:
    """How xpar.estimate.columns.peak_memory may prune each candidate's schedule rows (live chunks: all, of the
    first stage, of the last) to those no other row dominates (its closed forms): 1 where every
    coefficient of its bytes per chunk (``coef``: the kept and the copies' (middle, first -
    middle, last - middle) per stage group) is >= 0, or where its ranks are ``simple`` (one stage
    per rank, or V placement: an end rank's chunks are all first- or last-stage ones) and every
    stage's bytes (``stab`` [group, stage class, column]) are >= 0; 2 where only the latter holds
    (lighter ends make first - middle < 0; loop placement with v > 1): pruned on (all - first -
    last, first, last), whose coefficients are the stages' bytes; 0 otherwise (the whole walk).
    ``grp``: each candidate's stage group."""
    nonneg = np.all([np.all(c >= 0, axis=1) for c in coef], axis=0)
    absolute = np.all(np.nan_to_num(stab[:, :3][:, :, [0, 3]]) >= 0, axis=(1, 2))
    simple = np.asarray(simple, dtype=bool)
    return np.where(nonneg[grp] | (simple & absolute[grp]), 1, np.where(absolute[grp], 2, 0))


def memory_spec(base, c: dict, i: int):
    """The RunSpec of candidate ``i`` of xpar.estimate.columns.peak_memory's int columns ``c`` as the memory model
    reads it (layout and train group, the split of :func:`plan_split`; the rest from
    ``base``), built without validation."""
    tp, pp, dp, b, m, v, z = (c[k][i].item() for k in ("tp", "pp", "dp", "b", "m", "v", "zero"))
    sched, rec, sp = _SCHED[c["sched"][i]], RECOMPUTE[c["rec"][i]], bool(c["sp"][i])
    split = plan_split(base.model.n_layers, pp * v)
    layout = Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=b, micro_batches=m, seq_len=base.seq_len, ep=base.layout.ep,
                    layer_split=tuple(split), schedule=sched, zero_stage=z, sequence_parallel=sp, recompute=rec,
                    etp=base.layout.etp)
    train = with_fields(base.train, micro_batch_size=b, global_batch_size=b * m * dp)
    return with_fields(base, train=train, layout=layout)
