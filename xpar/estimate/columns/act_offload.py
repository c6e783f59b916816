"""The activation offload of every candidate (``parallel.activation_offload_layers``:
:mod:`xpar.estimate.memory.activation_offload`): its exposed copies per micro-batch, for the step-time columns
(:mod:`xpar.estimate.columns.step_time`) and so for the scalar estimate, which is their one-row case; and, where the
candidates carry their own N (the optional column ``act_offload``, xpar.plan.offload_fit), the device bytes it
frees and the host bytes it takes (:mod:`xpar.estimate.columns.peak_memory`). Units: seconds per micro-batch,
bytes. No torch import.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from xpar.config.spec import RunSpec
from xpar.estimate.columns.keys import by_key, spec_at
from xpar.estimate.memory.activation_host import block_bytes_of
from xpar.estimate.memory.activation_offload import exposed_time, offload_layers, resident_blocks
from xpar.estimate.memory.model_states import MemoryOptions
from xpar.estimate.memory.offload import devices_per_node


def offload_column(base: RunSpec, cols: dict) -> tuple[RunSpec, np.ndarray]:
    """(The base the column model prices, N per candidate): ``base`` and its N for every candidate without the
    column ``act_offload``; with it, ``base`` without offload and the column (the memory columns then subtract
    what each candidate's N frees: :func:`act_offload_memory`)."""
    if "act_offload" not in cols:
        return base, np.full(len(cols["tp"]), offload_layers(base), dtype=np.int64)
    plain = replace(base, parallel=replace(base.parallel, activation_offload_layers=None))
    return plain, np.asarray(cols["act_offload"], dtype=np.int64)


def block_column(base: RunSpec, o, r: dict) -> np.ndarray:
    """One block's saved bytes for one micro-batch (no recompute) at each candidate's tp, b, sp and ZeRO stage
    (columns of ``r``; the stage decides xpar's mixed precision, xpar.parallel.precision), under ``o``
    (MemoryOptions): what each block offloaded copies, and frees. Bytes."""
    return by_key([np.asarray(r[k]) for k in ("tp", "b", "sp", "zero")], lambda t, b, sp, z: {
        "x": block_bytes_of(spec_at(base, t, 1, 1, b, 1, 1, "gpipe", z, sp, "none"), o)}, ("x",))["x"]


def act_offload_columns(base: RunSpec, a, r: dict, c: dict) -> np.ndarray:
    """Seconds per micro-batch the offload's device -> host (forward) and host -> device (backward)
    copies leave exposed, per candidate ``r`` (:func:`xpar.estimate.columns.step_time.candidate_rows`, its N in
    ``r['act_offload']``), from one block's forward and backward compute in ``c`` (``mm_f + mem_f``,
    ``mm_b + mem_b``: xpar.estimate.step_parts.layer_costs, seconds per micro-batch) and one block's saved bytes
    at the candidate's tp, micro-batch size and sequence parallelism; over ``base.hardware.pcie_gb_per_s`` (per
    device and direction), as ``a.activation_offload_overlap`` runs them. Zeros without offload or host link
    figure. ``a``: the Assumptions."""
    n, link = r["act_offload"], base.hardware.pcie_gb_per_s or 0
    if not n.any() or not link > 0:
        return np.zeros(len(r["tp"]))
    block = block_column(base, MemoryOptions.of(a), r)
    return exposed_time(block, link, base.model.n_layers, n, c["mm_f"] + c["mem_f"], c["mm_b"] + c["mem_b"],
                        a.activation_offload_overlap)


def act_offload_memory(base: RunSpec, o, cols: dict, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Device bytes freed, host bytes per node) of each candidate's N (``n``; pp 1, no recompute:
    xpar.estimate.memory.activation_offload): (L - resident blocks) blocks off the device, devices_per_node x N
    blocks on the host; zeros where N is 0. ``o``: the MemoryOptions. Bytes."""
    if not n.any():
        return np.zeros(len(n)), np.zeros(len(n))
    block = block_column(base, o, cols)
    blocks = base.model.n_layers
    return ((blocks - resident_blocks(blocks, n, o.activation_offload_overlap)) * block,
            devices_per_node(base.hardware) * n * block)
