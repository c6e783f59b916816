"""Megatron-Core's per-chunk overlap of data-parallel communication under interleaved pipelines
(``framework.dp_overlap_per_chunk``): with v > 1 model chunks per pipeline rank, each chunk's gradient
buckets are launched when that chunk's last backward ends, and its parameters all-gathered during the
earlier chunks' first forwards (megatron/core/distributed/param_and_grad_buffer.py and
distributed_data_parallel.py: one bucket group per model chunk, ``start_grad_sync`` from the schedule's
``grad_sync_func`` per chunk, ``start_param_sync`` from the forward pre-hook of the chunk before;
megatron/core/pipeline_parallel/schedules.py interleaved 1F1B; NeMo performance guide,
"Communication overlap": overlap_grad_reduce, overlap_param_gather with virtual pipelining).

Priced per pipeline rank: in the cooldown each chunk runs its last pp backwards in a row (warm-up: its
first pp forwards), so the reductions of all chunks but the last to finish (the rank's first model chunk,
its blocks ceil(n / v) and the root) hide behind pp backwards of the chunks after them, the excess and
the overlap slowdown exposed; the last chunk's own reductions overlap its last backward unit by unit
(xpar.estimate.comm.overlap.simulate_pass). The gathers mirror it over the first forwards. Units: seconds.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from xpar.estimate.comm.overlap import simulate_pass, vmax, vmin


def chunk_units(n_units: Any, v: Any) -> Any:
    """Units of the chunk that finishes its backward last (and starts its forward first): the rank's
    first model chunk, ceil(blocks / v) blocks and the root (units: the root and the rank's blocks; ints,
    or int arrays over layouts)."""
    blocks = n_units - 1
    return -(-blocks // vmax(v, 1)) + 1


def _hidden(comm: Any, cover: Any, slow: float) -> Any:
    """Exposed seconds of ``comm`` seconds of communication behind ``cover`` seconds of compute: the
    excess, and the slowdown of the compute it runs beside (xpar.estimate.comm.overlap)."""
    return vmax(comm - cover, 0.0) + slow * vmin(comm, cover)


def _head(values: list, cut: Any) -> list:
    """``values[:cut]``; for an int array over layouts, every layout's values before its own cut, zeros
    after it (to the largest cut: units of no time, which change no pass)."""
    if not isinstance(cut, np.ndarray):
        return values[:cut]
    return [np.where(j < cut, x, 0.0) for j, x in enumerate(values[:int(cut.max())])]


def _tail(values: list, cut: Any) -> list:
    """``values[cut:]``; for an int array over layouts, every layout's values from its own cut on, zeros
    before it (from the smallest cut)."""
    if not isinstance(cut, np.ndarray):
        return values[cut:]
    low = int(cut.min())
    return [np.where(j >= cut, x, 0.0) for j, x in enumerate(values[low:], start=low)]


def reduce_end(pp: Any, v: Any, assume, compute_b: list, reduce_b: list, units: Any = None) -> Any:
    """Exposed seconds of the step's gradient reductions (``reduce_b``, backward order, root last) on a
    rank whose units' backward per micro-batch is ``compute_b`` (backward order): the last chunk's against
    its last backward, the others' against pp backwards of the chunks after them (module docstring).
    ``units``: each layout's own units where the lists hold more (leading units of no time; None: all)."""
    n = len(compute_b)
    cut, pre, slow = n - chunk_units(n if units is None else units, v), assume.fsdp_prefetch, assume.overlap_slowdown
    last = simulate_pass(_tail(compute_b, cut), None, _tail(reduce_b, cut), pre, slow).exposed
    return last + _hidden(sum(_head(reduce_b, cut)), pp * sum(_head(compute_b, cut)), slow)


def gather_start(pp: Any, v: Any, assume, compute_f: list, gather_f: list, units: Any = None) -> Any:
    """Exposed seconds of the parameter all-gathers after the step (``gather_f``, forward order, root
    first): the first chunk's before its first forward, unit by unit with prefetch, the others' behind the
    pp first forwards of the chunks before them (module docstring). ``units``: :func:`reduce_end`'s
    (trailing units of no time)."""
    k = chunk_units(len(compute_f) if units is None else units, v)
    pre, slow = assume.fsdp_prefetch, assume.overlap_slowdown
    first = simulate_pass(_head(compute_f, k), _head(gather_f, k), None, pre, slow).exposed
    return first + _hidden(sum(_tail(gather_f, k)), pp * sum(_tail(compute_f, k)), slow)
