"""Peak memory per device of many layouts at once: :func:`xpar.estimate.memory.per_device.memory` over
candidate columns (:mod:`xpar.plan.context`), equal to it on every candidate (relative 1e-9).

Each sub-result comes from the scalar function, once per distinct key of the columns it depends
on, combined with array arithmetic: model states and their buffers per (tp, pp, placement, dp,
ZeRO stage, deferred reduction) and rank class (:func:`_state_table`); one stage's activations per
(tp, sp, recompute, autocast, stages), scaled by b (:func:`_stage_table`); the schedule's peak as
live micro-batch chunks per (schedule, pp, m, v) and rank, in closed form per schedule
(:func:`_closed_entries`) or from the action list; pipeline buffers and token ids as formulas.

Returns the pipeline rank with the largest total (the first on ties) on its most loaded dp rank,
keys :data:`xpar.estimate.terms.COLUMN_MEMORY_KEYS`. Units: bytes. No torch import.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from xpar.config.layout import SCHEDULES, Layout
from xpar.config.remat import RECOMPUTE as _RECOMPUTE
from xpar.config.spec import RunSpec
from xpar.estimate.memory import activations, model_states
from xpar.estimate.memory import buffers
from xpar.estimate.columns.mixed_blocks import blocks_vary
from xpar.estimate.columns.stage_split import memory_spec, prune_modes, split_key
from xpar.estimate.step_parts import assumptions_for
from xpar.estimate.memory.offload import host_columns
from xpar.estimate.columns.act_offload import act_offload_memory, offload_column
from xpar.estimate.terms import COLUMN_MEMORY_KEYS
from xpar.estimate.columns.vocab_groups import columns_by_vocab
from xpar.estimate.comm.hsdp import shard_group_spec

KEYS = COLUMN_MEMORY_KEYS
"""The columns :func:`memory_columns` returns: ``memory_<term>`` for each term of
:data:`xpar.estimate.memory.per_device.MEMORY_TERMS` (bytes), the total (bytes), the pipeline rank it is on,
the usable bytes of a device and whether the total fits in them; the optimizer's elements on that
device (offloaded or not), the host bytes per node an offloaded optimizer needs (0 without
offload) and whether they fit ``hardware.host_memory_gb`` (xpar.estimate.memory.offload)."""
_SCHED = tuple(SCHEDULES)


def _codes(values: np.ndarray, names: tuple) -> np.ndarray:
    """Index of each value in ``names`` (int64)."""
    out = np.full(len(values), -1, dtype=np.int64)
    for k, name in enumerate(names):
        out[values == name] = k
    if (out < 0).any():
        raise ValueError(f"unknown value {str(values[out < 0][0])!r}; expected one of {names}")
    return out


def int_columns(cols: dict, o: model_states.MemoryOptions) -> dict[str, np.ndarray]:
    """The candidate columns as int64 arrays (schedule and recompute as codes), v resolved
    (1 without pipelining, :func:`xpar.config.resolve.resolve_virtual_stages`); ``offload`` where the
    optional column is absent: ``o.cpu_offload_optimizer``; interleaved 1F1B at m = pp as looped BFS
    where ``o.interleaved_m_per_pp`` (:func:`xpar.estimate.memory.activations.memory_schedule`)."""
    c = {k: np.asarray(cols[k], dtype=np.int64) for k in ("tp", "pp", "dp", "b", "m", "zero")}
    c["b"] = np.maximum(c["b"], 1) if np.asarray(cols["b"]).dtype.kind != "f" else np.asarray(cols["b"], float)
    c["v"] = np.where(c["pp"] == 1, 1, np.asarray(cols["v"], dtype=np.int64))
    c["sched"] = _codes(np.asarray(cols["schedule"]), _SCHED)
    c["rec"] = _codes(np.asarray(cols["recompute"]), _RECOMPUTE)
    c["sp"] = np.asarray(cols["sp"], dtype=bool).astype(np.int64)
    c["offload"] = np.asarray(cols["offload"], dtype=bool).astype(np.int64) if "offload" in cols else \
        np.full(len(c["tp"]), int(o.cpu_offload_optimizer), dtype=np.int64)
    bfs = o.interleaved_m_per_pp & (c["sched"] == _SCHED.index("interleaved_1f1b")) & (c["m"] == c["pp"])
    c["sched"] = np.where(bfs, _SCHED.index("looped_bfs"), c["sched"])  # Megatron's warm-up (memory_schedule)
    return c


def _group(*arrays: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of equal rows over non-negative int arrays: (one representative row index per
    group, group index of each row). A mixed-radix key, counted (no sort) when its range is small."""
    key, size = np.zeros(len(arrays[0]), dtype=np.int64), 1
    for a in arrays:
        lo, hi = (int(a.min()), int(a.max())) if len(a) else (0, 0)
        key, size = key * (hi - lo + 1) + (a - lo), size * (hi - lo + 1)
    if size > max(1 << 16, 4 * len(key)):
        _, rep, inv = np.unique(key, return_index=True, return_inverse=True)
        return rep, inv.ravel()
    present = np.bincount(key, minlength=size) > 0
    remap = np.cumsum(present) - 1
    rep = np.empty(size, dtype=np.int64)
    rep[key] = np.arange(len(key))
    return rep[present], remap[key]


def _rank_class(layout: Layout, r: int) -> int:
    """2 x (holds the first stage) + (holds the last stage)."""
    return 2 * layout.has_first_stage(r) + layout.has_last_stage(r)


def _stage_class(stage: int, n_stages: int) -> int:
    """2 x (first stage) + (last stage)."""
    return 2 * (stage == 0) + (stage == n_stages - 1)


def _by_zero(base: RunSpec, c: dict, o: model_states.MemoryOptions) -> tuple[np.ndarray, np.ndarray]:
    """(autocast, residual-stream bytes er) of each candidate, from
    :func:`xpar.estimate.memory.per_device.precision` once per ZeRO stage."""
    rep, inv = _group(c["zero"])
    rec = [model_states.precision(memory_spec(base, c, i), o) for i in rep]
    return (np.array([r["autocast"] for r in rec], dtype=np.int64)[inv],
            np.array([r["er"] for r in rec], dtype=np.int64)[inv])


def _class_ranks(layout: Layout, cfg=None) -> dict[int, list[int]]:
    """The pipeline ranks whose states are priced, by rank class (:func:`_rank_class`): the first of
    each class present (the owners of the first and last stages, a rank holding neither among ranks
    0-2); with ``cfg`` (a model whose blocks differ) the first rank holding neither of each count of
    MoE blocks (``cfg.is_moe_layer``; such ranks hold as many blocks)."""
    ends, first, out = {layout.stage_owner(0), layout.stage_owner(layout.n_stages - 1)}, {}, {}
    for r in range(layout.pp) if cfg else sorted(ends | set(range(min(layout.pp, 3)))):
        k = _rank_class(layout, r)
        moe = sum(cfg.is_moe_layer(i) for s in layout.stages_of(r) for i in layout.stage_layers(s)) if cfg and k == 0 else 0
        first.setdefault((k, moe), r)
    for (k, _), r in first.items():
        out.setdefault(k, []).append(r)
    return out


def rank_states(spec: RunSpec, r: int, o: model_states.MemoryOptions, og: model_states.MemoryOptions) -> tuple:
    """Pipeline rank ``r``'s row of :func:`_state_table` (bytes; the optimizer's elements)."""
    dp_rank = model_states.most_loaded_dp_rank(spec, r, o.zero1)
    st, buf = model_states.held_state_terms(spec, r, dp_rank, og), buffers.state_buffer_terms(spec, r, og)
    return (st["params_master"] + st["params_compute"], st["grads"], st["optimizer"], sum(buf.values()),
            model_states.held_numel(spec, r, dp_rank, o.zero1)["optimizer"])


def _state_table(base: RunSpec, c: dict, o: model_states.MemoryOptions) -> tuple[np.ndarray, np.ndarray]:
    """Per group of (tp, pp, placement, dp, ZeRO stage, m > 1, offload) and rank class: bytes of
    (params less autocast's copies, grads, optimizer, model-state buffers) and the optimizer's
    elements on the rank's most loaded dp rank -- the scalar functions on a representative
    candidate. v only where pp x v does not divide the blocks (:func:`xpar.estimate.columns.stage_split.split_key`):
    with even stages a rank holds n_layers / pp blocks whatever v, and the embedding or the output
    by its class. Where a MoE model's dense blocks sit on some middle ranks (xpar.estimate.columns.mixed_blocks.blocks_vary),
    the middle rank with the most state bytes stands for all: an upper bound, exact where the middle
    ranks peak on as many live chunks (DualPipeV; ZBV at m >= 2 pp - 2) or the heaviest on the most.
    Returns (table [groups, 4 classes, 5], group of each candidate); NaN where a class is absent."""
    vsh = np.array([SCHEDULES[s].v_shaped for s in _SCHED], dtype=np.int64)[c["sched"]]
    rep, inv = _group(c["tp"], c["pp"], vsh, c["dp"], c["zero"], (c["m"] > 1).astype(np.int64), c["offload"],
                      split_key(base.model.n_layers, c["pp"], c["v"]))
    table, cfg = np.full((len(rep), 4, 5), np.nan), base.model if blocks_vary(base) else None
    for g, i in enumerate(rep):
        spec = shard_group_spec(memory_spec(base, c, i))  # hierarchical ZeRO: states over the shard group
        og = replace(o, cpu_offload_optimizer=bool(c["offload"][i]))
        for k, ranks in _class_ranks(spec.layout, cfg).items():
            table[g, k] = max((rank_states(spec, r, o, og) for r in ranks), key=lambda x: sum(x[:4]))
    return table, inv


def _stage_table(base: RunSpec, c: dict, o: model_states.MemoryOptions, autocast: np.ndarray) -> tuple:
    """Per group of (b, tp, sp, recompute, autocast, stages) and stage class (:func:`_stage_class`):
    one micro-batch's bytes (kept until its backward, transient during its forward, transient
    during its backward, autocast's weight copies: :func:`xpar.estimate.memory.activations.stage_chunk_bytes`). The scalar function runs once per
    group without b: every activation term there is s b times bytes per token, the weight
    copies do not depend on b, so the others are scaled by b / b_rep. Returns (table [groups,
    4, 4], group of each candidate)."""
    rep0, inv0 = _group(c["tp"], c["sp"], c["rec"], autocast, c["pp"] * c["v"])
    unit = np.full((len(rep0), 4, 4), np.nan)
    for g, i in enumerate(rep0):
        spec = memory_spec(base, c, i)
        n = spec.layout.n_stages
        for st in sorted({0, 1 if n > 2 else 0, n - 1}):
            unit[g, _stage_class(st, n)] = activations.stage_chunk_bytes(spec, st, o)
        unit[g, :, :3] /= c["b"][i]
    rep, inv = _group(inv0, np.unique(c["b"], return_inverse=True)[1].ravel())  # b: float when cp-folded
    scale = np.ones((len(rep), 1, 4))
    scale[:, 0, :3] = c["b"][rep][:, None]
    return unit[inv0[rep]] * scale, inv


def _rank_events(schedule: str, pp: int, m: int, v: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The events of :func:`xpar.estimate.memory.activations.stage_events` as live micro-batch chunks by
    stage class (all of the rank's, of the first stage, of the last stage). Returns (rows [n, 3],
    kind 0 forward / 1 backward, stage class of the acting stage)."""
    stages, per_stage, kind, acting = activations.stage_events(schedule, pp, m, v, rank)
    st, n = np.array(stages, dtype=np.int64), pp * v
    rows = np.stack([per_stage.sum(1), per_stage @ (st == 0), per_stage @ (st == n - 1)], axis=1)
    cls = 2 * (st == 0) + (st == n - 1)
    return rows, kind, cls[acting]


def _maximal(x: np.ndarray, prune: bool) -> np.ndarray:
    """Distinct rows of ``x`` ([n, 3] live-chunk counts, >= 0); with ``prune``, only those no
    other row dominates (>= in every column): a maximum of a non-negative linear function is
    always on one of them."""
    return _maximal_typed(x, np.zeros(len(x), dtype=np.int64), prune)[0]


def _maximal_typed(x: np.ndarray, types: np.ndarray, prune: bool) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_maximal` within each type (event kinds whose transients differ): (rows, types).
    Rows and type are packed into one int64 (radix one more than each column's largest value)
    for a 1-d unique."""
    xi = x.astype(np.int64).reshape(-1, 3)
    if len(xi) < 2:
        return xi.astype(float), np.asarray(types, dtype=np.int64)
    n_all, n_last, n_first = (int(xi[:, col].max()) + 1 for col in (0, 2, 1))
    u = np.unique(((np.asarray(types, dtype=np.int64) * n_first + xi[:, 1]) * n_last + xi[:, 2]) * n_all + xi[:, 0])
    if prune:  # per (type, first, last) count, the most chunks in all (sorted last in each group)
        g = u // n_all
        u = u[np.append(g[1:] != g[:-1], True)]
    rest = u // n_all
    rows, kinds = np.stack([u % n_all, (rest // n_last) % n_first, rest % n_last], axis=1), rest // (n_last * n_first)
    if prune and len(rows) > 1:
        same = kinds[None, :] == kinds[:, None]
        keep = ~(((rows[None, :, :] >= rows[:, None, :]).all(-1) & same).sum(1) > 1)
        rows, kinds = rows[keep], kinds[keep]
    return rows.astype(float), kinds


def _covers(upper: np.ndarray, lower: np.ndarray) -> bool:
    """Every row of ``lower`` is dominated by some row of ``upper``."""
    return len(lower) == 0 or (len(upper) > 0 and bool((upper[None, :, :] >= lower[:, None, :]).all(-1).any(1).all()))


def _walk_entries(schedule: str, pp: int, m: int, v: int, prune: bool) -> list[tuple]:
    """(rank, rank class, F rows, A rows, A types) of every rank, from the schedule's action
    list (:func:`_rank_events`): F rows (forwards: the kept peak and autocast's copies), A rows
    with type 3 x kind + stage class (every event: the peak with transients), each reduced by
    :func:`_maximal` within its type."""
    layout = Layout(dp=1, tp=1, pp=pp, micro_batch_size=1, micro_batches=m, seq_len=1,
                    layer_split=(1,) * (pp * v), schedule=schedule)
    out = []
    for r in range(pp):
        rows, kind, cls = _rank_events(schedule, pp, m, v, r)
        typed, types = _maximal_typed(rows, 3 * kind + cls, prune)
        out.append((r, _rank_class(layout, r), _maximal(rows[kind == 0], prune), typed, types))
    return out


def _entry(r: int, rc: int, typed: dict) -> tuple:
    """A rank entry of :func:`_walk_entries` from its maximal row per type ({type: (all,
    first-stage, last-stage) live chunks})."""
    rows = np.array(list(typed.values()), dtype=float).reshape(-1, 3)
    types = np.array(list(typed.keys()), dtype=np.int64)
    return r, rc, _maximal(rows[types < 3], True), rows, types


def _closed_entries(schedule: str, pp: int, m: int, v: int, ends: Optional[list] = None,
                    by_middle: bool = False) -> Optional[list[tuple]]:
    """:func:`_walk_entries` (pruned; of the middle ranks only those :func:`_middle` keeps)
    without the action list, where the peaks have a closed form: gpipe (m chunks), 1F1B
    (min(m, pp - r), Narayanan et al. 2021), looped BFS (every forward before any backward),
    the V-shaped zbv (rank 0: min(m + 1, 2 pp); rank k > 0: min(2 m, m + k + 1, 2 pp)) and
    dualpipev (2 pp + 1; m >= 2 pp), read off torch's action lists; interleaved 1F1B counted as
    arrays from their order (:func:`_interleaved_entries`; ``ends``: its entries of ranks 0 and
    pp - 1 when already computed; ``by_middle``: pruned on middle chunks), as is zero bubble
    (torch's InterleavedZeroBubble). Equal to the walk on a grid of pp, m, v
    (tests/plan/test_plan_memory.py). None for an unknown schedule."""
    given, ends = ends, sorted({0, pp - 1})
    if schedule in ("gpipe", "1f1b"):
        top = [m if schedule == "gpipe" else min(m, pp - r) for r in range(pp)]
        out = []
        for r in ends:
            cls, row = 2 * (r == 0) + (r == pp - 1), (top[r], top[r] * (r == 0), top[r] * (r == pp - 1))
            out.append(_entry(r, cls, {cls: row, 3 + cls: row}))
        return sorted(out + _middle({k: top[k] for k in range(1, pp - 1)}))
    if schedule == "looped_bfs":
        return sorted([_looped_bfs_entry(r, pp, m, v) for r in ends] + _middle({k: v * m for k in range(1, pp - 1)}))
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        zb = schedule == "zero_bubble"
        mid = {k: min(m * v, _interleaved_warmup(k, pp, m, v, zb) + 1 + k * zb) for k in range(1, pp - 1)}
        given = _interleaved_entries([(r, pp, m, v, zb) for r in ends], by_middle) if given is None else given
        return sorted(list(given) + _middle(mid))
    if schedule in ("zbv", "dualpipev") and v == 2:
        if schedule == "dualpipev":
            first, rest = [(2 * pp + 1, 2 * pp, 1)], {k: 2 * pp + 1 for k in range(1, pp)}
        else:
            first = [(min(m + 1, 2 * pp), min(m, 2 * pp - 1), 1), (min(m, 2 * pp), min(m, 2 * pp), 0)]
            rest = {k: min(2 * m, m + k + 1, 2 * pp) for k in range(1, pp)}
        return [_entry(0, 3, {1: first[0], 4: first[0], 2: first[-1], 5: first[-1]})] + _middle(rest)
    return None


def _middle(tops: dict[int, int]) -> list[tuple]:
    """Entries of the middle ranks (class 0) given each one's most live chunks ({rank: n}; the
    same after a forward and before a backward, all of the rank's stages in the middle): only
    a rank with more than every earlier one (the others are dominated, never the first maximum)."""
    out, best = [], 0
    for k, n in sorted(tops.items()):
        if n > best:
            out.append(_entry(k, 0, {0: (n, 0, 0), 3: (n, 0, 0)}))
            best = n
    return out


def _interleaved_warmup(k, pp, m, v, zero_bubble):
    """Warm-up forwards of rank k: min(v m, (v - 1) q + f (pp - 1 - k)), q = m // max(1, m // pp)
    micro-batches per round, f = 2 (interleaved 1F1B), 1 (zero bubble; torch's _get_warmup_ops).
    Numbers or numpy arrays alike."""
    q = m // np.maximum(1, m // pp)
    return np.minimum(v * m, (v - 1) * q + (2 - zero_bubble) * (pp - 1 - k))


def _ragged(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated ranges [starts[i], ends[i]): (index i of each value, the values)."""
    n = np.maximum(ends - starts, 0)
    seg = np.repeat(np.arange(len(n)), n)
    return seg, np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n) + np.repeat(starts, n)


def _interleaved_entries(items: list[tuple], by_middle: bool = False) -> list[tuple]:
    """Rank entries of :func:`_walk_entries` for (rank k, pp > 1, m, v, zero_bubble) items, the
    end ranks 0 and pp - 1, all at once: interleaved 1F1B in the order of
    :func:`xpar.estimate.schedule.interleaved_actions`, or torch's InterleavedZeroBubble. Both:
    rounds of q = m // max(1, m // pp) micro-batches, w warm-up forwards
    (:func:`_interleaved_warmup`), then forward w + j before backward j (zero bubble: backward
    for inputs j), then the drain; the i-th forward on local stage (i // q) % v, the i-th
    backward on v - 1 - (i // q) % v. A chunk is released by its backward, or by its weight
    backward, which zero bubble runs k backwards late: released before backward j, max(0, j -
    lag), lag 0 or k. Past the lag the live chunks repeat every q v steps (each local stage
    gains q forwards and q releases): the events are the warm-up, lag + q v steady steps and
    the drain. A rank holds the first or the last stage, not both: rows reduce in 2-d, on (all,
    held) chunks, or with ``by_middle`` on (all - held, held), which keeps every maximum of non-negative
    bytes per middle and per end chunk (lighter ends: xpar.estimate.columns.stage_split.prune_modes)."""
    k, pp, m, v, zb = (np.array([it[i] for it in items], dtype=np.int64) for i in range(5))
    q, total, w, lag = m // np.maximum(1, m // pp), v * m, _interleaved_warmup(k, pp, m, v, zb), k * zb
    seg_f, n_fwd = _ragged(np.ones_like(m), np.minimum(total, w + lag + q * v) + 1)
    seg_1, j_1 = _ragged(np.zeros_like(m), np.minimum(total, lag + q * v))
    seg_2, j_2 = _ragged(np.maximum(0, total - w - 1), total)
    seg, j = np.concatenate([seg_f, seg_1, seg_2]), np.concatenate([n_fwd, j_1, j_2])
    kind = np.repeat([0, 1], [len(seg_f), len(seg_1) + len(seg_2)])
    qs, vs, ws, ls, ts = q[seg], v[seg], w[seg], lag[seg], total[seg]
    n_f = np.where(kind == 0, j, np.minimum(ts, ws + 1 + j))
    n_b = np.maximum(0, np.where(kind == 0, j - ws - 1, j) - ls)
    local = np.where(kind == 0, ((j - 1) // qs) % vs, vs - 1 - (j // qs) % vs)

    def done(c: np.ndarray, n: np.ndarray) -> np.ndarray:  # forwards on local stage c among the first n
        return (n // (qs * vs)) * qs + np.clip(n % (qs * vs) - c * qs, 0, qs)

    first, last = (k == 0)[seg], (k == pp - 1)[seg]
    held = np.where(first, done(0, n_f) - done(vs - 1, n_b), np.where(last, done(vs - 1, n_f) - done(0, n_b), 0))
    types = 3 * kind + 2 * (first & (local == 0)) + (last & (local == vs - 1))
    g, tot, held = _pareto_2d(seg * 6 + types, n_f - n_b - held * by_middle, held)
    gf, tot_f, held_f = _pareto_2d(g[g % 6 < 3] // 6, tot[g % 6 < 3], held[g % 6 < 3])
    tot, tot_f = tot + held * by_middle, tot_f + held_f * by_middle
    cut = np.searchsorted(g // 6, np.arange(len(items) + 1))
    cut_f = np.searchsorted(gf, np.arange(len(items) + 1))
    out = []
    for i, (r, last_rank) in enumerate(zip(k.tolist(), (pp - 1).tolist())):
        a, f = slice(cut[i], cut[i + 1]), slice(cut_f[i], cut_f[i + 1])
        cols = (lambda t, h: np.stack([t, h * (r == 0), h * (r == last_rank)], axis=1).astype(float))  # noqa: E731
        out.append((r, 2 * (r == 0) + (r == last_rank), cols(tot_f[f], held_f[f]), cols(tot[a], held[a]), g[a] % 6))
    return out


def _pareto_2d(group: np.ndarray, tot: np.ndarray, held: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group, the (tot, held) pairs no other pair of the group dominates, sorted by group:
    the most tot per held count, kept where it beats every larger held count's."""
    big = int(tot.max()) + 1 if len(tot) else 1
    hb = int(held.max()) + 1 if len(held) else 1
    u = np.unique((group * hb + held) * big + tot)
    gh = u // big
    u = u[np.append(gh[1:] != gh[:-1], True)]
    g, h, t = u // big // hb, (u // big) % hb, u % big
    order = np.lexsort((-h, g))
    g, h, t = g[order], h[order], t[order]
    vals = t + g * big
    prev = np.concatenate([[-1], np.maximum.accumulate(vals)[:-1]])
    keep = vals > prev
    return g[keep], t[keep], h[keep]


def _looped_bfs_entry(r: int, pp: int, m: int, v: int) -> tuple:
    """Looped BFS on rank r: every forward of local stage j (j = 0..v-1, stage j pp + r) before
    those of j + 1, then the backwards from the last local stage down: at the forwards of j and
    before the backwards of j, stages 0..j hold m chunks each."""
    typed = {}
    for j in range(v):
        st = j * pp + r
        cls = 2 * (st == 0) + (st == pp * v - 1)
        row = (m * (j + 1), m * (r == 0), m * (st == pp * v - 1))
        typed[cls], typed[3 + cls] = row, row
    return _entry(r, 2 * (r == 0) + (r == pp - 1), typed)


_ROWS: dict[tuple, dict] = {}
"""Memo of :func:`_walk_rows`."""


def _rows_of(keys: list[tuple], prune: int) -> list[dict]:
    """:func:`_walk_rows` of many (schedule, pp, m, v) keys, the end ranks of the interleaved
    ones computed in one batch (:func:`_interleaved_entries`)."""
    todo = [key for key in dict.fromkeys(keys) if prune and key[0] in ("interleaved_1f1b", "zero_bubble")
            and key + (prune,) not in _ROWS]
    items = [(r, pp, m, v, sched == "zero_bubble") for sched, pp, m, v in todo for r in sorted({0, pp - 1})]
    done = _interleaved_entries(items, prune == 2) if items else []
    for key in todo:
        ends, done = done[:len({0, key[1] - 1})], done[len({0, key[1] - 1}):]
        _ROWS[key + (prune,)] = padded_entries(_prune_ranks(_closed_entries(*key, ends=ends)))
    return [_walk_rows(*key, prune) for key in keys]


def _walk_rows(schedule: str, pp: int, m: int, v: int, prune: int) -> dict[str, np.ndarray]:
    """The rank entries of :func:`_walk_entries` that can hold the peak, in closed form where
    one holds (:func:`_closed_entries`, with ``prune``), as arrays (:func:`padded_entries`). ``prune``
    (xpar.estimate.columns.stage_split.prune_modes): 0 none; 1 (every coefficient >= 0) rows and ranks dominated
    dropped (a rank when an earlier one of the same class dominates all its rows: never the
    first maximum); 2 the same in the middle-chunk basis where a closed form holds, else none."""
    key = (schedule, pp, m, v, prune)
    if key not in _ROWS:
        closed = _closed_entries(schedule, pp, m, v, by_middle=prune == 2) if prune else None
        entries = closed or _walk_entries(schedule, pp, m, v, prune == 1)
        _ROWS[key] = padded_entries(_prune_ranks(entries) if closed or prune == 1 else entries)
    return _ROWS[key]


def _prune_ranks(entries: list[tuple]) -> list[tuple]:
    """``entries`` (by increasing rank) less those an earlier one dominates (:func:`_dominates`)."""
    kept: list[tuple] = []
    for entry in entries:
        if not any(_dominates(e, entry) for e in kept):
            kept.append(entry)
    return kept


def _dominates(early: tuple, late: tuple) -> bool:
    """Rank entry ``early`` is at least ``late`` for any non-negative coefficients."""
    if early[1] != late[1] or not _covers(early[2], late[2]):
        return False
    return all(_covers(early[3][early[4] == kind], late[3][late[4] == kind]) for kind in np.unique(late[4]))


_FIELDS = ("params", "grads", "optimizer", "activations", "comm_buffers", "total", "optimizer_elements")


def memory_fields(ctx: dict, idx: np.ndarray, slot, first, kept: np.ndarray, total: np.ndarray,
                  copies: np.ndarray) -> dict:
    """The memory terms of candidates ``idx`` on the pipeline rank of state-table slot ``slot`` (a rank
    class, or a rank of one layout), holding the first stage where ``first`` (numbers or arrays over
    ``idx``), from the schedule's peaks (kept bytes, with transients, autocast's weight copies): the
    one sum of a device's terms (the overhead: ``hardware.framework_overhead_gb``). Bytes."""
    table, inv = ctx["state"]
    st = table[inv[idx], slot]
    token = np.where(first, ctx["token"][idx], 0.0)
    out = {"params": st[:, 0] + copies, "grads": st[:, 1], "optimizer": st[:, 2],
           "activations": (kept + token) + (total - kept), "comm_buffers": st[:, 3] + ctx["p2p"][idx]}
    out["total"] = out["params"] + out["grads"] + out["optimizer"] + out["activations"] + out["comm_buffers"] \
        + ctx["overhead"]
    out["optimizer_elements"] = st[:, 4]
    return out


def single_stage(ctx: dict, c: dict, out: dict) -> None:
    """Candidates without pipelining: one micro-batch at a time on rank 0, which holds the
    only stage (kept, plus the larger transient)."""
    idx = np.flatnonzero(c["pp"] == 1)
    sv = ctx["stab"][ctx["sinv"][idx], 3]
    vals = memory_fields(ctx, idx, 3, True, sv[:, 0], sv[:, 0] + np.maximum(sv[:, 1], sv[:, 2]), sv[:, 3])
    for k in _FIELDS:
        out[k][idx] = vals[k]
    out["pp_rank"][idx] = 0


def _coefficients(stab: np.ndarray, col: int) -> np.ndarray:
    """Bytes per live chunk of column ``col`` of the stage table as coefficients of (all chunks,
    first-stage chunks, last-stage chunks): (middle, first - middle, last - middle); middle 0
    where no stage is in the middle (then every chunk is a first or last one)."""
    mid = np.nan_to_num(stab[:, 0, col], nan=0.0)
    return np.stack([mid, stab[:, 2, col] - mid, stab[:, 1, col] - mid], axis=1)


def padded_entries(entries: list[tuple]) -> dict[str, np.ndarray]:
    """Rank entries (rank, class, F rows, A rows, A types) as arrays over entries: rank, rank
    class, F rows [e, RF, 3] and A rows [e, RA, 3] with their types [e, RA], padded by repeating
    a row (which leaves every maximum as it is)."""
    n_f, n_a = max(len(e[2]) for e in entries), max(len(e[3]) for e in entries)
    pick = lambda x, n: np.resize(np.arange(len(x)), n)  # noqa: E731
    return {"rank": np.array([e[0] for e in entries]), "cls": np.array([e[1] for e in entries]),
            "f": np.stack([e[2][pick(e[2], n_f)] for e in entries]),
            "a": np.stack([e[3][pick(e[3], n_a)] for e in entries]),
            "types": np.stack([e[4][pick(e[4], n_a)] for e in entries])}


def _concat(parts: list[dict]) -> dict[str, np.ndarray]:
    """:func:`padded_entries` arrays of several keys as one, rows padded to the longest (repeating the
    last row)."""
    out = {k: np.concatenate([p[k] for p in parts]) for k in ("rank", "cls")}
    for k, rows in (("f", "f"), ("a", "a"), ("types", "a")):
        n = max(p[rows].shape[1] for p in parts)
        out[k] = np.concatenate([p[k][:, np.minimum(np.arange(n), p[rows].shape[1] - 1)] for p in parts])
    return out


def _pipelined(ctx: dict, c: dict, out: dict) -> None:
    """Candidates with pp > 1: every rank of :func:`_walk_rows` of each candidate's (schedule,
    pp, m, v), as (candidate, rank) pairs: peaks as products of the rank's rows with the
    candidate's bytes per chunk, then the first rank with the largest total (the scalar loop).
    Rows pruned as :func:`xpar.estimate.columns.stage_split.prune_modes` allows (:func:`_walk_rows`)."""
    pipe = np.flatnonzero(c["pp"] > 1)
    coef = (_coefficients(ctx["stab"], 0), _coefficients(ctx["stab"], 3))
    vsh = np.array([SCHEDULES[s].v_shaped for s in _SCHED], dtype=bool)[c["sched"][pipe]]
    modes = prune_modes(coef, ctx["stab"], ctx["sinv"][pipe], vsh | (c["v"][pipe] == 1))
    for p in np.unique(modes).tolist():
        part = pipe[modes == p]
        rep, inv = _group(c["sched"][part], c["pp"][part], c["m"][part], c["v"][part])
        per_key = _rows_of([(_SCHED[c["sched"][i]], int(c["pp"][i]), int(c["m"][i]), int(c["v"][i]))
                            for i in part[rep]], p)
        ent, sizes = _concat(per_key), np.array([len(x["rank"]) for x in per_key])
        for chunk in np.array_split(np.arange(len(part)), -(-len(part) // _CHUNK)):  # bounded memory
            _pairs(ctx, ent, part[chunk], sizes[inv[chunk]], (np.cumsum(sizes) - sizes)[inv[chunk]], coef, out)


def chunk_peaks(kept_c: np.ndarray, copy_c: np.ndarray, trans: np.ndarray, f: np.ndarray, a: np.ndarray,
                tidx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (candidate, rank) pair p: the peak kept bytes max(0, max_r kept_c[p] . f[p, r]), the peak
    with transients max(kept, max_r kept_c[p] . a[p, r] + trans[p, tidx[p, r]]) and autocast's copies
    max(0, max_r copy_c[p] . f[p, r]). ``kept_c``/``copy_c`` [P, J]: bytes per live chunk in the rows'
    basis (stage classes, or one layout's stages); ``f`` [P, RF, J]: live chunks after each forward;
    ``a`` [P, RA, J]: at every event, whose transient is column ``tidx`` of ``trans`` [P, T]. Bytes."""
    kept = np.maximum(np.einsum("pj,prj->pr", kept_c, f).max(1), 0.0)
    add = np.take_along_axis(trans, tidx, axis=1)
    total = np.maximum(kept, (np.einsum("pj,prj->pr", kept_c, a) + add).max(1))
    return kept, total, np.maximum(np.einsum("pj,prj->pr", copy_c, f).max(1), 0.0)


def first_largest(total: np.ndarray, first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Index of the first largest of each run of ``count`` values from ``first`` in ``total``."""
    top = np.maximum.reduceat(total, first)
    return np.minimum.reduceat(np.where(total == np.repeat(top, count), np.arange(len(total)), len(total)), first)


_CHUNK = 200_000
"""Candidates evaluated together by :func:`_pairs` (a few arrays of ~10 floats per pair)."""


def _pairs(ctx: dict, ent: dict, idx: np.ndarray, count: np.ndarray, start: np.ndarray, coef: tuple,
           out: dict) -> None:
    """Candidates ``idx``, each with ``count`` rank entries from ``start`` in ``ent``
    (:func:`_concat`): their (candidate, rank) pairs' peaks, and the first rank with the largest
    total written to ``out``."""
    stab, (kept_c, copy_c) = ctx["stab"], coef
    first = np.cumsum(count) - count
    cand = np.repeat(idx, count)
    e = np.repeat(start, count) + np.arange(count.sum()) - np.repeat(first, count)
    grp, types = ctx["sinv"][cand], ent["types"][e]
    trans = stab[grp][:, :, 1:3].reshape(len(e), 8)  # (forward, backward) transient per stage class
    kept, total, copies = chunk_peaks(kept_c[grp], copy_c[grp], trans, ent["f"][e], ent["a"][e],
                                      2 * (types % 3) + types // 3)
    vals = memory_fields(ctx, cand, ent["cls"][e], ent["cls"][e] >= 2, kept, total, copies)
    pick = first_largest(vals["total"], first, count)
    for k in _FIELDS:
        out[k][idx] = vals[k][pick]
    out["pp_rank"][idx] = ent["rank"][e[pick]]


def memory_columns(base: RunSpec, cols: dict[str, np.ndarray], assume=None) -> dict[str, np.ndarray]:
    """Peak memory per device of every candidate in ``cols`` (:mod:`xpar.plan.context`, length L), as
    :func:`xpar.estimate.cost.estimate` gives it (``.memory``, under :func:`xpar.estimate.cost.assumptions_for`
    ``base``): the most loaded pipeline rank, on its most loaded dp rank. ``base``: the RunSpec of any
    candidate of the same context; only its model, hardware, seq_len, train dtype and framework are read.

    Returns :data:`KEYS` -> arrays of length L: ``memory_<term>`` and ``memory_total`` in bytes
    (float64), ``memory_pp_rank`` (int64), ``memory_usable`` (bytes: device memory x (1 -
    hardware.memory_headroom)), ``fits`` (bool: total <= usable), ``optimizer_elements``,
    ``host_bytes`` and ``host_fits`` (:func:`xpar.estimate.memory.offload.host_columns`). The optional candidate column
    ``offload`` (bool) sets ``cpu_offload_optimizer`` per candidate (default: the framework's). Each equals the scalar field
    to rounding (relative 1e-12 or better; tests/plan/test_plan_memory.py checks 1e-9).

    Raises:
        ValueError: a schedule or recompute name that xpar does not know.
    """
    by_vocab = columns_by_vocab(base, cols, lambda part, c: memory_columns(part, c, assume))
    if by_vocab is not None:  # the vocabulary padded per tp (xpar.estimate.columns.vocab_groups)
        return by_vocab
    o = model_states.MemoryOptions.of(assumptions_for(base) if assume is None else assume)
    base, offloaded = offload_column(base, cols)  # activation offload's N per candidate (xpar.plan.offload_fit)
    c = int_columns(cols, o)
    n = len(c["tp"])
    autocast, er = _by_zero(base, c, o) if n else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    stab, sinv = _stage_table(base, c, o, autocast) if n else (np.zeros((0, 4, 4)), np.zeros(0, np.int64))
    hw, s = base.hardware, base.seq_len
    extra = {"token": activations.token_id_bytes(s, c["b"], c["m"], c["pp"]),
             "p2p": buffers.p2p_buffer_bytes(s, c["b"], base.model.hidden, c["v"], er, c["tp"], c["sp"])
             * ((c["pp"] > 1) & bool(o.count_buffers))}
    ctx = dict(extra, stab=stab, sinv=sinv, overhead=(hw.framework_overhead_gb or 0) * 1e9,
               state=_state_table(base, c, o) if n else (np.zeros((0, 4, 5)), np.zeros(0, np.int64)))
    res = {k: np.zeros(n) for k in _FIELDS}
    res["pp_rank"] = np.zeros(n, dtype=np.int64)
    single_stage(ctx, c, res)
    _pipelined(ctx, c, res)
    usable = usable_bytes(hw)
    freed, act_host = act_offload_memory(base, o, cols, offloaded) if "act_offload" in cols else (0.0, 0.0)
    out = {f"memory_{k}": res[k] - (freed if k == "activations" else 0.0) for k in _FIELDS[:5]}
    out.update(memory_framework_overhead=np.full(n, ctx["overhead"]), memory_total=res["total"] - freed,
               memory_pp_rank=res["pp_rank"], memory_usable=np.full(n, usable))
    out["fits"] = out["memory_total"] <= usable
    out.update(host_columns(hw, c["offload"], res["optimizer_elements"]))
    if "act_offload" in cols:  # offloaded activations beside an offloaded optimizer's states (hardware.host_memory_gb)
        out["host_bytes"] = out["host_bytes"] + act_host
        out["host_fits"] &= (out["host_bytes"] <= hw.host_memory_gb * 1e9) if hw.host_memory_gb else c["offload"] == 0
    return out


def usable_bytes(hw) -> float:
    """Bytes a device of ``hw`` (a HardwareConfig) offers the fit check: device memory x (1 -
    ``memory_headroom``)."""
    return (hw.device_memory_gb or 0) * 1e9 * (1 - (getattr(hw, "memory_headroom", 0.0) or 0.0))
