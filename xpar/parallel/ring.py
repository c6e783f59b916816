"""Traffic of ring collectives, shared by the engine's byte counters (:mod:`xpar.parallel.tensor`)
and the cost model (:mod:`xpar.estimate.comm.volume`). Torch-free.

Ring collectives over n ranks (Patarasuk & Yuan 2009; NCCL's bus-bandwidth convention), for a
buffer of S bytes: all-reduce 2 (n-1)/n S; reduce-scatter and all-gather (n-1)/n S each.
"""
from __future__ import annotations


def ring_factor(collective: str, n: int) -> float:
    """Bytes a ring sends per device per payload byte over n ranks (see the module
    docstring): all-reduce 2 (n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n;
    broadcast 1; 0 for a group of one."""
    if n <= 1:
        return 0.0
    if collective == "allreduce":
        return 2 * (n - 1) / n
    return 1.0 if collective == "broadcast" else (n - 1) / n
