"""Hierarchical ZeRO (``parallel.zero_shard_size`` = s: torch FSDP2's HSDP, DeepSpeed ZeRO++'s hpZ):
ZeRO-2/3 shard each unit over groups of s consecutive dp ranks and replicate across the dp / s
groups. Per unit (Zhao et al. 2023, "PyTorch FSDP", Sec. 3.2.2 hybrid sharding; torch 2.13
``fully_shard`` on a (replicate, shard) mesh):

- parameters all-gathered inside the shard group (s ranks, consecutive: inside a node where it fits);
- gradients reduce-scattered inside the shard group, then the 1/s shard all-reduced across the
  dp / s replicas (ranks s x tp apart: across nodes);
- model states sharded s ways, not dp ways (:func:`shard_group_spec`).

Units: seconds and bytes, as :mod:`xpar.estimate.comm.dp` and :mod:`xpar.estimate.memory.per_device`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from xpar.config.spec import RunSpec
from xpar.estimate.comm.collectives import collective_time, group_of
from xpar.estimate.frameworks.fp8_params import gather_widths


def shard_size(spec: RunSpec) -> Optional[int]:
    """s where hierarchical ZeRO applies (ZeRO-2/3, 1 < s < dp), else None."""
    s = spec.parallel.zero_shard_size
    return s if s and spec.layout.zero_stage >= 2 and 1 <= s < spec.dp else None


def shard_group_spec(spec: RunSpec) -> RunSpec:
    """``spec`` as its model states are sharded: dp = s under hierarchical ZeRO (each rank holds 1/s
    of ZeRO-2/3's states, as flat ZeRO over s ranks); ``spec`` itself otherwise."""
    s = shard_size(spec)
    if s is None:
        return spec
    return replace(spec, layout=replace(spec.layout, dp=s))


def hsdp_unit_times(spec: RunSpec, assume, units: list[int], grad_bytes: int) -> Optional[dict[str, list[float]]]:
    """Seconds per unit of its all-gather (``gather``, ``gather_backward``) inside the shard group
    and its gradient reduction (``reduce``: reduce-scatter in the group + all-reduce of the 1/s shard
    across the replicas), or None without hierarchical ZeRO. ``units``: elements per unit;
    ``grad_bytes``: bytes per reduced gradient element."""
    s = shard_size(spec)
    if s is None:
        return None
    hw, algo = spec.hardware, assume.dp_collective
    shard, replicas = group_of(hw, s, spec.tp), group_of(hw, spec.dp // s, s * spec.tp)
    pw = gather_widths(spec, assume, len(units))  # the training dtype's, FP8 blocks with fp8_param_gather
    gather = [collective_time(hw, "allgather", n * w, shard, algo) for n, w in zip(units, pw)]
    red = [collective_time(hw, "reduce_scatter", n * grad_bytes, shard, algo)
           + collective_time(hw, "allreduce", n * grad_bytes / s, replicas, algo) for n in units]
    return {"gather": gather, "gather_backward": gather, "reduce": red}
