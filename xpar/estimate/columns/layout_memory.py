"""One layout's peak memory as the column model's case of one row
(:mod:`xpar.estimate.columns.peak_memory`): every pipeline rank priced as a slot of its own, on the
bytes per live chunk of each of its own stages (whatever the split), the live chunks of the one
schedule walk (:func:`xpar.estimate.memory.activations.stage_events`), the peaks and the sum of terms the
planner uses (:func:`~xpar.estimate.columns.peak_memory.chunk_peaks`,
:func:`~xpar.estimate.columns.peak_memory.memory_fields`). Units: bytes. No torch import.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from xpar.config.spec import RunSpec
from xpar.estimate.memory import activations
from xpar.estimate.memory.buffers import p2p_buffer_bytes
from xpar.estimate.columns.one_layout import layout_columns
from xpar.estimate.columns.peak_memory import (
    chunk_peaks,
    first_largest,
    int_columns,
    memory_fields,
    padded_entries,
    rank_states,
    single_stage,
)
from xpar.estimate.memory.model_states import MemoryOptions, precision


def _context(spec: RunSpec, o: MemoryOptions, c: dict, ranks: list[int]) -> dict:
    """:func:`~xpar.estimate.columns.peak_memory.memory_fields`' context for ``spec``'s column ``c``,
    its state table's slots the pipeline ``ranks`` (rank class 3 without pipelining)."""
    states = np.array([rank_states(spec, r, o, o) for r in ranks])
    table = np.full((1, 4, 5), np.nan) if spec.pp == 1 else states[None]
    if spec.pp == 1:
        table[0, 3] = states[0]
    er = precision(spec, o)["er"]
    s, hw = spec.seq_len, spec.hardware
    return {"state": (table, np.zeros(1, np.int64)), "overhead": (hw.framework_overhead_gb or 0) * 1e9,
            "token": activations.token_id_bytes(s, c["b"], c["m"], c["pp"]),
            "p2p": p2p_buffer_bytes(s, c["b"], spec.model.hidden, c["v"], er, c["tp"], c["sp"])
            * ((c["pp"] > 1) & bool(o.count_buffers))}


def _rank_entry(spec: RunSpec, o: MemoryOptions, sched: str, r: int, slot: int) -> tuple:
    """Rank ``r``'s entry (rank, slot, forward rows, event rows, transient index) in its stages'
    basis, with its bytes per live chunk of each stage ([v, 4]: kept, forward and backward
    transients, autocast's copies; :func:`xpar.estimate.memory.activations.stage_chunk_bytes`)."""
    stages, rows, kind, acting = activations.stage_events(sched, spec.pp, spec.micro_batches,
                                                          spec.layout.virtual_stages, r)
    per = np.array([activations.stage_chunk_bytes(spec, st, o) for st in stages])
    return (r, slot, rows[kind == 0].astype(float), rows.astype(float), 2 * acting + kind), per


def layout_memory(spec: RunSpec, o: MemoryOptions, pp_rank: Optional[int] = None) -> dict:
    """Peak memory of ``spec`` (cp-folded, ZeRO shard group resolved) under ``o`` on pipeline rank
    ``pp_rank`` (None: the first rank with the largest total): the planner's fields (params, grads,
    optimizer, activations, comm_buffers, total, optimizer_elements; bytes, elements) as numbers, with
    ``pp_rank``, ``kept`` and ``total_acts`` (the activations' peak without and with transients, token
    ids apart), ``token_ids``, ``copies`` (autocast's weights), ``p2p`` and ``chunks`` (peak live
    micro-batch chunks)."""
    c = int_columns(layout_columns(spec), o)
    ranks = list(range(spec.pp)) if pp_rank is None else [pp_rank]
    ctx = _context(spec, o, c, ranks)
    if spec.pp == 1:
        k, fwd, bwd, cp = activations.stage_chunk_bytes(spec, 0, o)
        ctx.update(stab=np.array([[[np.nan] * 4] * 3 + [[k, fwd, bwd, cp]]]), sinv=np.zeros(1, np.int64))
        out = {f: np.zeros(1) for f in ("params", "grads", "optimizer", "activations", "comm_buffers", "total",
                                        "optimizer_elements")}
        out["pp_rank"] = np.zeros(1, np.int64)
        single_stage(ctx, c, out)
        pick = {f: float(v[0]) for f, v in out.items()}
        pick.update(pp_rank=0, kept=k, total_acts=k + max(fwd, bwd), copies=cp, chunks=1)
    else:
        pick = _pipelined(spec, o, ctx, ranks)
    first = spec.layout.has_first_stage(pick["pp_rank"])
    pick.update(token_ids=float(ctx["token"][0]) if first else 0.0, p2p=float(ctx["p2p"][0]))
    return pick


def _pipelined(spec: RunSpec, o: MemoryOptions, ctx: dict, ranks: list[int]) -> dict:
    """:func:`layout_memory` of a pipelined layout: every rank of ``ranks`` a (candidate, rank) pair."""
    sched = activations.memory_schedule(spec.layout.schedule, spec.pp, spec.micro_batches, o.interleaved_m_per_pp)
    entries, per = zip(*(_rank_entry(spec, o, sched, r, i) for i, r in enumerate(ranks)))
    ent, per = padded_entries(list(entries)), np.stack(per)  # per [ranks, v, 4]
    kept, total, copies = chunk_peaks(per[:, :, 0], per[:, :, 3], per[:, :, 1:3].reshape(len(ranks), -1),
                                      ent["f"], ent["a"], ent["types"])
    first = np.array([spec.layout.has_first_stage(r) for r in ranks])
    vals = memory_fields(ctx, np.zeros(len(ranks), np.int64), ent["cls"], first, kept, total, copies)
    i = int(first_largest(vals["total"], np.zeros(1, np.int64), np.array([len(ranks)]))[0])
    pick = {f: float(v[i]) for f, v in vals.items()}
    pick.update(pp_rank=ranks[i], kept=float(kept[i]), total_acts=float(total[i]), copies=float(copies[i]),
                chunks=int(ent["f"][i].sum(-1).max()))  # as activations.microbatches_in_flight counts them
    return pick
