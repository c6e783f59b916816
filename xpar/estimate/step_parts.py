"""The parts a step's cost is assembled from, for one layout or numpy columns of layouts alike:
the framework's behaviour (:class:`Assumptions`), a layer's seconds per micro-batch (matmul at
peak x eta(h/t), memory-bound passes over HBM: :func:`layer_costs`), tp and pp communication per
micro-batch, a pipeline rank's terms (:func:`rank_compute`), the optimizer term, the step from
the slowest rank (:func:`step_time`, :func:`fill_time`) and the rates (:func:`rates`).

eta(x) = hardware.matmul_efficiency x / (x + GEMM_HALF_DIM); sources: xpar.estimate.cost's module
docstring. The orchestration over pipeline ranks is :mod:`xpar.estimate.columns.step_time`, one
for the planner's columns and :func:`xpar.estimate.cost.estimate` (a layout is a column of one).
Units: seconds, FLOP/s, bytes. Pure: no devices, no torch.
"""
from __future__ import annotations

from dataclasses import MISSING, field, fields, make_dataclass, replace
from typing import Any, Optional

import numpy as np

from xpar.config.attention import kv_replica_elements, tp_compute_model
from xpar.config.block import block_collectives, forward_share
from xpar.config.profile import FrameworkConfig
from xpar.config.remat import POLICIES, extra_forward_flops_per_layer, reruns, spec_recompute, tp_reruns
from xpar.config.schema import HardwareConfig
from xpar.config.spec import RunSpec
from xpar.estimate.compute import flops as fl
from xpar.estimate.memory.activations import layer_activation_bytes, token_ffn
from xpar.estimate.comm.collectives import collective_time, group_of, p2p_time
from xpar.estimate.compute.host import oversubscription
from xpar.estimate.compute.kernel_costs import kernel_layer_costs, kernel_priced
from xpar.estimate.memory.model_states import (
    BYTES,
    MEMORY_PROFILES,
    STATE_BYTES,
    MemoryOptions,
    state_widths,
)
from xpar.estimate.comm.overlap import vmax, vmin

GEMM_HALF_DIM = 32.0
"""GEMM dimension (h/t) at which matmul efficiency is half of hardware.matmul_efficiency."""


PLAN_FIELDS = ("terms", "schedules", "zero_stages", "pp_zero_stages", "recompute", "sequence_parallel", "offload",
               "microbatch_rule", "interleaved_min_pp", "make_vocab_size_divisible_by", "etp_degrees", "max_cp",
               "max_ep", "even_layer_split", "kv_heads_over_tp")
"""FrameworkConfig fields that say what a framework runs (its layout rules, the planner's space), not how it
performs: not assumptions of the cost model. ``make_vocab_size_divisible_by`` and ``kv_heads_over_tp`` shape the model
each rank holds: the cost model reads them from ``spec.framework`` (xpar.config.vocab, xpar.config.attention)."""


class _Profiles:
    """The constructors of :data:`Assumptions` (a mixin: the fields come from FrameworkConfig)."""

    @classmethod
    def from_config(cls, framework) -> "Assumptions":
        """The assumptions of a :class:`xpar.config.schema.FrameworkConfig` (every field of this
        class that the framework config has; the rest keep their defaults)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: getattr(framework, k) for k in names if hasattr(framework, k)})

    @classmethod
    def megatron_2021(cls) -> "Assumptions":
        """Megatron-LM as in Narayanan et al. 2021 (conf/framework/megatron.yaml): unfused
        softmax (scores in HBM), dropout, fp16 gradients all-reduced in one buffer after the
        pipeline flush (not overlapped), blocking tp and p2p, scatter/gather; ZeRO-1 as the
        distributed optimizer; apex's fused Adam."""
        return cls(name="megatron", flash_attention=False, dropout=True, dp_overlap=False, scatter_gather=True,
                   sp_saves_gathered=False, grad_reduce_bytes=2, bucket_mb=0.0, adamw_bytes_per_element=None,
                   **MEMORY_PROFILES["megatron"])

    @classmethod
    def xpar_cpu(cls) -> "Assumptions":
        """xpar on the CPU build of torch (measured with saved_tensors_hooks, torch 2.13): SDPA
        runs its flash kernel for CPU (ScaledDotProductFlashAttentionForCpuBackward: keeps q,
        k, v, the output and the fp32 log-sum-exp, no s x s probabilities), and RMSNorm is
        composite (keeps x, rstd and x * rstd). Used for hardware=local (:func:`assumptions_for`)."""
        return cls(flash_attention=True, fused_rmsnorm=False, count_buffers=False)


def _time_fields() -> list:
    """(name, type, field) of every :class:`xpar.config.profile.FrameworkConfig` field the cost model reads
    beyond :class:`MemoryOptions`' (not :data:`PLAN_FIELDS`), with the profile's defaults."""
    memory = {f.name for f in fields(MemoryOptions)}
    keep = [f for f in fields(FrameworkConfig) if f.name not in memory and f.name not in PLAN_FIELDS]
    return [(f.name, f.type, field(default=f.default) if f.default is not MISSING
             else field(default_factory=f.default_factory)) for f in keep]


Assumptions = make_dataclass("Assumptions", _time_fields(), bases=(MemoryOptions, _Profiles), frozen=True,
                             namespace={"__module__": __name__})
Assumptions.__doc__ = """How the training framework behaves (not the hardware), as the cost model reads it: the
fields of :class:`xpar.config.profile.FrameworkConfig` (documented there, with their defaults: xpar on torch,
CUDA) but the plan's (:data:`PLAN_FIELDS`); the memory fields from :class:`MemoryOptions`. Frozen. Built from a
``framework`` preset by ``Assumptions.from_config``."""


def assumptions_for(spec: RunSpec) -> Assumptions:
    """The assumptions of the spec's framework (``spec.framework``, default xpar); on a CPU,
    torch's composite RMSNorm (measured, :meth:`Assumptions.xpar_cpu`), and collectives that
    hide nothing behind compute (``overlap_slowdown`` 1: gloo's copies and reductions run on the
    cores that compute), and the passes over the gradients counted (``gradient_passes``)."""
    a = sink_assumptions(spec.model, Assumptions.from_config(spec.framework))
    if spec.hardware.device != "cpu":
        return a
    return replace(a, fused_rmsnorm=False, count_buffers=False, overlap_slowdown=1.0, gradient_passes=True)


def sink_assumptions(model, a: Assumptions) -> Assumptions:
    """``a`` for ``model``: where the model has learned attention sinks (model.attention_sinks) that the framework
    runs unfused (framework.sink_attention 'unfused': Transformer Engine's UnfusedDotProductAttention), the core is
    the unfused one, its s x s scores kept and moved (flash_attention false) in time and memory alike; else ``a``.
    Idempotent (:func:`xpar.estimate.cost.estimate` applies it to a given ``assume`` too)."""
    if model.attention_sinks and a.sink_attention == "unfused" and a.flash_attention:
        return replace(a, flash_attention=False)
    return a


def matmul_efficiency(hw: HardwareConfig, dim: float) -> float:
    """Achievable fraction of peak for GEMMs whose smallest dimension is ``dim`` (h/t)."""
    return hw.matmul_efficiency * dim / (dim + GEMM_HALF_DIM)


def compute_peak(hw: HardwareConfig, dtype: str) -> float:
    """FLOP/s the matmuls of ``dtype`` run at: ``peak_tflops_fp32`` for fp32 where the preset
    gives it (A100: 19.5, H100 SXM: 67 TFLOP/s, NVIDIA datasheets: torch's fp32 matmuls use no
    TF32 by default), ``peak_tflops_fp8`` for fp8 (H100 SXM: 1979), else ``peak_tflops``; 0 when
    unknown."""
    tflops = hw.peak_tflops_fp32 if dtype == "fp32" and hw.peak_tflops_fp32 else hw.peak_tflops
    if dtype == "fp8":
        tflops = hw.peak_tflops_fp8
    return (tflops or 0) * 1e12


def layer_costs(spec: RunSpec, assume: Assumptions) -> dict[str, float]:
    """Seconds per micro-batch of one layer and of the logits, forward and backward (the
    backward includes the recomputed forward): matmul (``mm_*``: the attention scores over the whole
    s x s square at the matmul rate, docs/accuracy/fit_history.md) and memory-bound (``mem_*``: passes
    over the layer's activations, its MLP at the width a token goes through, experts included:
    :func:`xpar.estimate.memory.activations.token_ffn`). Under FP8 the attention core at the BF16 rate
    (:func:`attention_core_delay`). Where the hardware has the kernel figures, the kernel model's
    (:func:`xpar.estimate.compute.kernel_costs.kernel_layer_costs`) instead."""
    if kernel_priced(spec.hardware, spec.train.dtype):
        return kernel_layer_costs(spec, assume)
    cfg, lay, hw = spec.model, spec.layout, spec.hardware
    s, b, h, t = spec.seq_len, spec.train.micro_batch_size, cfg.hidden, spec.tp
    e = BYTES[spec.train.dtype]
    peak, hbm = compute_peak(hw, spec.train.dtype), (hw.hbm_tb_per_s or 0) * 1e12
    rate = peak * matmul_efficiency(hw, h / t) * (hw.fp8_matmul_efficiency if spec.train.dtype == "fp8" else 1.0)
    ran = tp_compute_model(spec)  # K/V heads replicated over tp: each rank's K/V projection (xpar.config.attention)
    fwd = fl.forward_flops_per_token(ran, s)  # Narayanan et al. convention
    layer = (fwd["matmul"] + fwd["attention"]) / cfg.n_layers
    policy, share = spec_recompute(spec, assume.selective_recompute, assume.recompute_layer_fraction)
    extra = share * extra_forward_flops_per_layer(ran, s, policy, early_stop=assume.checkpoint_early_stop)  # per block
    act = dict(kv=h, ffn=token_ffn(cfg), swiglu=cfg.activation == "swiglu", dropout=assume.dropout,
               flash=assume.flash_attention, elem=e, block=cfg.block)
    layer_act = layer_activation_bytes(s, b, h, cfg.n_heads, t, lay.sequence_parallel, "none", **act)
    logits_act = s * b * (2 * e * h / (t if lay.sequence_parallel else 1) + (4 + e) * cfg.vocab_size / t)
    pf = assume.passes_forward
    pb = assume.passes_backward + (pf * share if policy == "full" else 0)  # element-wise reruns: full only
    tok = s * b / t
    mm = (lambda flops: tok * flops / rate) if rate else (lambda flops: 0.0)
    mem = (lambda nbytes: nbytes / hbm) if hbm else (lambda nbytes: 0.0)
    core_f, core_b = attention_core_delay(spec, fwd["attention"] / cfg.n_layers, share * POLICIES[policy].attention)
    return {"mm_f": mm(layer) + tok * core_f, "mm_b": mm(2 * layer + extra) + tok * core_b, "mem_f": mem(pf * layer_act),
            "mem_b": mem(pb * layer_act), "logits_mm_f": mm(fwd["logits"]), "logits_mm_b": mm(2 * fwd["logits"]),
            "logits_mem_f": mem(pf * logits_act), "logits_mem_b": mem(assume.passes_backward * logits_act),
            "ovh_f": 0.0, "ovh_b": 0.0}


def attention_core_delay(spec: RunSpec, core: float, rerun: float) -> tuple[float, float]:
    """Seconds per token (forward, backward with the rerun ``rerun`` x forward) that one layer's
    attention core (QK^T and PV, ``core`` forward FLOPs per token) adds to its price at the
    matmul rate under FP8: Transformer Engine's FP8 recipes (DotProductAttention) and torchao's
    float8 training convert only the linear layers, so the core runs at the BF16 rate (peak_tflops
    x :func:`matmul_efficiency`, without fp8_matmul_efficiency). (0, 0) for other dtypes, or
    without the peaks."""
    hw = spec.hardware
    if spec.train.dtype != "fp8" or not hw.peak_tflops_fp8 or not hw.peak_tflops:
        return 0.0, 0.0
    eff = matmul_efficiency(hw, spec.model.hidden / spec.tp)
    delay = core / (hw.peak_tflops * 1e12 * eff) - core / (hw.peak_tflops_fp8 * 1e12 * eff * hw.fp8_matmul_efficiency)
    return delay, (2 + rerun) * delay


def tp_times(spec: RunSpec, early_stop: bool = False) -> dict[str, float]:
    """Seconds of the tp collectives of one layer per micro-batch, forward (``f``) and backward
    with the recomputed forward (``b``; ``early_stop``: :func:`tp_rerun`), and of one embedding/output end (``end``): 2 all-reduces
    of b s h elements each way (all-gather + reduce-scatter with sequence parallelism),
    Korthikanti et al. 2022 Sec. 4.2.2 (xpar.estimate.comm.volume.tp_layer_bytes). ``b_async``: the part
    of ``b`` issued by the backward of the two column-parallel linears (QKV, MLP up): their input
    gradients' all-reduce (reduce-scatter with sequence parallelism), which Megatron-LM runs
    behind their weight-gradient GEMMs (``framework.tp_async_backward``). ``cross``: 1.0 where the tp group
    spans nodes (its overlap is then ``framework.tp_overlap_across_nodes``: :func:`tp_overlap_share`), else 0.0.
    A parallel block (``model.block``) has fewer: one output-side reduction, an input-side collective per
    distinct input (xpar.config.block); the forward collectives a recompute reruns scale alike."""
    t = spec.tp
    if t == 1:
        return {"f": 0.0, "b": 0.0, "end": 0.0, "b_async": 0.0, "cross": 0.0}
    hw, e = spec.hardware, BYTES[spec.train.dtype]
    size = spec.train.micro_batch_size * spec.seq_len * spec.model.hidden * e
    g = group_of(hw, t, 1)
    n_in, n_out = block_collectives(spec.model.block)
    if spec.layout.sequence_parallel:
        dgrad, gather = collective_time(hw, "reduce_scatter", size, g), collective_time(hw, "allgather", size, g)
        one, f, b = gather + dgrad, n_in * gather + n_out * dgrad, n_in * dgrad + n_out * gather
    else:
        one = dgrad = collective_time(hw, "allreduce", size, g)
        f, b = n_out * one, n_in * one
    rerun = tp_rerun(spec, early_stop) * forward_share(spec.model.block, spec.layout.sequence_parallel) * one
    kv_f, kv_b = kv_replica_times(spec, early_stop)
    return {"f": f + kv_f, "b": b + rerun + kv_b, "end": one, "b_async": n_in * dgrad, "cross": float(g.nodes > 1)}


def kv_replica_times(spec: RunSpec, early_stop: bool = False) -> tuple[float, float]:
    """Seconds (forward, backward with the recomputed forward) of one layer's tp collectives on the K/V output
    where each tp rank keeps its K/V head whole (xpar.config.attention.kv_replica_elements), per micro-batch:
    BigCode's Megatron-LM (megatron/model/transformer.py ParallelAttention.forward) all-reduces the output's gradient
    in backward (copy_to_tensor_model_parallel_region); with sequence parallelism it projects the sequence shard,
    all-gathers the output in forward and reduce-scatters its gradient in backward (the all-gather rerun where the
    recompute policy reruns wk). (0, 0) otherwise."""
    output, _ = kv_replica_elements(spec)
    if not output:
        return 0.0, 0.0
    hw, size = spec.hardware, output * BYTES[spec.train.dtype]
    g = group_of(hw, spec.tp, 1)
    if not spec.layout.sequence_parallel:
        return 0.0, collective_time(hw, "allreduce", size, g)
    policy, share = spec_recompute(spec)
    gather = collective_time(hw, "allgather", size, g)
    rerun = share * ("wk" in reruns(POLICIES[policy], early_stop))
    return gather, collective_time(hw, "reduce_scatter", size, g) + rerun * gather


def kv_grad_reduce_time(spec: RunSpec, grad_bytes: int) -> float:
    """Seconds per step of one layer's all-reduce over tp of the replicated K/V projection's weight and bias
    gradients (``grad_bytes`` per element) where it runs on the sequence shard, each rank's gradient covering its
    tokens only: BigCode's Megatron-LM megatron/optimizer/optimizer.py allreduce_key_value_grads (multi-query
    attention with sequence parallelism, before the dp reduction). 0 otherwise."""
    _, weights = kv_replica_elements(spec)
    if not (weights and spec.layout.sequence_parallel):
        return 0.0
    return collective_time(spec.hardware, "allreduce", weights * grad_bytes, group_of(spec.hardware, spec.tp, 1))


def tp_rerun(spec: RunSpec, early_stop: bool = False) -> float:
    """tp collectives of one block's forward that its backward reruns, on average over the
    blocks (xpar.config.remat.tp_reruns times the share recomputed): 2 with full recompute, 1 (1.5
    with sequence parallelism) where the checkpoint stops early (Assumptions.checkpoint_early_stop)."""
    policy, share = spec_recompute(spec)
    return tp_reruns(POLICIES[policy], early_stop, spec.layout.sequence_parallel) * share


def pp_send_time(spec: RunSpec, assume: Assumptions) -> float:
    """Seconds of one pipeline send (b s h elements, /t with sequence parallelism or
    scatter/gather), a point-to-point transfer across nodes when tp x dp fills a node."""
    sp = spec.layout.sequence_parallel or assume.scatter_gather
    nbytes = spec.train.micro_batch_size * spec.seq_len * spec.model.hidden * BYTES[spec.train.dtype]
    dpn = int(spec.hardware.devices_per_node) if str(spec.hardware.devices_per_node).isdigit() else 1
    return p2p_time(spec.hardware, nbytes / (spec.tp if sp else 1), spec.tp * spec.dp >= dpn)


def pp_send_latency(spec: RunSpec) -> float:
    """Seconds of a pipeline send's fixed part (the time of a 1-byte send between the same stages as
    :func:`pp_send_time`): what an overlapped send still costs, issued once per chunk boundary."""
    dpn = int(spec.hardware.devices_per_node) if str(spec.hardware.devices_per_node).isdigit() else 1
    return p2p_time(spec.hardware, 1.0, spec.tp * spec.dp >= dpn)


def tp_overlap_share(assume: Assumptions, cross: Any) -> Any:
    """Share of tp communication hidden: ``tp_overlap`` inside a node, ``tp_overlap_across_nodes`` where the
    tp group spans nodes (``cross`` 1.0; a float or an array over layouts)."""
    return assume.tp_overlap + (assume.tp_overlap_across_nodes - assume.tp_overlap) * cross


def pp_overlap_of(assume: Assumptions, schedule: str) -> float:
    """Share of pipeline send time the framework hides under ``schedule``: ``pp_overlap`` where
    ``pp_overlap_schedules`` is null or lists it, else 0."""
    listed = assume.pp_overlap_schedules
    return assume.pp_overlap if listed is None or schedule in listed else 0.0


def ep_a2a_overlap_of(assume: Assumptions, schedule: str, pp: int) -> float:
    """Share of the MoE all-to-alls the framework hides under ``schedule`` at ``pp`` stages: ``ep_a2a_overlap``
    where ``ep_a2a_overlap_schedules`` is null, or lists the schedule and pp > 1; else 0."""
    listed = assume.ep_a2a_overlap_schedules
    return assume.ep_a2a_overlap if listed is None or (pp > 1 and schedule in listed) else 0.0


def pp_exposed(issued: Any, latency: Any, overlap: Any) -> Any:
    """Exposed pipeline send seconds: ``overlap`` of the transfer hidden, never the sends' fixed part
    (``latency``, summed over the sends: each extra model chunk per rank adds a send/recv pair per
    micro-batch, issued and waited on however it overlaps). Floats or arrays over layouts."""
    return issued * (1 - overlap) + latency * overlap


def rank_compute(c: dict, tp: dict, n: Any, first: Any, last: Any, assume: Assumptions) -> dict:
    """Seconds per micro-batch of a pipeline rank holding ``n`` blocks (and the first / last
    stage's ends when ``first`` / ``last``): ``matmul``, ``memory_bound``, ``tp_comm``
    (exposed), ``tp_issued``, and per FSDP unit ``unit_f``/``unit_b`` (a block forward /
    backward with its share of exposed tp time) and ``root_f``/``root_b`` (the logits).
    ``c``: :func:`layer_costs`; ``tp``: :func:`tp_times`. Every value a float, or a numpy
    array over layouts (xpar.estimate.columns.step_time): the same arithmetic."""
    mm_f, mm_b = n * c["mm_f"], n * c["mm_b"]
    tp_f = n * tp["f"] + tp["end"] * first
    tp_b = n * tp["b"] + tp["end"] * last
    share = tp_overlap_share(assume, tp.get("cross", 0.0))
    hidden = vmax(share * (tp_f + tp_b), n * tp.get("b_async", 0.0) * assume.tp_async_backward)
    tp_exposed = tp_f + tp_b - vmin(hidden, mm_f + mm_b)
    lmm_f, lmm_b, lmem_f, lmem_b = (c[k] * last for k in ("logits_mm_f", "logits_mm_b", "logits_mem_f",
                                                          "logits_mem_b"))
    tp_all = vmax(tp["f"] + tp["b"], 1e-30)
    return {"matmul": mm_f + mm_b + lmm_f + lmm_b, "memory_bound": n * (c["mem_f"] + c["mem_b"]) + lmem_f + lmem_b,
            "tp_comm": tp_exposed, "tp_issued": tp_f + tp_b, "overhead": n * (c["ovh_f"] + c["ovh_b"]),
            "unit_f": c["mm_f"] + c["mem_f"] + c["ovh_f"] + tp_exposed * tp["f"] / tp_all,
            "unit_b": c["mm_b"] + c["mem_b"] + c["ovh_b"] + tp_exposed * tp["b"] / tp_all,
            "root_f": lmm_f + lmem_f, "root_b": lmm_b + lmem_b}


def microbatch_time(x: dict) -> Any:
    """Seconds of one micro-batch on a rank: the sum of its terms (matmul, memory_bound,
    tp_comm, pp_comm, dp_comm exposed per micro-batch, host: xpar.estimate.compute.host; at ep > 1 its
    exposed all-to-alls and router imbalance: xpar.estimate.columns.ep_slots; with activation offload its exposed
    copies, ``act_offload``: xpar.estimate.columns.act_offload)."""
    return sum(x.get(k, 0.0) for k in ("matmul", "memory_bound", "tp_comm", "pp_comm", "dp_comm", "host", "ep_comm",
                                       "ep_imbalance", "act_offload"))


def optimizer_time(optimizer_bytes: Any, dtype: str, hbm_tb_per_s: Optional[float],
                   bytes_per_element: Optional[float] = None, ns_per_element: Optional[float] = None,
                   state_width: Optional[int] = None, explicit: bool = False) -> Any:
    """Seconds of the optimizer step for the elements the device's optimizer holds
    (``optimizer_bytes`` / ``state_width``, the bytes per element the framework keeps:
    :func:`xpar.estimate.memory.model_states.state_widths`; default the width of :data:`STATE_BYTES`). An unfused AdamW
    (``bytes_per_element`` given, Assumptions.adamw_bytes_per_element: what xpar executes) takes
    ``ns_per_element`` each where the hardware has that measured figure
    (HardwareConfig.optimizer_ns_per_element, ``xpar calibrate``), else moves ``bytes_per_element``
    over HBM; a fused AdamW (``bytes_per_element`` None) makes 2 passes over the params, grads and
    optimizer states at the ZeRO paper's widths, the states at ``state_width`` where a profile sets
    ``framework.optimizer_bytes`` (``explicit``: bf16 moments read and write half the bytes). 0 without
    an HBM figure or a measured rate."""
    bp, bg, bo = STATE_BYTES[dtype]
    elements = optimizer_bytes / (state_width or bo)
    if bytes_per_element is not None and ns_per_element:
        return elements * ns_per_element * 1e-9
    hbm = (hbm_tb_per_s or 0) * 1e12
    states = state_width if explicit and state_width else bo
    per_element = 2 * (bp + bg + states) if bytes_per_element is None else bytes_per_element
    return elements * per_element / hbm if hbm else 0.0


def gradient_time(held_bytes: Any, reduced_bytes: Any, m: Any, pp: Any, clip: bool,
                  hbm_tb_per_s: Optional[float], accumulation_passes: float, counted: bool = True) -> Any:
    """Seconds per step of the memory passes over a device's gradients outside the GEMMs, at the
    HBM (on a CPU: copy) bandwidth: accumulation of the m micro-batches into the gradients held
    (``held_bytes``, the memory model's ``grads``; ``accumulation_passes`` x (m - 1):
    Assumptions.grad_accumulation_passes); then, over the gradients after the dp reduction
    (``reduced_bytes``: :func:`reduced_grad_bytes`), torch's division by m under pp (2 passes:
    PipelineStage.scale_grads, torch 2.13) and the global-norm clip (xpar.parallel.optim.clip_grads_):
    the norm reads them (1 pass, always: the norm is logged), the scaling reads and writes them
    when ``clip`` (train.max_grad_norm set; counted as if the norm exceeded it, as it does early in
    training). Counted in the optimizer term, though accumulation runs in the backward. 0
    without an HBM figure, or unless ``counted`` (Assumptions.gradient_passes: on the CPU).
    Floats or numpy arrays over layouts."""
    hbm = (hbm_tb_per_s or 0) * 1e12
    if not (hbm and counted):
        return 0.0 * held_bytes
    after = 1 + (2 if clip else 0) + 2 * ((pp > 1) & (m > 1))
    return (held_bytes * accumulation_passes * (m - 1) + reduced_bytes * after) / hbm


def reduced_grad_bytes(held_bytes: Any, dp: Any, pp: Any, zero_stage: Any) -> Any:
    """Gradient bytes a device holds after the dp reduction: the held ones (``held_bytes``), but
    1/dp of them under pp with ZeRO-2/3, whose reduce-scatter waits for the last backward
    (xpar.estimate.memory.per_device.grads_deferred: the memory model counts the whole stage's). Floats or
    numpy arrays over layouts."""
    return held_bytes / (1 + (dp - 1) * ((pp > 1) & (zero_stage >= 2)))


def optimizer_term(spec: RunSpec, assume: Assumptions, optimizer_bytes: Any, grad_bytes: Any, dp: Any, pp: Any,
                   zero_stage: Any, m: Any) -> Any:
    """Seconds of the optimizer term before any offload: :func:`optimizer_time` of the device's
    optimizer states and :func:`gradient_time` of its gradients (``grad_bytes``: the memory model's
    ``grads``), for ``spec``'s hardware, dtype and clip under ``assume``. The scalar estimate and
    the planner (xpar.estimate.columns.step_time, numpy arrays over layouts for every argument but the first two)
    both price it here."""
    hw = spec.hardware
    return (optimizer_time(optimizer_bytes, spec.train.dtype, hw.hbm_tb_per_s, assume.adamw_bytes_per_element,
                           hw.optimizer_ns_per_element, state_widths(spec, assume)[2], bool(assume.optimizer_bytes))
            + gradient_time(grad_bytes, reduced_grad_bytes(grad_bytes, dp, pp, zero_stage), m, pp,
                            spec.train.max_grad_norm is not None, hw.hbm_tb_per_s, assume.grad_accumulation_passes,
                            assume.gradient_passes))


def step_time(slow: dict, m: Any, beta: Any, fill_mb: Any, t_opt: Any) -> tuple[Any, dict]:
    """(seconds per step, breakdown by :data:`TIME_TERMS`) from the slowest rank's terms
    ``slow`` (xpar.estimate.columns.step_time.Step.slowest, with ``dp_end``: its dp communication left at the end,
    ``tp_step``, where present: its tp reductions once a step, :func:`kv_grad_reduce_time`),
    m micro-batches, bubble ratio ``beta``, ``fill_mb`` (:func:`fill_time`: the mean micro-batch
    time of the other ranks) and the optimizer's seconds (module docstring); at ep > 1 ``slow``'s exposed
    all-to-alls and imbalance per micro-batch (``ep_comm``, ``ep_imbalance``: xpar.estimate.columns.ep_slots) are
    terms of their own. Floats or numpy arrays over layouts."""
    mb_slow, tp_step = microbatch_time(slow), slow.get("tp_step", 0.0)
    pipe = m * mb_slow + beta / (1 - beta) * m * fill_mb
    breakdown = {"matmul": m * slow["matmul"], "memory_bound": m * slow["memory_bound"],
                 "tp_comm": m * slow["tp_comm"] + tp_step,
                 "pp_comm": m * slow["pp_comm"], "bubble": pipe - m * mb_slow,
                 "dp_comm_exposed": m * slow["dp_comm"] + slow["dp_end"], "optimizer": t_opt,
                 "host_overhead": m * slow["host"] + slow["host_step"]}
    breakdown.update({k: m * slow[k] for k in ("ep_comm", "ep_imbalance", "act_offload") if k in slow})  # ep > 1; offload
    return pipe + slow["dp_end"] + tp_step + t_opt + slow["host_step"], breakdown


def fill_time(total_mb: Any, slow_mb: Any, pp: Any) -> Any:
    """Seconds per micro-batch that a pipeline's fill and drain take per stage: the mean
    micro-batch time of the ranks other than the slowest, from the sum over all ``pp`` ranks
    (``total_mb``) and the slowest's (``slow_mb``); the slowest's own with one rank (no bubble
    then). Floats or numpy arrays over layouts (module docstring)."""
    if isinstance(pp, np.ndarray):
        return np.where(pp > 1, (total_mb - slow_mb) / np.maximum(pp - 1, 1), slow_mb)
    return (total_mb - slow_mb) / (pp - 1) if pp > 1 else slow_mb


def _per(x: Any, time: Any) -> Any:
    """x / time, 0 where time is 0 (floats or arrays)."""
    if not isinstance(time, np.ndarray):
        return x / time if time else 0.0
    return np.divide(x, time, out=np.zeros(np.broadcast(x, time).shape), where=time != 0)


def rates(time: Any, tokens: Any, world: Any, model_flops: Any, hw_flops: Any, peak_tflops: Optional[float]) -> dict:
    """Throughput of a step of ``time`` seconds with ``tokens`` tokens on ``world`` devices and
    ``model_flops``/``hw_flops`` FLOPs per step (all devices): tokens_per_s(_per_device),
    tflops_per_device, hw_tflops_per_device (1e12 FLOP/s), mfu, hfu (fractions of
    ``peak_tflops``, the dense peak of the training dtype: :func:`compute_peak`; 0 without a
    peak). Floats or numpy arrays over layouts."""
    peak = (peak_tflops or 0) * 1e12
    tf = _per(model_flops, time) / world / 1e12
    hwtf = _per(hw_flops, time) / world / 1e12
    return {"tokens_per_s": _per(tokens, time), "tokens_per_s_per_device": _per(tokens, time) / world,
            "tflops_per_device": tf, "hw_tflops_per_device": hwtf,
            "mfu": tf * 1e12 / peak if peak else 0.0 * tf, "hfu": hwtf * 1e12 / peak if peak else 0.0 * hwtf}


def step_rates(spec: RunSpec, seconds: float) -> dict[str, float]:
    """:func:`rates` of one step of ``spec`` that took ``seconds`` (estimated or measured): its tokens,
    world size and the training dtype's dense peak, with the step's ``model_flops_per_step`` and
    ``hardware_flops_per_step`` (all devices; xpar.estimate.compute.flops: no recompute, recompute counted).
    Floats; the one computation of a step's throughput, TFLOP/s per device, MFU and HFU."""
    tokens = spec.tokens_per_step
    model_f = fl.model_flops_per_token(spec.model, spec.seq_len) * tokens
    hw_f = fl.spec_hardware_flops_per_token(spec) * tokens
    r = rates(seconds, tokens, spec.world_size, model_f, hw_f, compute_peak(spec.hardware, spec.train.dtype) / 1e12)
    return {**{k: float(v) for k, v in r.items()}, "model_flops_per_step": model_f, "hardware_flops_per_step": hw_f}


def waits_unstretched(spec: RunSpec, world: int) -> RunSpec:
    """``spec`` with ``hardware.sync_wait_us`` divided by the stretch of ``world`` workers on the
    CPU's cores (xpar.estimate.compute.host.oversubscription), so that the stretched step pays each wait
    once: a worker waiting for its peers holds no core (docs/accuracy/fit_history.md)."""
    hw = spec.hardware
    stretch = oversubscription(hw.cpu_cores, world, spec.train.threads_per_worker or 1)
    return spec if not hw.sync_wait_us or stretch == 1 else with_hardware(spec, sync_wait_us=hw.sync_wait_us / stretch)


def with_hardware(spec: RunSpec, **changes) -> RunSpec:
    """``spec`` with hardware fields changed (what-if studies)."""
    return replace(spec, hardware=replace(spec.hardware, **changes))
