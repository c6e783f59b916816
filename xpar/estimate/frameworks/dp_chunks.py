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

from xpar.estimate.comm.overlap import simulate_pass, vmax, vmin


def chunk_units(n_units: int, v: int) -> int:
    """Units of the chunk that finishes its backward last (and starts its forward first): the rank's
    first model chunk, ceil(blocks / v) blocks and the root (units: the root and the rank's blocks)."""
    blocks = n_units - 1
    return -(-blocks // max(v, 1)) + 1


def _hidden(comm: Any, cover: Any, slow: float) -> Any:
    """Exposed seconds of ``comm`` seconds of communication behind ``cover`` seconds of compute: the
    excess, and the slowdown of the compute it runs beside (xpar.estimate.comm.overlap)."""
    return vmax(comm - cover, 0.0) + slow * vmin(comm, cover)


def reduce_end(pp: Any, v: int, assume, compute_b: list, reduce_b: list) -> Any:
    """Exposed seconds of the step's gradient reductions (``reduce_b``, backward order, root last) on a
    rank whose units' backward per micro-batch is ``compute_b`` (backward order): the last chunk's against
    its last backward, the others' against pp backwards of the chunks after them (module docstring)."""
    k, pre, slow = chunk_units(len(compute_b), v), assume.fsdp_prefetch, assume.overlap_slowdown
    last = simulate_pass(compute_b[-k:], None, reduce_b[-k:], pre, slow).exposed
    return last + _hidden(sum(reduce_b[:-k]), pp * sum(compute_b[:-k]), slow)


def gather_start(pp: Any, v: int, assume, compute_f: list, gather_f: list) -> Any:
    """Exposed seconds of the parameter all-gathers after the step (``gather_f``, forward order, root
    first): the first chunk's before its first forward, unit by unit with prefetch, the others' behind the
    pp first forwards of the chunks before them (module docstring)."""
    k, pre, slow = chunk_units(len(compute_f), v), assume.fsdp_prefetch, assume.overlap_slowdown
    first = simulate_pass(compute_f[:k], gather_f[:k], None, pre, slow).exposed
    return first + _hidden(sum(gather_f[k:]), pp * sum(compute_f[k:]), slow)
