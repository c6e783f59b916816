"""Hierarchical ZeRO (``parallel.zero_shard_size`` = s: torch FSDP2's HSDP, DeepSpeed ZeRO++'s hpZ, and
ZeRO-1 with its optimizer states inside a group: :func:`zero1_group_times`):
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
from typing import Callable, Optional

from xpar.config.spec import RunSpec
from xpar.estimate.comm.collectives import Group, collective_time, group_of
from xpar.estimate.frameworks.fp8_params import gather_widths


def shard_size(spec: RunSpec) -> Optional[int]:
    """s where hierarchical ZeRO applies (ZeRO-1/2/3, 1 <= s < dp), else None."""
    s = spec.parallel.zero_shard_size
    return s if s and spec.layout.zero_stage >= 1 and 1 <= s < spec.dp else None


def shard_group_spec(spec: RunSpec) -> RunSpec:
    """``spec`` as its model states are sharded: dp = s under hierarchical ZeRO (each rank holds 1/s
    of ZeRO-1/2/3's sharded states, as flat ZeRO over s ranks); ``spec`` itself otherwise."""
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
    if s is None or spec.layout.zero_stage < 2:
        return None
    hw, algo = spec.hardware, assume.dp_collective
    shard, replicas = group_of(hw, s, spec.tp), group_of(hw, spec.dp // s, s * spec.tp)
    pw = gather_widths(spec, assume, len(units))  # the training dtype's, FP8 blocks with fp8_param_gather
    gather = [collective_time(hw, "allgather", n * w, shard, algo) for n, w in zip(units, pw)]
    red = [collective_time(hw, "reduce_scatter", n * grad_bytes, shard, algo)
           + collective_time(hw, "allreduce", n * grad_bytes / s, replicas, algo) for n in units]
    return {"gather": gather, "gather_backward": gather, "reduce": red}


def zero1_group_times(spec: RunSpec, inner_times: Callable[[int, Group], dict],
                      across_times: Callable[[Group], list]) -> Optional[dict[str, list[float]]]:
    """Seconds per unit of ZeRO-1 with its states in shard groups of s (``parallel.zero_shard_size``), or None
    without one. The reduction as Megatron-Core's distributed optimizer instances run it (megatron/core/
    distributed/param_and_grad_buffer.py: reduce-scatter of each bucket inside the instance, then all-reduce of
    the 1/s shard across the dp / s instances; ``--num-distributed-optimizer-instances``) and, in bytes and steps,
    InternEvo's zero1 = s (internlm/solver/optimizer/hybrid_zero_optim.py: buckets all-reduced over all of dp, a
    two-level all-reduce of the same volume); the parameters gathered inside the group only (all-gathers per
    bucket, or the owners' broadcasts under 'zero_redundancy'). ``inner_times(s, group)``: gather and reduce of a
    flat ZeRO-1 over the s ranks of ``group`` (xpar.estimate.comm.dp.group_times); ``across_times(group)``: seconds
    per unit of the bucketed all-reduce of 1/s of the gradients over ``group``, the replicas s x tp apart."""
    s = shard_size(spec)
    if s is None or spec.layout.zero_stage != 1:
        return None
    hw = spec.hardware
    shard, replicas = group_of(hw, s, spec.tp), group_of(hw, spec.dp // s, s * spec.tp)
    inner = inner_times(s, shard)
    red = [a + b for a, b in zip(inner["reduce"], across_times(replicas))]
    return {"gather": inner["gather"], "gather_backward": inner["gather"], "reduce": red}
