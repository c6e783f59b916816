"""Overlap of data-parallel communication with compute, unit by unit.

A pass (one micro-batch's forward or backward) runs its units in order on the compute stream;
communication runs on one link in issue order (a FIFO). ``gather[i]`` must finish before unit i
computes (issued when unit i - 1 starts with ``prefetch``, else when it ends); ``reduce[i]`` is
issued when unit i ends and must finish before the pass ends. Exposed time = makespan -
sum(compute); compute slows by ``slowdown`` while communication runs beside it (NCCL kernels use
SMs and HBM), counted as exposed communication too.

Units: seconds. Array-polymorphic: every time a float or a numpy array over layouts (:func:`vmax`,
:func:`vmin`, :func:`vwhere` take either).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np


def vmax(a: Any, b: Any) -> Any:
    """max(a, b) for floats, numpy.maximum when either is an array."""
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


def vmin(a: Any, b: Any) -> Any:
    """min(a, b) for floats, numpy.minimum when either is an array."""
    return np.minimum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else min(a, b)


def vwhere(cond: Any, a: Any, b: Any) -> Any:
    """``a if cond else b`` for a bool, numpy.where for a bool array."""
    if isinstance(cond, np.ndarray):
        return np.where(cond, a, b)
    return a if cond else b


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
    if any(map(_some, g)) or any(map(_some, r)):
        link, clock = _timeline(compute, g, r, prefetch)
    else:  # nothing issued: the units back to back
        link, clock = 0.0, sum(compute)
    total_compute, total_comm = sum(compute), sum(g) + sum(r)
    exposed = vmax(clock, link) - total_compute
    hidden = vmax(0.0, total_comm - exposed)
    return PassTiming(total_compute, total_comm, exposed + slowdown * vmin(hidden, total_compute))


def _timeline(compute: Sequence[Any], g: list, r: list, prefetch: bool) -> tuple[Any, Any]:
    """(When the link is done, when the last unit's compute ends) of :func:`simulate_pass`'s units, seconds."""
    n = len(compute)
    link, clock, ready = 0.0, 0.0, [0.0] * n
    if n:
        link = ready[0] = vwhere(g[0] != 0, g[0], 0.0)
    for i in range(n):
        if not prefetch and i and _some(g[i]):  # on demand: issued once the previous unit is done
            link, ready[i] = _issue(g[i], vmax(link, clock) + g[i], link, ready[i])
        start = vmax(clock, ready[i])
        if prefetch and i + 1 < n and _some(g[i + 1]):
            link, ready[i + 1] = _issue(g[i + 1], vmax(link, start) + g[i + 1], link, ready[i + 1])
        clock = start + compute[i]
        if _some(r[i]):
            link = _issue(r[i], vmax(link, clock) + r[i], link, link)[0]
    return link, clock


def _issue(comm: Any, done: Any, link: Any, ready: Any) -> tuple[Any, Any]:
    """(link, ready) after issuing a collective of ``comm`` seconds that finishes at ``done``;
    unchanged where ``comm`` is 0 (nothing issued)."""
    if not isinstance(comm, np.ndarray):
        return (done, done) if comm else (link, ready)
    issued = comm != 0
    if issued.all():  # np.where's result, without the copies
        return done, done
    return np.where(issued, done, link), np.where(issued, done, ready)


def _some(comm: Any) -> bool:
    """Whether a collective may be issued: an array, or a non-zero float (:func:`_issue` of a zero float
    changes nothing)."""
    return isinstance(comm, np.ndarray) or bool(comm)


def blocking(comm: float) -> PassTiming:
    """Communication with nothing to hide behind (after the flush, or framework does not
    overlap): all of it exposed."""
    return PassTiming(0.0, comm, comm)
