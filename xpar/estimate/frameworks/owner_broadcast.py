"""Owner-by-owner parameter broadcast of ZeRO-1 (``framework.zero1`` 'owner_broadcast'): InternEvo's hybrid ZeRO
(internlm/solver/optimizer/hybrid_zero_optim.py, ``HybridZeroOptimizer``): whole parameter tensors assigned to the
zero1 ranks (``_partition_param_list``, the least-loaded rank first), gradients all-reduced over dp in buckets
(``reduce_tensor`` with ``dst_rank`` None), and after the step each owner ``dist.broadcast``s the tensors it
updated to the zero1 group: ``broadcast_params`` once per owner of its flat partition, or, with
``overlap_sync_param``, ``ParamBcastSyncHandler`` (internlm/solver/optimizer/utils.py) before each block's forward,
one broadcast per owner that holds a tensor of the block. A broadcast is NCCL's ring chain from its root (NCCL
src/device/broadcast.h ``runRing``: each rank receives a chunk from the previous one and forwards it to the next),
priced as xpar.estimate.comm.collectives.ring_time's 'broadcast': n - 1 hops of latency (NCCL's tuning.cc charges
the chain less: its latency model is the algorithm selector's, not the chain's fill), every rank receiving the
message once; the broadcasts of the owners are separate collectives on one communicator, run in order on its
stream (NCCL docs, "Communicators": operations on a communicator execute in the order issued). So a block whose k
tensors have k owners pays k chains of latency where an all-gather pays one ring: at several hundred ranks across
nodes the latency, not the bytes, is the broadcast's cost. Units: seconds, bytes.
"""
from __future__ import annotations

from typing import Callable


def owners_of_unit(tensors: int, dp: int) -> int:
    """Owners that hold a tensor of a unit of ``tensors`` whole tensors, on ``dp`` ranks: each tensor goes to the
    least-loaded rank, so the tensors of one unit land on distinct ranks until there are more tensors than
    ranks: min(tensors, dp), at least 1."""
    return max(1, min(tensors, dp))


def owner_broadcast_times(units: list[int], widths: list, tensors: list[int], dp: int,
                          timed: Callable[[float], float]) -> list[float]:
    """Seconds per unit of its parameters broadcast owner by owner: :func:`owners_of_unit` broadcasts of an equal
    share of the unit's bytes (``units``: elements; ``widths``: bytes per element; ``tensors``: parameter tensors
    per unit; ``timed``: bytes -> seconds of one broadcast over the group)."""
    out = []
    for n, w, k in zip(units, widths, tensors):
        owners = owners_of_unit(k, dp)
        out.append(owners * timed(n * w / owners) if n else 0.0)
    return out
