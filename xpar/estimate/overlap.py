"""Overlap of data-parallel communication with compute, unit by unit.

A pass (one micro-batch's forward, or its backward) runs its units (FSDP units: the
transformer blocks and the root, xpar.parallel.factory) in order on the compute stream;
communication runs on one link, in the order it is issued (a FIFO: all-gathers and
reduce-scatters share the NICs):

- ``gather[i]`` (ZeRO-3/FSDP parameter all-gather) must finish before unit i computes. With
  ``prefetch`` the gather of unit i+1 is issued when unit i starts (FSDP2's implicit
  prefetch, one unit ahead, forward and backward; DeepSpeed's prefetch bucket); without,
  when unit i ends. Unit 0's gather has nothing before it to hide behind.
- ``reduce[i]`` (gradient reduce-scatter, or a DDP bucket all-reduce) is issued when unit i
  ends and must finish before the pass ends: it hides behind the backward of the units
  after it in the pass (the earlier layers), the last one is exposed.

Exposed time = makespan - sum(compute). While communication runs beside compute, compute
slows by ``slowdown`` (NCCL kernels use SMs and HBM bandwidth); that loss is counted as
exposed communication too. Units: seconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class PassTiming:
    """One pass: compute (sum of the units), communication issued (link busy time) and
    the communication time not hidden behind compute (``exposed``), seconds."""

    compute: float
    comm: float
    exposed: float


def simulate_pass(compute: Sequence[float], gather: Optional[Sequence[float]] = None,
                  reduce: Optional[Sequence[float]] = None, prefetch: bool = True,
                  slowdown: float = 0.0) -> PassTiming:
    """Timeline of one pass over units (module docstring). ``gather``/``reduce``: seconds
    of each unit's collective (None: none). Returns a :class:`PassTiming`."""
    n = len(compute)
    g = list(gather) if gather is not None else [0.0] * n
    r = list(reduce) if reduce is not None else [0.0] * n
    if len(g) != n or len(r) != n:
        raise ValueError(f"gather/reduce need one entry per unit ({n}), got {len(g)}/{len(r)}")
    link, clock, ready = 0.0, 0.0, [0.0] * n
    if n and g[0]:
        link = ready[0] = g[0]
    for i in range(n):
        if not prefetch and i and g[i]:  # on demand: issued once the previous unit is done
            link = ready[i] = max(link, clock) + g[i]
        start = max(clock, ready[i])
        if prefetch and i + 1 < n and g[i + 1]:
            link = ready[i + 1] = max(link, start) + g[i + 1]
        clock = start + compute[i]
        if r[i]:
            link = max(link, clock) + r[i]
    total_compute, total_comm = sum(compute), sum(g) + sum(r)
    exposed = max(clock, link) - total_compute
    hidden = max(0.0, total_comm - exposed)
    return PassTiming(total_compute, total_comm, exposed + slowdown * min(hidden, total_compute))


def blocking(comm: float) -> PassTiming:
    """Communication with nothing to hide behind (after the flush, or framework does not
    overlap): all of it exposed."""
    return PassTiming(0.0, comm, comm)
