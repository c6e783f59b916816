"""A layer's compute seconds per micro-batch from its kernels (issue 42): the kernel model
(xpar.estimate.compute.kernel_block) in the terms the cost model's orchestration reads.

On hardware with the kernel figures (:func:`kernel_priced`: a GPU preset with ``sm_count``,
``gemm_efficiency`` and the attention fractions) :func:`xpar.estimate.cost.layer_costs` returns
:func:`kernel_layer_costs`; elsewhere (a CPU, a preset without them) FLOPs over one efficiency.
Each kernel runs at ``hardware.sustained_efficiency`` of its isolated rate (the one constant fitted
per GPU family on published runs: clocks under a training step's power draw, SMs lent to overlapped
communication kernels; docs/accuracy/fit_history.md). Units: seconds; a layer is the mean over the
blocks of each kind (dense or MoE, full or sliding-window attention: :func:`block_kinds`).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from xpar.config.attention import attention_projection_flops, mla_up_projection_flops
from xpar.config.remat import POLICIES, reruns, spec_recompute
from xpar.config.spec import RunSpec
from xpar.estimate.compute.kernel_block import BlockShape, BlockTerms, block_times, logits_times, shape_of
from xpar.estimate.compute.kernels import Device, device_of

FP8_LOGITS_DTYPE = "bf16"
"""The output layer's GEMM dtype under FP8 recipes (Transformer Engine and torchao keep it in BF16)."""
ATTENTION_PROJECTIONS = ("wq", "wk", "wv", "wo")
MLP_PROJECTIONS = ("w1", "w3", "w2")


def kernel_priced(hw, dtype: str) -> bool:
    """Whether ``hw`` (a HardwareConfig) has the kernel model's figures for GEMMs of ``dtype``."""
    need = (hw.sm_count, hw.gemm_efficiency, hw.attention_efficiency, hw.attention_bwd_efficiency, hw.peak_tflops)
    if hw.device == "cpu" or any(x is None for x in need):
        return False
    if dtype == "fp32":
        return bool(hw.peak_tflops_fp32)
    return dtype != "fp8" or (hw.gemm_efficiency_fp8 is not None and hw.peak_tflops_fp8 is not None)


def fitted_field(hw, dtype: str) -> str:
    """The hardware field fitted per GPU family on published runs: ``sustained_efficiency`` where the
    kernel model prices compute (:func:`kernel_priced`), else ``matmul_efficiency``."""
    return "sustained_efficiency" if kernel_priced(hw, dtype) else "matmul_efficiency"


def training_device(hw, kernel: str = "fa3") -> Device:
    """The :class:`~xpar.estimate.compute.kernels.Device` of ``hw`` at ``hw.sustained_efficiency`` of every
    isolated compute rate (GEMMs per dtype, attention forward and backward), the attention at the fractions of
    ``kernel`` (framework.attention_kernel: :func:`attention_fractions`).

    Raises:
        ValueError: an unknown ``kernel``."""
    d, s = device_of(hw), hw.sustained_efficiency
    return replace(d, gemm_fraction={k: v * s for k, v in d.gemm_fraction.items()},
                   attention_fraction=tuple(x * s for x in attention_fractions(hw, kernel)))


ATTENTION_KERNELS = {"fa3": "", "cudnn": "", "cudnn_2024": "_cudnn_2024", "fa2": "_fa2", "sdpa": "_fa2"}
"""framework.attention_kernel -> the suffix of its hardware fields (attention_efficiency<suffix>,
attention_bwd_efficiency<suffix>; '': the device's own): cuDNN from 9.5 at the device's own (xpar.config.profile),
2024's cuDNN at its own; 'sdpa' is torch SDPA, whose flash backend (FlashAttention-2) it runs first."""


def attention_fractions(hw, kernel: str) -> tuple[float, float]:
    """(forward, backward) fraction of the BF16 peak of the attention core on ``hw`` for ``kernel``
    (:data:`ATTENTION_KERNELS`): the preset's figures for that kernel, each the device's own (attention_efficiency,
    attention_bwd_efficiency) where None.

    Raises:
        ValueError: an unknown ``kernel``."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"framework.attention_kernel={kernel!r} is not one of {', '.join(ATTENTION_KERNELS)}")
    own, sfx = (hw.attention_efficiency, hw.attention_bwd_efficiency), ATTENTION_KERNELS[kernel]
    named = (getattr(hw, f"attention_efficiency{sfx}"), getattr(hw, f"attention_bwd_efficiency{sfx}"))
    return tuple(own[i] if x is None else x for i, x in enumerate(named))


def rerun_shares(policy: str, early_stop: bool, cfg=None) -> dict[str, float]:
    """Of a block's forward, what the backward of ``policy`` runs again: ``projections`` (of the
    attention's wq..wo: the share of the four rerun, each weighed alike; MLA's up-projections, 'mla_up', at
    their share of the four's FLOPs in ``cfg``: xpar.config.attention.mla_up_projection_flops), ``mlp`` (of
    w1, w3, w2 alike, experts included), ``attention`` (the core: 0 or 1), ``memory`` (element-wise
    passes and launches: full recompute only). xpar.config.remat.POLICIES."""
    p = POLICIES[policy]
    again = reruns(p, early_stop)
    projections = sum(k in again for k in ATTENTION_PROJECTIONS) / len(ATTENTION_PROJECTIONS)
    if "mla_up" in again and cfg is not None:
        projections += mla_up_projection_flops(cfg) / sum(attention_projection_flops(cfg).values())
    return {"projections": projections, "mlp": _mlp_share(again), "attention": float(p.attention),
            "memory": float(policy == "full")}


def _mlp_share(again: tuple) -> float:
    """Share of the MLP's GEMM time rerun: w1 and w3 (the gate) as one up projection of twice w2's
    width under SwiGLU, so w1, w3 and w2 weigh 1/3 each."""
    return sum(k in again for k in MLP_PROJECTIONS) / len(MLP_PROJECTIONS)


def _rerun(fwd: BlockTerms, share: dict) -> dict:
    """Seconds of a block's forward that its backward reruns (:func:`rerun_shares`): compute, memory, overhead."""
    mlp = fwd.gemm - fwd.projections + fwd.experts
    compute = share["projections"] * fwd.projections + share["mlp"] * mlp + share["attention"] * fwd.attention
    return {"mm": compute, "mem": share["memory"] * fwd.memory, "ovh": share["memory"] * fwd.overhead}


def elementwise_passes(train, assume) -> float:
    """Times the fused traffic a block's memory-bound kernels move (norms, residual adds, RoPE, activation, FP8
    amax and casts, MoE routing: xpar.estimate.compute.kernel_block), for ``train`` (a TrainConfig) under a
    framework's ``assume``: its ``elementwise_passes`` (eager PyTorch: each op its own kernel,
    docs/concepts/kernels.md), or 1 where ``train.compile``. TorchInductor fuses chains of pointwise ops with
    the reduction they feed or follow into one generated kernel that reads its inputs once and writes its
    outputs once (torch/_inductor/scheduler.py, Scheduler.fuse_nodes / can_fuse: vertical and horizontal
    fusion; Ansel et al., "PyTorch 2", ASPLOS 2024, Sec. 5), the traffic of a fused framework's kernels: RMSNorm
    with its fp32 upcast one read and one write, SiLU x up one kernel, RoPE's complex views one. torchao's
    tensorwise Float8 under compile is an amax reduction, then one scale-and-cast kernel (torchao
    torchao/float8/README.md: "enable torch.compile to generate fused kernels for float8 scaling and casting"),
    the two reads and one FP8 write of the ``current`` recipe (xpar.estimate.compute.fp8_recipes). Not
    priced: a residual add fused with the norm that reads its sum (one read of the sum saved); each block is
    compiled alone (torchtitan models/llama3/infra/parallelize.py apply_compile), so nothing fuses across
    blocks. Unitless, >= 1."""
    return 1.0 if train.compile else assume.elementwise_passes


def _block_costs(base: RunSpec, assume, sh: BlockShape, device: Device, rows: dict) -> dict:
    """mm/mem/ovh forward and backward (recompute included) of one block of shape ``sh`` per row."""
    kw = dict(tp=rows["tp"], ep=base.layout.ep, dtype=base.train.dtype, host_us_per_kernel=assume.host_op_us,
              sequence_parallel=rows["sp"], flash=assume.flash_attention, dropout=assume.dropout,
              dispatcher=assume.ep_dispatcher, expert_call_us=assume.expert_gemm_call_us,
              kv_over_tp=base.framework.kv_heads_over_tp, fp8_recipe=base.train.fp8_recipe,
              fp8_casts=assume.fp8_cast_kernels, window_kernel=assume.sliding_window_kernel,
              sinks=assume.sink_attention if base.model.attention_sinks else None, moe_scatter=assume.moe_scatter,
              expert_gemm_kernel=assume.expert_gemm_kernel, expert_bias_add=assume.expert_bias_add)
    fwd, bwd = (block_times(sh, rows["b"], base.seq_len, device, backward=x, **kw) for x in (False, True))
    passes = elementwise_passes(base.train, assume)  # not the atomic scatters: one aten kernel each, compiled or not
    fwd, bwd = (replace(x, memory=x.memory * passes + x.atomics, atomics=0.0 * x.atomics) for x in (fwd, bwd))
    again, share = _rerun(fwd, rows["rerun"]), rows["share"]
    return {"mm_f": fwd.gemm + fwd.experts + fwd.attention, "mem_f": fwd.memory, "ovh_f": fwd.overhead,
            "mm_b": bwd.gemm + bwd.experts + bwd.attention + share * again["mm"],
            "mem_b": bwd.memory + share * again["mem"], "ovh_b": bwd.overhead + share * again["ovh"]}


def block_kinds(cfg) -> dict[tuple, float]:
    """Share of the model's blocks by kind, {(MoE, local): share}: with experts or the dense MLP
    (``cfg.is_moe_layer``), sliding-window or full attention (``cfg.is_local_layer``). Shares sum to 1."""
    kinds = {}
    for i in range(cfg.n_layers):
        key = (cfg.is_moe_layer(i), cfg.is_local_layer(i))
        kinds[key] = kinds.get(key, 0.0) + 1.0 / cfg.n_layers
    return kinds


def kernel_layer_columns(base: RunSpec, assume, tp, b, sp, policies: list, shares) -> dict[str, np.ndarray]:
    """:func:`kernel_layer_costs` of many layouts of ``base``'s model, hardware and dtype at once: per
    row its tp, micro-batch size ``b`` (a float under cp), sequence parallelism ``sp``, recompute policy
    (a resolved name, :func:`xpar.config.remat.spec_recompute`) and the share of blocks it recomputes.
    Arrays of one length; the result's values are float64 arrays of it."""
    cfg, device = base.model, training_device(base.hardware, assume.attention_kernel)
    per = [rerun_shares(p, assume.checkpoint_early_stop, cfg) for p in policies]
    rows = {"tp": np.asarray(tp, dtype=float), "b": np.asarray(b, dtype=float), "sp": np.asarray(sp, dtype=bool),
            "share": np.asarray(shares, dtype=float),
            "rerun": {k: np.array([x[k] for x in per], dtype=float) for k in per[0]}}
    parts = [(w, _block_costs(base, assume, shape_of(cfg, moe=moe, local=local), device, rows))
             for (moe, local), w in block_kinds(cfg).items()]
    out = {k: sum(w * x[k] for w, x in parts) for k in parts[0][1]}
    tokens = rows["b"] * base.seq_len
    dtype = FP8_LOGITS_DTYPE if base.train.dtype == "fp8" else base.train.dtype
    for name, backward in (("f", False), ("b", True)):
        out[f"logits_mm_{name}"], out[f"logits_mem_{name}"] = logits_times(
            tokens, cfg.hidden, cfg.vocab_size, device, rows["tp"], dtype, backward, assume.loss_kernel)
    shape = rows["tp"].shape
    return {k: np.broadcast_to(np.asarray(v, dtype=float), shape) for k, v in out.items()}


def kernel_layer_costs(spec: RunSpec, assume) -> dict[str, float]:
    """:func:`xpar.estimate.cost.layer_costs` from the kernels: seconds per micro-batch of the mean
    layer, ``mm_*`` (GEMMs, grouped experts, attention core), ``mem_*`` (element-wise, norm, routing
    passes), ``ovh_*`` (launch gaps or host issue time beyond the kernels), forward ``f`` and backward
    ``b`` (recomputed forward included), and the logits' GEMM and cross-entropy passes (framework.loss_kernel:
    kernel_block.LOSS_BYTES): the one-row case of :func:`kernel_layer_columns`.

    Raises:
        ValueError: the hardware lacks a kernel figure (:func:`kernel_priced` is False)."""
    policy, share = spec_recompute(spec, assume.selective_recompute, assume.recompute_layer_fraction)
    cols = kernel_layer_columns(spec, assume, [spec.tp], [spec.train.micro_batch_size],
                                [spec.layout.sequence_parallel], [policy], [share])
    return {k: float(v[0]) for k, v in cols.items()}
