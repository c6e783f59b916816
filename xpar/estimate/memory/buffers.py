"""Communication and sharding buffers per device, besides model states and saved activations: DDP
buckets, FSDP all-gather and reduce buffers, DeepSpeed's fp32 gradient partition, pipeline p2p
buffers (:func:`state_buffer_terms`, :func:`p2p_buffer_bytes`). Counted only when the framework's ``count_buffers``. Units:
bytes. Sources: torch DDP and FSDP2 (xpar.parallel.data_parallel), DeepSpeed v0.3
(xpar.estimate.frameworks.zero12_step); docs/concepts/cost-model-derivations.md.
"""
from __future__ import annotations

import math
from functools import lru_cache

from xpar.config.schema import ModelConfig
from xpar.config.spec import RunSpec
from xpar.estimate.memory.model_states import (
    MemoryOptions,
    _part_counts,
    _stage_numels,
    precision,
    shape_key,
    state_widths,
)
from xpar.estimate.frameworks.bf16_optimizer import gradient_cast_terms
from xpar.estimate.frameworks.zero12_step import fp32_grad_partition_bytes


@lru_cache(maxsize=8192)
def _fsdp_units(cfg_key: tuple, layout, tp: int, pp_rank: int, head_units: bool = False) -> tuple[int, int]:
    """Elements of the largest FSDP root unit (a stage's embeddings, final norm, output: one unit, or with
    ``head_units`` the embedding and the head each a unit of its own, framework.fsdp_head_units) and of the largest
    block unit on a pipeline rank."""
    roots, blocks, cfg = [0], [0], ModelConfig(*cfg_key)
    moe = _part_counts(cfg_key, False, False, tp, True, layout.ep, layout.etp)[1][0]
    for s in layout.stages_of(pp_rank):
        head, block, tail, _ = _part_counts(cfg_key, s == 0, s == layout.n_stages - 1, tp)
        roots.append(max(head[0], tail[0]) if head_units and not cfg.tied_embeddings else head[0] + tail[0])
        blocks += [moe if cfg.is_moe_layer(i) else block[0] for i in layout.stage_layers(s)]
    return max(roots), max(blocks)


def state_buffer_terms(spec: RunSpec, pp_rank: int, o: MemoryOptions) -> dict[str, float]:
    """Buffers sized by the model states of pipeline rank ``pp_rank``, bytes (0 unless ``count_buffers``).

    ddp_buckets (ZeRO 0/1, dp > 1): torch DDP copies gradients into flat buckets
    (gradient_as_bucket_view=False, the default): one more gradient-sized buffer (Megatron's
    gradients live in its buffer: ``ddp_bucket_copy`` False); DeepSpeed's ``grad_buckets`` of ``bucket_mb``
    at most. fsdp_allgather (ZeRO-3,
    resharded): in the compute dtype, the root's unsharded parameters (gathered at the start of
    the forward and held through it -- through the backward too without pp,
    xpar.parallel.data_parallel.apply_fsdp), the running block's and the prefetched next
    block's (FSDP2's implicit prefetch): root + 2 blocks. fsdp_reduce (ZeRO-2/3 without
    pp): one unit of unsharded gradients in the compute dtype, plus its fp32 copy when the
    reduction runs in fp32 (MixedPrecisionPolicy reduce_dtype); under pp the deferred whole
    gradients are the ``grads`` term. With ``zero3_gather='tensor'`` (DeepSpeed v0.3) the unit is the
    largest parameter tensor, gathered alone and not prefetched (``fsdp_allgather`` 2 of them: the
    one in use and the next). fp32_grad_partition: DeepSpeed ZeRO-1/2's fp32 copy of the rank's
    gradient partition at the step (xpar.estimate.frameworks.zero12_step). grad_reduce_cast, grad_accum_cast:
    DeepSpeed BF16_Optimizer's casts of the gradients (xpar.estimate.frameworks.bf16_optimizer). The pipeline's buffers:
    :func:`p2p_buffer_bytes` (``pp_p2p``).
    """
    out = {"ddp_buckets": 0.0, "fsdp_allgather": 0.0, "fsdp_reduce": 0.0, "fp32_grad_partition": 0.0,
           "grad_reduce_cast": 0.0, "grad_accum_cast": 0.0}
    if not o.count_buffers:
        return out
    out.update(gradient_cast_terms(spec, pp_rank, o))  # DeepSpeed BF16_Optimizer's gradient casts
    out["fp32_grad_partition"] = fp32_grad_partition_bytes(spec, pp_rank, o)  # DeepSpeed ZeRO-1/2's step
    z, e = spec.layout.zero_stage, precision(spec, o)["e"]
    whole, _ = _stage_numels(*shape_key(spec), pp_rank)
    root, block = _fsdp_units(*shape_key(spec), pp_rank, o.fsdp_head_units)
    unit = max(root, block)
    if o.zero3_gather == "tensor":  # DeepSpeed v0.3: one parameter tensor gathered / reduced at a time
        root = block = unit = max((math.prod(sh) for sh, _ in _stage_numels(
            *shape_key(spec), pp_rank)[1]), default=0)
        root = 0
    if z <= 1 and spec.dp > 1 and o.ddp_bucket_copy:
        out["ddp_buckets"] = whole * state_widths(spec, o)[1]
        if o.grad_buckets:  # DeepSpeed: its reduction buckets, not a second whole gradient
            out["ddp_buckets"] = min(out["ddp_buckets"], o.grad_buckets * o.bucket_mb * 1e6)
    if z == 3 and (spec.pp == 1 or o.fsdp_reshard_under_pp):
        out["fsdp_allgather"] = (root + 2 * block) * e
    if z >= 2 and spec.pp == 1:
        out["fsdp_reduce"] = unit * (e + (o.grad_bytes if e != o.grad_bytes else 0))
    return out


def p2p_buffer_bytes(seq_len, b, hidden, stages_held, resid_elem, tp, sp):
    """Pipeline send and receive buffers of one pipeline rank (``pp_p2p``): 2 per stage held, b s h
    elements of ``resid_elem`` bytes each (/tp with sequence parallelism ``sp``). Bytes.
    Works on numbers or numpy arrays alike (the planner, :mod:`xpar.estimate.columns.peak_memory`)."""
    return 2 * stages_held * (seq_len * b * hidden) * resid_elem / (tp * sp + 1 - sp)
