"""Data-parallel communication of one pipeline rank, unit by unit, and how much of it is exposed.

What each ZeRO stage issues (Rajbhandari et al. 2020; xpar.estimate.comm has the bytes), with
message sizes as issued, units as FSDP wraps them (each transformer block; the root: embedding,
final norm, output):

- ZeRO-3 (FSDP ``reshard_after_forward=True``): one all-gather per unit before its forward and
  one before its backward, every micro-batch; one reduce-scatter per unit after its backward,
  every micro-batch (without pp; under pp torch defers it to the stage's last backward).
- ZeRO-2 (FSDP, no reshard after forward): the all-gathers before forward only (once per step
  under pp), reduce-scatters as ZeRO-3.
- DDP (stage 0): gradient all-reduce in buckets of ``bucket_mb`` (torch DDP: 25 MB) during the
  last micro-batch's backward (no_sync before); ``bucket_mb <= 0``: one buffer after the backward
  (Megatron-LM 2021's contiguous buffer).
- ZeRO-1: 'zero_redundancy' (torch): DDP's all-reduce, then each rank's updated parameters
  broadcast after the step (all-gather volume); 'distributed_optimizer' (Megatron): bucketed
  reduce-scatter, then a parameter all-gather after the step, overlapped with the next forward
  unit by unit when ``param_gather_overlap``.

Parameters travel in the training dtype, gradients in ``grad_reduce_bytes`` per element (fp32
reduce in xpar's and torchtitan's bf16 recipe). The overlap itself is
:func:`xpar.estimate.overlap.simulate_pass`. Units: seconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from xpar.estimate.collectives import collective_time, group_of
from xpar.estimate.memory import BYTES, param_shapes
from xpar.estimate.overlap import simulate_pass
from xpar.spec import RunSpec


@dataclass(frozen=True)
class DpTiming:
    """Exposed dp communication per micro-batch (on the pipeline's critical path) and once per
    step (``end``: reductions of the last backward, parameter gathers after the step), and the
    seconds of dp communication issued per step (hidden or not)."""

    per_microbatch: float
    end: float
    issued: float


def unit_elements(spec: RunSpec, pp_rank: int) -> list[int]:
    """Parameter elements per FSDP unit of ``pp_rank`` in forward order: the root (embedding,
    final norm, output of the stages held; 0 on middle stages) first, then each block."""
    root, blocks = 0, {}
    for name, shape in param_shapes(spec, pp_rank):
        stage, rest = name.split(":", 1)
        parts = rest.split(".")
        if parts[0] == "layers":
            key = (stage, parts[1])
            blocks[key] = blocks.get(key, 0) + math.prod(shape)
        else:
            root += math.prod(shape)
    return [root] + list(blocks.values())


def _times(spec: RunSpec, assume, units: list[int]) -> dict[str, list[float]]:
    """Seconds per unit of its all-gather, reduce-scatter and bucketed reduction."""
    hw, z = spec.hardware, spec.parallel.zero_stage
    g, algo = group_of(hw, spec.dp, spec.tp), assume.dp_collective
    e = BYTES[spec.train.dtype]
    gb = assume.grad_reduce_bytes if spec.train.dtype == "bf16" else 4
    coll = "reduce_scatter" if (z >= 2 or (z == 1 and assume.zero1 == "distributed_optimizer")) else "allreduce"
    bucket = assume.bucket_mb * 1e6
    if z >= 2:  # FSDP: one reduce-scatter per unit
        red = [collective_time(hw, coll, n * gb, g, algo) for n in units]
    elif bucket > 0:  # buckets: a unit's share of bucket-sized messages
        per_bucket = collective_time(hw, coll, bucket, g, algo)
        red = [n * gb / bucket * per_bucket for n in units]
    else:  # one buffer after the backward
        red = [collective_time(hw, coll, sum(units) * gb, g, algo) / len(units)] * len(units)
    gather = [collective_time(hw, "allgather", n * e, g, algo) for n in units]
    return {"gather": gather, "reduce": red}


def dp_timing(spec: RunSpec, assume, pp_rank: int, compute_f: list[float], compute_b: list[float]) -> DpTiming:
    """Exposed dp communication of ``pp_rank`` (module docstring). ``compute_f``: seconds of
    each unit's forward in forward order (root first); ``compute_b``: each unit's backward
    (recompute included) in backward order (root last)."""
    if spec.dp == 1:
        return DpTiming(0.0, 0.0, 0.0)
    z, pp, m = spec.parallel.zero_stage, spec.pp, spec.micro_batches
    units = unit_elements(spec, pp_rank)
    t = _times(spec, assume, units)
    gf, gb_, red = t["gather"], t["gather"][::-1], t["reduce"][::-1]
    none = [0.0] * len(units)
    pre, slow = assume.fsdp_prefetch, assume.overlap_slowdown
    fwd_g = gf if (z == 3 or (z == 2 and pp == 1)) else none
    bwd_g = gb_ if z == 3 else none
    every = z >= 2 and pp == 1
    fwd = simulate_pass(compute_f, fwd_g, None, pre, slow)
    bwd = simulate_pass(compute_b, bwd_g, red if (every and assume.dp_overlap) else None, pre, slow)
    per_mb = fwd.exposed + bwd.exposed + (sum(red) if every and not assume.dp_overlap else 0.0)
    end = 0.0
    if not every:  # reductions once, in the last micro-batch's backward (or after it)
        if assume.dp_overlap:
            end += simulate_pass(compute_b, bwd_g, red, pre, slow).exposed - bwd.exposed
        else:
            end += sum(red)
    if z == 2 and pp > 1:  # gathered once per step under pp
        end += simulate_pass(compute_f, gf, None, pre, slow).exposed
    if z == 1:  # updated parameters gathered after the step
        end += (simulate_pass(compute_f, gf, None, pre, slow).exposed if assume.param_gather_overlap
                else sum(gf))
    issued = m * (sum(fwd_g) + sum(bwd_g) + (sum(red) if every else 0.0)) + (0.0 if every else sum(red)) \
        + (sum(gf) if z == 1 or (z == 2 and pp > 1) else 0.0)
    return DpTiming(per_mb, end, issued)
