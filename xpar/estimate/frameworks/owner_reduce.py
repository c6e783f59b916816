"""Owner-by-owner gradient reduction of ZeRO-1/2 (``framework.zero_owner_reduce``): DeepSpeed's
reduce_scatter path (deepspeed/runtime/zero/stage_1_and_2.py ``average_tensor``) cuts each gradient bucket
at the flat partitions' bounds and reduces every slice to its owner with one ``dist.reduce`` (async, all
on the dp communicator's stream), not one reduce-scatter. A message of L bytes over partitions of P =
total / dp spans ceil(L / P) + 1 owners (its start falls inside a partition), at most dp; each reduce is
a pipelined chain (NCCL's ring reduce: n - 1 steps, every rank sends the slice once: priced as
xpar.estimate.comm.collectives' 'broadcast', the same chain). At several hundred ranks the per-owner steps'
latency dominates where a reduce-scatter pays it once. Units: seconds, bytes.
"""
from __future__ import annotations

import math
from typing import Callable


def owners_spanned(message: float, partition: float, dp: int) -> int:
    """Partitions (owners) a message of ``message`` bytes spans over partitions of ``partition`` bytes."""
    if partition <= 0:
        return 1
    return min(dp, math.ceil(message / partition) + 1)


def owner_reduce_time(message: float, partition: float, dp: int, chain: Callable[[float], float]) -> float:
    """Seconds of one message reduced owner by owner: a chain reduce (``chain``: bytes -> seconds) per
    owner it spans, of its share of the bytes."""
    k = owners_spanned(message, partition, dp)
    return k * chain(message / k) if message > 0 else 0.0


def owner_unit_times(units: list[int], grad_bytes: int, dp: int, bucket_bytes: float, per_unit: bool,
                     chain: Callable[[float], float]) -> list[float]:
    """Seconds per unit of its gradients' owner-by-owner reduction: one message per unit (``per_unit``,
    ZeRO-2 as xpar prices it) or the unit's share of ceil(total / bucket) buckets (ZeRO-1)."""
    total = sum(units) * grad_bytes
    part = total / dp
    if per_unit:
        return [owner_reduce_time(n * grad_bytes, part, dp, chain) for n in units]
    buckets = max(1, math.ceil(total / bucket_bytes)) if bucket_bytes > 0 else 1
    per_bucket = owner_reduce_time(total / buckets, part, dp, chain)
    return [n * grad_bytes / total * buckets * per_bucket if total else 0.0 for n in units]
