"""Per-device memory of a layout: model states, activations, buffers. Units: bytes.

Every term is named (:data:`xpar.estimate.terms.MEMORY_TERMS`), each counted as the framework keeps
it; what a framework does differently is a :class:`MemoryOptions` field (framework profiles set them).

- Model states: the ZeRO paper's 2 + 2 + 12 bytes per parameter (Rajbhandari et al. 2020), or the
  framework's widths (:func:`state_widths`: xpar/torchtitan fp32 storage, Megatron/DeepSpeed bf16),
  held exactly as xpar's wrappers shard them (DDP, ZeroRedundancyOptimizer, FSDP2 dim-0 chunks).
- Activations: Korthikanti et al. 2022 Table 2 generalised term by term
  (:func:`layer_activation_bytes`); a rank's peak walks the schedule's own action list.
- Recompute: none, full (Chen et al. 2016), selective by ``selective_recompute``.
- Besides (``count_buffers``): DDP buckets, FSDP gather/reduce buffers, p2p buffers, recompute
  workspace, loss temporaries, ``hardware.framework_overhead_gb``.
Derivation: docs/concepts/cost-model-derivations.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

from xpar.config.schema import ModelConfig
from xpar.config.spec import RunSpec
from xpar.estimate.activations import activation_terms, recompute_notes, schedule_peak
from xpar.estimate.context_parallel import fold_cp
from xpar.estimate.hsdp import shard_group_spec
from xpar.estimate.zero12_step import fp32_grad_partition_bytes
from xpar.estimate.model_states import (
    MemoryOptions,
    _model_key,
    _shapes_layout,
    expert_state_bytes,
    _stage_numels,
    _stage_parts,
    _numels,
    held_state_terms,
    most_loaded_dp_rank,
    precision,
    state_widths,
)


def state_terms(spec: RunSpec, pp_rank: int, dp_rank: int, o: MemoryOptions) -> dict[str, int]:
    """Model-state bytes by part: params_master (stored parameters), params_compute (bf16
    copies held: FSDP2 ZeRO-2's whole bf16 parameters, ZeRO-3's under pp when not
    resharded, autocast's weight copies per micro-batch in flight), grads, optimizer."""
    out = held_state_terms(spec, pp_rank, dp_rank, o)
    if precision(spec, o)["autocast"]:
        out["params_compute"] = schedule_peak(spec, pp_rank, o)["weight_copies"]
    return out


def model_state_bytes(spec: RunSpec, stage_index: Optional[int] = None, dp_rank: Optional[int] = None,
                      assume=None, **options) -> dict[str, int]:
    """Bytes per device of params, grads and optimizer states (dict with those keys) as the
    framework keeps them (:func:`state_terms`; params = master + compute copies).

    ``stage_index``: the pipeline rank; None takes the rank with the most bytes.
    ``dp_rank``: None takes the most loaded dp rank (:func:`most_loaded_dp_rank`).
    ``assume``/``options``: :class:`MemoryOptions`. Equals what
    xpar.parallel.memory_accounting.model_state_bytes measures on a real run (fp32 and bf16).
    """
    o = MemoryOptions.of(assume, **options)
    best = None
    for pr in (range(spec.pp) if stage_index is None else [stage_index]):
        t = state_terms(spec, pr, most_loaded_dp_rank(spec, pr, o.zero1) if dp_rank is None else dp_rank, o)
        d = {"params": t["params_master"] + t["params_compute"], "grads": t["grads"], "optimizer": t["optimizer"]}
        if best is None or sum(d.values()) > sum(best.values()):
            best = d
    return best


@dataclass
class MemoryEstimate:
    """Peak bytes on the most loaded device (pipeline rank ``pp_rank``, its most loaded dp
    rank). Every term is present, zero where it does not apply. Units: bytes."""

    params: float
    grads: float
    optimizer: float
    activations: float
    comm_buffers: float
    framework_overhead: float
    total: float
    device_memory: float
    """Memory of one device (hardware.device_memory_gb x 1e9)."""
    fits: bool
    """total <= usable (device memory less ``hardware.memory_headroom``)."""
    pp_rank: int
    detail: dict = field(default_factory=dict)
    """activations by term, comm buffers by term, model-state parts (params_master,
    params_compute), ``usable`` bytes and ``notes``."""

    @property
    def usable(self) -> float:
        """Bytes the fit check allows: device memory x (1 - hardware.memory_headroom)."""
        return self.detail.get("usable", self.device_memory)


@lru_cache(maxsize=8192)
def _fsdp_units(cfg_key: tuple, layout, tp: int, pp_rank: int) -> tuple[int, int]:
    """Elements of the largest FSDP root unit (a stage's embeddings, final norm, output) and
    of the largest block unit on a pipeline rank, as xpar and torchtitan wrap them."""
    roots, blocks = [0], [0]
    moe = sum(math.prod(sh) for _, sh in _stage_parts(cfg_key, False, False, tp, True, layout.ep, layout.etp)[1])
    for s in layout.stages_of(pp_rank):
        head, block, tail = _stage_parts(cfg_key, s == 0, s == layout.n_stages - 1, tp)
        roots.append(sum(math.prod(sh) for _, sh in head + tail))
        dense = sum(math.prod(sh) for _, sh in block)
        blocks += [moe if ModelConfig(*cfg_key).is_moe_layer(i) else dense for i in layout.stage_layers(s)]
    return max(roots), max(blocks)


def comm_buffer_terms(spec: RunSpec, pp_rank: int, assume=None, **options) -> dict[str, float]:
    """Communication and sharding buffers, bytes (0 unless ``count_buffers``).

    ddp_buckets (ZeRO 0/1, dp > 1): torch DDP copies gradients into flat buckets
    (gradient_as_bucket_view=False, the default): one more gradient-sized buffer (Megatron's
    gradients live in its buffer: ``ddp_bucket_copy`` False). fsdp_allgather (ZeRO-3,
    resharded): in the compute dtype, the root's unsharded parameters (gathered at the start of
    the forward and held through it -- through the backward too without pp,
    xpar.parallel.data_parallel.apply_fsdp), the running block's and the prefetched next
    block's (FSDP2's implicit prefetch): root + 2 blocks. fsdp_reduce (ZeRO-2/3 without
    pp): one unit of unsharded gradients in the compute dtype, plus its fp32 copy when the
    reduction runs in fp32 (MixedPrecisionPolicy reduce_dtype); under pp the deferred whole
    gradients are the ``grads`` term. With ``zero3_gather='tensor'`` (DeepSpeed v0.3) the unit is the
    largest parameter tensor, gathered alone and not prefetched (``fsdp_allgather`` 2 of them: the
    one in use and the next). pp_p2p: one send and one receive buffer of b s h elements per stage
    held (/t with sp). fp32_grad_partition: DeepSpeed ZeRO-1/2's fp32 copy of the rank's gradient
    partition at the step (xpar.estimate.zero12_step; ``fp32_grad_partition``).
    """
    o = MemoryOptions.of(assume, **options)
    out = state_buffer_terms(spec, pp_rank, o)
    out["pp_p2p"] = 0.0
    if o.count_buffers and spec.pp > 1:
        out["pp_p2p"] = p2p_buffer_bytes(spec.seq_len, spec.train.micro_batch_size, spec.model.hidden,
                                         len(spec.layout.stages_of(pp_rank)), precision(spec, o)["er"], spec.tp,
                                         spec.parallel.sequence_parallel)
    return out


def state_buffer_terms(spec: RunSpec, pp_rank: int, o: MemoryOptions) -> dict[str, float]:
    """The buffers of :func:`comm_buffer_terms` sized by the model states (ddp_buckets,
    fsdp_allgather, fsdp_reduce): they depend on the rank's parameters, dp, pp and the ZeRO
    stage only. Bytes."""
    out = {"ddp_buckets": 0.0, "fsdp_allgather": 0.0, "fsdp_reduce": 0.0, "fp32_grad_partition": 0.0}
    if not o.count_buffers:
        return out
    out["fp32_grad_partition"] = fp32_grad_partition_bytes(spec, pp_rank, o)  # DeepSpeed ZeRO-1/2's step
    z, e = spec.parallel.zero_stage, precision(spec, o)["e"]
    whole, _ = _stage_numels(_model_key(spec.model), _shapes_layout(spec.layout), spec.tp, pp_rank)
    root, block = _fsdp_units(_model_key(spec.model), _shapes_layout(spec.layout), spec.tp, pp_rank)
    unit = max(root, block)
    if o.zero3_gather == "tensor":  # DeepSpeed v0.3: one parameter tensor gathered / reduced at a time
        root = block = unit = max(_numels(_stage_numels(_model_key(spec.model), _shapes_layout(spec.layout),
                                                        spec.tp, pp_rank)[1]), default=0)
        root = 0
    if z <= 1 and spec.dp > 1 and o.ddp_bucket_copy:
        out["ddp_buckets"] = whole * state_widths(spec, o)[1]
    if z == 3 and (spec.pp == 1 or o.fsdp_reshard_under_pp):
        out["fsdp_allgather"] = (root + 2 * block) * e
    if z >= 2 and spec.pp == 1:
        out["fsdp_reduce"] = unit * (e + (o.grad_bytes if e != o.grad_bytes else 0))
    return out


def p2p_buffer_bytes(seq_len, b, hidden, stages_held, resid_elem, tp, sp):
    """Pipeline send and receive buffers of one pipeline rank: 2 per stage held, b s h
    elements of ``resid_elem`` bytes each (/tp with sequence parallelism ``sp``). Bytes.
    Works on numbers or numpy arrays alike (the planner, :mod:`xpar.estimate.columns.peak_memory`)."""
    return 2 * stages_held * (seq_len * b * hidden) * resid_elem / (tp * sp + 1 - sp)


def rank_memory(spec: RunSpec, pp_rank: int, o: MemoryOptions) -> MemoryEstimate:
    """:class:`MemoryEstimate` of pipeline rank ``pp_rank`` on its most loaded dp rank."""
    dp_rank = most_loaded_dp_rank(spec, pp_rank, o.zero1)
    st = state_terms(spec, pp_rank, dp_rank, o)
    act = activation_terms(spec, pp_rank, o)
    comm = comm_buffer_terms(spec, pp_rank, o)
    acts = act["saved"] + act["transient"]
    overhead = (spec.hardware.framework_overhead_gb or 0) * 1e9
    params = st["params_master"] + st["params_compute"]
    total = params + st["grads"] + st["optimizer"] + acts + sum(comm.values()) + overhead
    dev = (spec.hardware.device_memory_gb or 0) * 1e9
    usable = dev * (1 - (getattr(spec.hardware, "memory_headroom", 0.0) or 0.0))
    return MemoryEstimate(params=params, grads=st["grads"], optimizer=st["optimizer"], activations=acts,
                          comm_buffers=sum(comm.values()), framework_overhead=overhead, total=total,
                          device_memory=dev, fits=total <= usable, pp_rank=pp_rank,
                          detail={"activations": act, "comm_buffers": comm, "states": st, "usable": usable,
                                  "notes": recompute_notes(spec, o) + expert_notes(spec, pp_rank, dp_rank, o)})


def expert_notes(spec: RunSpec, pp_rank: int, dp_rank: int, o: MemoryOptions) -> list[str]:
    """The expert states of a MoE model's rank in words (xpar.estimate.model_states.expert_state_bytes)."""
    ex = expert_state_bytes(spec, pp_rank, dp_rank, o)
    if not ex:
        return []
    cfg, lay = spec.model, spec.layout
    return [f"expert states: {cfg.n_experts // lay.ep} of {cfg.n_experts} routed experts per MoE layer on this rank "
            f"(ep={lay.ep}, etp={lay.expert_tp}): params {ex['params'] / 1e9:.1f} GB, grads {ex['grads'] / 1e9:.1f} GB, "
            f"optimizer {ex['optimizer'] / 1e9:.1f} GB (sharded over {ex['expert_dp']} expert-dp ranks), "
            f"included in the model states"]


def memory(spec: RunSpec, pp_rank: Optional[int] = None, assume=None, **options) -> MemoryEstimate:
    """Per-device peak memory of ``spec`` on pipeline rank ``pp_rank`` (None: the most
    loaded rank). ``assume`` (an Assumptions) and ``options`` give the
    :class:`MemoryOptions` (also the legacy ``flash``, ``dropout``, ``fused_rmsnorm``,
    ``sp_saves_gathered``). See the module docstring for the terms."""
    o = MemoryOptions.of(assume, **options)
    spec = fold_cp(spec)  # cp ranks hold s / cp tokens and shard over dp x cp (xpar.estimate.context_parallel)
    spec = shard_group_spec(spec)  # hierarchical ZeRO: states sharded over parallel.zero_shard_size (xpar.estimate.hsdp)
    best = None
    for r in (range(spec.pp) if pp_rank is None else [pp_rank]):
        est = rank_memory(spec, r, o)
        if best is None or est.total > best.total:
            best = est
    return best
