"""Data-parallel communication of one pipeline rank, unit by unit, and how much of it is exposed.

What each ZeRO stage issues (Rajbhandari et al. 2020; bytes in xpar.estimate.comm.volume), at the sizes
issued, units as FSDP wraps them (each block; the root: embedding, final norm, output):
ZeRO-3 gathers per unit before forward and backward and reduce-scatters after backward (m + 1
gathers per step under pp, as torch's PipelineStage does); ZeRO-2 gathers before forward only;
DDP all-reduces buckets of ``bucket_mb`` in the last backward (one buffer when <= 0); ZeRO-1
all-reduces then broadcasts (torch) or reduce-scatters then all-gathers (Megatron's distributed
optimizer). Parameters travel in the training dtype, gradients in ``grad_reduce_bytes``; FSDP2's
copies (``fsdp_copies``, :func:`copy_times`) and DeepSpeed 2021's per-tensor host ops
(xpar.estimate.frameworks.deepspeed_zero3) are added. The overlap: :func:`xpar.estimate.comm.overlap.simulate_pass`.

Units: seconds. Derivation: docs/concepts/cost-model-derivations.md.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from xpar.config.spec import RunSpec
from xpar.estimate.comm.collectives import collective_time, group_of
from xpar.estimate.memory.model_states import (BYTES, block_shapes, expert_dp_size, unit_elements,  # noqa: F401
                                               unit_expert_elements)
from xpar.estimate.frameworks.deepspeed_zero3 import persist_time, tensor_times
from xpar.estimate.frameworks.dp_chunks import gather_start, reduce_end
from xpar.estimate.frameworks.fp8_params import gather_widths
from xpar.estimate.frameworks.mcore_buckets import bucket_count, bucket_elements
from xpar.estimate.comm.head_unit import any_head, kept_head, split_compute, split_forward
from xpar.estimate.comm.hsdp import hsdp_unit_times, zero1_group_times
from xpar.estimate.frameworks.owner_broadcast import owner_broadcast_times
from xpar.estimate.frameworks.owner_reduce import owner_unit_times
from xpar.estimate.comm.overlap import simulate_pass, vwhere


def grad_bytes(spec: RunSpec, assume) -> int:
    """Bytes per gradient element that the dp reduction moves: the framework's
    ``grad_reduce_bytes`` under bf16 (4: fp32 reduce, xpar's and torchtitan's recipe), 4 for fp32."""
    return assume.grad_reduce_bytes if spec.train.dtype != "fp32" else 4


def unit_times(spec: RunSpec, assume, units: list[int], timed_once: Optional[dict] = None,
               experts: Optional[list[int]] = None) -> dict[str, list[float]]:
    """Seconds per unit of its all-gather, reduce-scatter and bucketed reduction (each size's
    collective timed once: the blocks of a rank are identical units). ``timed_once``: seconds of the
    collectives already timed on this hardware, dp and tp, by (collective, bytes, group), filled here (None: none).
    ``experts``: the routed-expert elements of each unit (:func:`unit_expert_elements`; None: none), reduced and
    gathered over the expert-dp ranks where they are a group of their own (:func:`expert_dp_size`), the rest
    over dp: :func:`expert_split_times`."""
    z = spec.layout.zero_stage
    if (hier := hsdp_unit_times(spec, assume, units, grad_bytes(spec, assume))) is not None:  # zero_shard_size
        return {**hier, **copy_times(spec, assume, units)}
    memo: dict[tuple, float] = {} if timed_once is None else timed_once
    if (hier := shard_group_zero1(spec, assume, units, memo)) is not None:  # ZeRO-1 with zero_shard_size
        return {**hier, **copy_times(spec, assume, units)}
    times = expert_split_times(spec, assume, units, experts, memo)
    gather, red = times["gather"], times["reduce"]
    gather_b = gather
    if z == 3 and assume.zero3_reuse_distance is not None:  # DeepSpeed 2021's coordinator, tensor by tensor
        g = group_of(spec.hardware, spec.dp, spec.tp)
        gather, red, gather_b = tensor_times(spec, assume, units, gather, red,
                                             lambda b: _timed(spec, assume, memo, "allgather", b, g),
                                             BYTES[spec.train.dtype], grad_bytes(spec, assume))
    return {"gather": gather, "gather_backward": gather_b, "reduce": red, **copy_times(spec, assume, units)}


def shard_group_zero1(spec: RunSpec, assume, units: list[int], memo: dict) -> Optional[dict[str, list[float]]]:
    """Seconds per unit of ZeRO-1 inside shard groups (xpar.estimate.comm.hsdp.zero1_group_times: the flat
    ZeRO-1 of :func:`group_times` over the group, plus the all-reduce of 1/s of each bucket across the
    replicas, in the same buckets); None without ``parallel.zero_shard_size``."""
    gb = grad_bytes(spec, assume)
    s = spec.parallel.zero_shard_size or 1

    def across(group) -> list[float]:
        buckets = buckets_of(spec, assume, units, bucket_bytes(spec, assume, gb), gb)
        return bucketed(units, [gb / s] * len(units), buckets,
                        lambda b: _timed(spec, assume, memo, "allreduce", b, group))

    return zero1_group_times(spec, lambda n, g: group_times(spec, assume, units, n, g, memo), across)


def _timed(spec: RunSpec, assume, memo: dict, kind: str, nbytes: float, group) -> float:
    """Seconds of one ``kind`` collective of ``nbytes`` over ``group``, memoised in ``memo``."""
    key = (kind, nbytes, group.size, group.per_node)
    if key not in memo:
        memo[key] = collective_time(spec.hardware, kind, nbytes, group, assume.dp_collective)
    return memo[key]


def expert_split_times(spec: RunSpec, assume, units: list[int], experts: Optional[list[int]],
                       memo: dict) -> dict[str, list[float]]:
    """Seconds per unit of its ``gather`` and ``reduce`` (:func:`group_times`): the dense elements over dp
    (ranks tp apart), the routed experts' (``experts`` per unit) over the expert-dp ranks, tp x cp x dp /
    (ep x etp) of them, ep x etp apart in the rank order (Megatron-Core's expert data parallel group,
    megatron/core/parallel_state.py; DeepSpeed-MoE's expert data parallel group, deepspeed/utils/groups.py;
    xpar.parallel.expert.group_ranks), buckets of their own (Megatron-Core's distributed data parallel keeps
    the expert parameters' buckets apart; xpar's engine reduces them in one flat buffer: reduce_expert_grads).
    One expert-dp rank: the experts issue nothing. Everything over dp where the experts have no group of
    their own."""
    edp, hw = expert_dp_size(spec), spec.hardware
    if not experts or not any(experts) or edp == spec.dp:
        return group_times(spec, assume, units, spec.dp, group_of(hw, spec.dp, spec.tp), memo)
    dense = group_times(spec, assume, [u - x for u, x in zip(units, experts)], spec.dp,
                        group_of(hw, spec.dp, spec.tp), memo)
    if edp == 1:
        return dense
    stride = spec.layout.ep * spec.layout.expert_tp
    mine = group_times(spec, assume, list(experts), edp, group_of(hw, edp, stride), memo)
    return {k: [a + b for a, b in zip(dense[k], mine[k])] for k in dense}


BUCKET_RULES = ("fixed", "megatron_core")
"""Values of Assumptions.bucket_rule (xpar.config.profile.FrameworkConfig): :func:`bucket_bytes`."""


def bucket_bytes(spec: RunSpec, assume, nbytes: int) -> float:
    """Bytes per DDP/ZeRO-1 bucket of elements of ``nbytes`` bytes: ``assume.bucket_mb`` MB under the 'fixed'
    rule; under 'megatron_core', Megatron-Core's default (xpar.estimate.frameworks.mcore_buckets.bucket_elements).

    Raises:
        ValueError: a ``bucket_rule`` not in :data:`BUCKET_RULES`."""
    rule = getattr(assume, "bucket_rule", "fixed")
    if rule not in BUCKET_RULES:
        raise ValueError(f"framework.bucket_rule must be one of {BUCKET_RULES}, got {rule!r}")
    if rule == "fixed":
        return assume.bucket_mb * 1e6
    return bucket_elements(spec) * nbytes


def buckets_of(spec: RunSpec, assume, units: list[int], bucket: float, nbytes: int) -> int:
    """How many buckets of ``bucket`` bytes the ``units`` (elements of ``nbytes`` bytes) make: ceil(bytes / bucket)
    under the 'fixed' rule; Megatron-Core's layout under 'megatron_core' (xpar.estimate.frameworks.mcore_buckets.
    bucket_count: a tensor larger than the bucket a bucket of its own)."""
    if getattr(assume, "bucket_rule", "fixed") == "megatron_core":
        return bucket_count(spec, units, bucket_elements(spec))
    return max(1, math.ceil(sum(units) * nbytes / bucket))


def bucketed(units: list[int], widths: list, buckets: int, timed: Callable[[float], float]) -> list[float]:
    """Seconds per unit of a collective issued in ``buckets`` equal buckets over ``units`` (elements of
    ``widths`` bytes each): a unit's share of ``buckets`` collectives of 1 / buckets of the bytes each
    (``timed``: seconds of one collective of so many bytes)."""
    sizes = [u * w for u, w in zip(units, widths)]
    total = sum(sizes)
    if not total:
        return [0.0] * len(units)
    per_bucket = timed(total / buckets)
    return [x / total * buckets * per_bucket for x in sizes]


def group_times(spec: RunSpec, assume, units: list[int], n: int, group, memo: dict) -> dict[str, list[float]]:
    """Seconds per unit (``units``: elements each) of its parameter ``gather`` and gradient ``reduce`` over
    ``n`` ranks in ``group`` (module docstring: what each ZeRO stage issues), the buckets :func:`bucket_bytes`;
    under the 'megatron_core' bucket rule the distributed optimizer's all-gathers run bucket by bucket too
    (megatron/core/distributed/param_and_grad_buffer.py ``_ParamAndGradBucketGroup.start_param_sync``: one
    all-gather per bucket). FP8 gathers: xpar.estimate.frameworks.fp8_params; DeepSpeed's owner-by-owner
    reduction: xpar.estimate.frameworks.owner_reduce."""
    z, gb = spec.layout.zero_stage, grad_bytes(spec, assume)
    coll = "reduce_scatter" if (z >= 2 or (z == 1 and assume.zero1 == "distributed_optimizer")) else "allreduce"
    coll = "allreduce" if z >= 2 and not assume.grad_reduce_scatter else coll  # DeepSpeed's reduce_scatter false
    bucket = bucket_bytes(spec, assume, gb)

    def timed(kind: str, nbytes: float) -> float:
        return _timed(spec, assume, memo, kind, nbytes, group)

    if z >= 2:  # FSDP: one reduce-scatter per unit
        red = [timed(coll, u * gb) for u in units]
    elif bucket > 0:  # buckets: a unit's share of the messages, ceil(gradient bytes / bucket) of them
        buckets = buckets_of(spec, assume, units, bucket, gb)
        red = bucketed(units, [gb] * len(units), buckets, lambda b: timed(coll, b))
    else:  # one buffer after the backward
        red = [timed(coll, sum(units) * gb) / len(units)] * len(units)
    pw = gather_widths(spec, assume, len(units))  # e, or FP8 blocks (framework.fp8_param_gather)
    if coll == "reduce_scatter" and z in (1, 2) and getattr(assume, "zero_owner_reduce", False):  # DeepSpeed's
        red = owner_unit_times(units, gb, n, bucket, z == 2, lambda b: timed("broadcast", b))
    if z == 1 and assume.zero1 == "owner_broadcast":  # InternEvo: a broadcast per owner of a unit's tensors
        return {"gather": owner_broadcast_times(units, list(pw), unit_tensors(spec, units), n,
                                                lambda b: timed("broadcast", b)), "reduce": red}
    kind = "broadcast" if z == 1 and assume.zero1 == "zero_redundancy" else "allgather"  # torch: broadcasts
    if z == 1 and kind == "allgather" and getattr(assume, "bucket_rule", "fixed") == "megatron_core":
        buckets = buckets_of(spec, assume, units, bucket, gb)  # the gradient buckets' parameters, in their width
        return {"gather": bucketed(units, list(pw), buckets, lambda b: timed(kind, b)), "reduce": red}
    return {"gather": [timed(kind, u * w) for u, w in zip(units, pw)], "reduce": red}


def unit_tensors(spec: RunSpec, units: list[int]) -> list[int]:
    """Parameter tensors per unit (``units``: the root first, then blocks): a dense block's tensors (xpar.estimate.
    memory.model_states.block_shapes) for each block, the root's embedding, final norm and output (2 when tied)."""
    block = len(block_shapes(spec.model, spec.tp))
    root = 2 if spec.model.tied_embeddings else 3
    return [root if i == 0 else block for i in range(len(units))]


FSDP_COPIES = ("fsdp2", "fsdp1", "none")
"""Values of Assumptions.fsdp_copies (xpar.config.schema.FrameworkConfig)."""


def copy_times(spec: RunSpec, assume, units: list[int]) -> dict[str, list[float]]:
    """Seconds per unit of the ZeRO-2/3 copies on the compute stream (Assumptions.fsdp_copies;
    dp > 1): ``copy_gather``, after each all-gather, FSDP2's copy of the flat output into the
    unit's parameters (read and write of its elements in the training dtype); ``copy_reduce``,
    before each reduce-scatter, FSDP2's copy of the unit's gradients (training dtype) into the
    reduce buffer (``grad_reduce_bytes`` each), FSDP1's cast of its flat gradient where the widths
    differ. Over ``hardware.hbm_tb_per_s``; zeros without it.

    Raises:
        ValueError: an ``fsdp_copies`` not in :data:`FSDP_COPIES`."""
    kind, hbm = assume.fsdp_copies, (spec.hardware.hbm_tb_per_s or 0) * 1e12
    if kind not in FSDP_COPIES:
        raise ValueError(f"framework.fsdp_copies must be one of {FSDP_COPIES}, got {kind!r}")
    e, gb = BYTES[spec.train.dtype], grad_bytes(spec, assume)
    copy_out = 2 * e if kind == "fsdp2" else 0
    copy_in = e + gb if kind == "fsdp2" or (kind == "fsdp1" and gb != e) else 0
    if not (spec.layout.zero_stage >= 2 and spec.dp > 1 and hbm):
        copy_out = copy_in = 0
    return {"copy_gather": [copy_out * n / hbm if copy_out else 0.0 for n in units],
            "copy_reduce": [copy_in * n / hbm if copy_in else 0.0 for n in units]}


def root_kept(backward_order: list) -> list:
    """Per-unit values in backward order (root last) with the root's set to 0: without pp,
    ZeRO-3's backward gathers every block but not the root, which stays unsharded from its
    forward to its backward (module docstring)."""
    return list(backward_order[:-1]) + [0.0 * backward_order[-1]] if backward_order else []


def _masked(cond: Any, times: list) -> list:
    """``times`` where ``cond``, zeros elsewhere (cond a bool, or a bool array over layouts)."""
    if isinstance(cond, np.ndarray) and not cond.any():  # zero floats: a pass issues nothing for them
        cond = False
    if not isinstance(cond, np.ndarray):
        return times if cond else [0.0] * len(times)
    if cond.all():  # np.where's values without its copy, for float arrays of cond's shape
        return [x if isinstance(x, np.ndarray) and x.shape == cond.shape and x.dtype == np.float64
                else np.where(cond, x, 0.0) for x in times]
    return [np.where(cond, x, 0.0) for x in times]


def _lazy(cond: Any, when_true: Callable[[], Any], when_false: Callable[[], Any]) -> Any:
    """vwhere(cond, when_true(), when_false()), evaluating only the branch a bool needs."""
    if not isinstance(cond, np.ndarray):
        return when_true() if cond else when_false()
    return np.where(cond, when_true() if cond.any() else 0.0, when_false() if not cond.all() else 0.0)


def dp_exposure(z: Any, pp: Any, assume, compute_f: list, compute_b: list, gather: list, reduce: list,
                copy_gather: Optional[list] = None, copy_reduce: Optional[list] = None,
                gather_b: Optional[list] = None, v: Any = 1, units: Any = None, head: Any = 0.0) -> dict:
    """Exposed and issued dp communication of one pipeline rank (module docstring), for a
    ZeRO stage ``z`` and pipeline degree ``pp`` (ints, or int arrays over layouts: every time
    then an array or a float). ``gather``/``reduce``: seconds of each unit's all-gather and
    reduction, forward order (root first); ``copy_gather``/``copy_reduce``: each unit's compute-
    stream copies after its gather and before its reduction (:func:`copy_times`; None: none), added
    to the unit's compute where they happen and counted as exposed dp time (they exist for the
    collectives). Returns seconds: ``per_microbatch`` and ``end`` exposed (per micro-batch and once per step, the
    copies in), ``issued_per_microbatch`` and ``issued_once`` (issued per step = m x the first +
    the second), ``first_backward``: exposed once per step in the stage's first backward (ZeRO-3's
    backward gathers under pp, copies in), ``copy_per_microbatch``, ``copy_once`` and
    ``copy_first_backward`` (the copies alone). ``gather_b``: each unit's gathers in the backward,
    forward order (None: ``gather``; more where ZeRO-3 gathers some tensors twice: :func:`unit_times`).
    ``v``: model chunks per pipeline rank (an int, or an int array over layouts), read with
    ``assume.dp_overlap_per_chunk`` (xpar.estimate.frameworks.dp_chunks). ``units``: each layout's own units
    (an int array) where the lists hold more, the extra ones of no time (after its blocks in forward order;
    None: all units are its own). ``head``: the share of the root's elements that are the output head, a unit of its
    own after the last block where > 0 (a float, or a float array over layouts; xpar.estimate.comm.head_unit)."""
    gather_b = gather if gather_b is None else gather_b
    if any_head(head):  # the root split: the embedding first, the head (with the logits) last in forward
        compute_f, compute_b = split_compute(compute_f, compute_b, head)
        gather, reduce, copy_gather, copy_reduce, gather_b = (split_forward(x, head) for x in (
            gather, reduce, copy_gather, copy_reduce, gather_b))
        gather_b = kept_head(gather_b[::-1], head)[::-1]  # the head stays gathered for its backward
    zeros = [0.0] * len(gather)
    cg, cr = copy_gather or zeros, copy_reduce or zeros
    cg_b = kept_head(root_kept(cg[::-1]), head)  # backward order: copies after the backward's gathers
    every = (z >= 2) & (pp == 1)
    fwd_gathers, bwd_gathers = (z == 3) | ((z == 2) & (pp == 1)), (z == 3) & (pp == 1)
    compute_f = [c + x for c, x in zip(compute_f, _masked(fwd_gathers, cg))]
    compute_b = [c + g + r for c, g, r in zip(compute_b, _masked(bwd_gathers, cg_b), _masked(every, cr[::-1]))]
    out = _exposure(z, pp, assume, compute_f, compute_b, gather, reduce, gather_b, v, units)
    copy_mb = vwhere(fwd_gathers, sum(cg), 0.0) + vwhere(bwd_gathers, sum(cg_b), 0.0) + vwhere(every, sum(cr), 0.0)
    copy_once = vwhere((z == 2) & (pp > 1), sum(cg), 0.0) + vwhere((z >= 2) & (pp > 1), sum(cr), 0.0)
    copy_first = vwhere((z == 3) & (pp > 1), sum(cg), 0.0)
    out["first_backward"] = out["first_backward"] + copy_first
    out["per_microbatch"] = out["per_microbatch"] + copy_mb  # the copies are dp's cost: exposed with it
    out["end"] = out["end"] + copy_once
    return dict(out, copy_per_microbatch=copy_mb, copy_once=copy_once, copy_first_backward=copy_first)


def _exposure(z: Any, pp: Any, assume, compute_f: list, compute_b: list, gather: list, reduce: list,
              gather_b: list, v: Any = 1, units: Any = None) -> dict:
    """:func:`dp_exposure` on compute that already holds the copies."""
    gf, gb_, red = gather, gather_b[::-1], reduce[::-1]
    pre, slow, overlap = assume.fsdp_prefetch, assume.overlap_slowdown, assume.dp_overlap
    every = (z >= 2) & (pp == 1)
    fwd_gathers, bwd_gathers = (z == 3) | ((z == 2) & (pp == 1)), (z == 3) & (pp == 1)
    gathered_once, bwd_once = (z == 1) | ((z == 2) & (pp > 1)), (z == 3) & (pp > 1)
    bwd_g = _masked(bwd_gathers, root_kept(gb_))
    chunked = (pp > 1) & (z <= 1) & (v > 1) & bool(overlap and getattr(assume, "dp_overlap_per_chunk", False))
    after_step = (z == 1) & bool(assume.param_gather_overlap)  # ZeRO-1's gathers overlap the next forward
    first_bwd = _lazy(bwd_once, lambda: simulate_pass(compute_b, gb_, None, pre, slow).exposed, lambda: 0.0)
    read_gf = fwd_gathers | ((z == 2) & (pp > 1)) | (after_step & np.logical_not(chunked))  # where with_gf is read
    with_gf = _lazy(read_gf, lambda: simulate_pass(compute_f, gf, None, pre, slow).exposed, lambda: 0.0)
    bwd = simulate_pass(compute_b, bwd_g, _masked(every & overlap, red) if overlap else None, pre, slow).exposed
    sum_red, sum_gf = sum(red), sum(gf)
    per_mb = vwhere(fwd_gathers, with_gf, 0.0) + bwd + (vwhere(every, sum_red, 0.0) if not overlap else 0.0)
    if overlap:  # reductions once, in the last micro-batch's backward (per chunk below)
        end = _lazy(every | chunked, lambda: 0.0, lambda: simulate_pass(compute_b, bwd_g, red, pre, slow).exposed - bwd)
    else:  # or after it
        end = vwhere(every, 0.0, sum_red)
    if np.any(chunked):  # Megatron-Core: xpar.estimate.frameworks.dp_chunks
        end = vwhere(chunked, reduce_end(pp, v, assume, compute_b, red, units), end)
        if np.any(chunked & after_step):
            with_gf = vwhere(chunked, gather_start(pp, v, assume, compute_f, gf, units), with_gf)
    end = end + vwhere((z == 2) & (pp > 1), with_gf, 0.0)  # gathered once per step under pp
    end = end + vwhere(z == 1, with_gf if assume.param_gather_overlap else sum_gf, 0.0)  # after the step
    issued_mb = vwhere(fwd_gathers, sum_gf, 0.0) + vwhere(bwd_gathers, sum(root_kept(gb_)), 0.0) + vwhere(every, sum_red, 0.0)
    once = vwhere(every, 0.0, sum_red) + vwhere(gathered_once, sum_gf, 0.0) + vwhere(bwd_once, sum(gb_), 0.0)
    return {"per_microbatch": per_mb, "end": end, "issued_per_microbatch": issued_mb, "issued_once": once,
            "first_backward": first_bwd}
