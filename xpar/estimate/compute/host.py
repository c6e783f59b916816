"""Host time of a step: what the CPU spends issuing work, beside the work itself.

On a GPU the host runs ahead of the device (the GPU presets leave these figures at 0). On a CPU
the same thread issues and computes, so every operator's dispatch adds to the step. Figures per
machine, measured by ``xpar calibrate`` into the preset: ``hardware.op_overhead_us`` (per aten
operator, autograd included), ``dtensor_op_overhead_us`` (the extra of a DTensor operator),
``fsdp_unit_overhead_us`` (FSDP2's hooks per unit and micro-batch), ``tp_block_overhead_us``,
``tp_first_overhead_us``, ``tp_last_overhead_us`` (the extra under tensor parallelism).

Operator counts per block, stage end, DTensor linear, AdamW and clip step: counted with
``TorchDispatchMode`` on :mod:`xpar.models.transformer` (tests/calibrate/test_calibrate.py checks them; the
counts: docs/concepts/cost-model-derivations.md). Units: seconds. Floats, or numpy arrays over
layouts for ``n``, ``first`` and ``last``.
"""
from __future__ import annotations

from typing import Any

from xpar.config.remat import spec_recompute
from xpar.config.schema import ModelConfig
from xpar.config.spec import RunSpec
from xpar.estimate.comm.collectives import collective_time, group_of
from xpar.estimate.memory.model_states import tensor_counts
from xpar.estimate.comm.overlap import vmax

LINEAR_OPS = (4, 9)
"""Operators of one linear layer, forward and backward (transpose, matmul, views)."""
HOST_KEYS = ("f", "b", "first_f", "first_b", "last_f", "last_b", "unit", "tensor", "clip", "tensors_block",
             "tensors_first", "tensors_last")
"""Keys of :func:`host_costs`."""
STEP_OPS_PER_TENSOR = 9 + 3
"""Per parameter tensor and step: AdamW's single-tensor update (9) and the norm clip (3)."""


def block_ops(cfg: ModelConfig) -> tuple[int, int]:
    """(forward, backward) aten operators of one transformer block of ``cfg`` (module
    docstring; exact for every combination counted)."""
    rms, rope = cfg.norm == "rmsnorm", cfg.position == "rope"
    swiglu, gqa = cfg.activation == "swiglu", cfg.kv_heads < cfg.n_heads
    linears = 6 + swiglu
    f = 39 + 12 * rms + 45 * rope + 5 * swiglu + 8 * gqa  # rope: positions from Attention.positions (cp seam), one op more
    b = 75 + 32 * rms + 20 * rope + 12 * swiglu + 7 * gqa + (gqa and not rope)
    b += cfg.bias * (3 * linears + 2 * (not rms))
    return f, b


def end_ops(cfg: ModelConfig) -> dict[str, int]:
    """Aten operators of the first stage's embeddings and of the last stage's norm, logits and
    loss, forward and backward: ``first_f``, ``first_b``, ``last_f``, ``last_b``."""
    learned, rms = cfg.position == "learned", cfg.norm == "rmsnorm"
    return {"first_f": 4 if learned else 1, "first_b": 5 if learned else 1,
            "last_f": 16 if rms else 10, "last_b": 31 if rms else 15 + cfg.bias}


def host_costs(spec: RunSpec, layer_overhead_s: float = 0.0) -> dict[str, float]:
    """Host seconds of ``spec`` on its hardware (module docstring): per micro-batch one block
    forward ``f`` and backward ``b`` (the recomputed forward in, with full recompute; each with its
    share of the framework's ``layer_overhead_s`` per block and micro-batch, split as the block's
    matmuls: forward 1, backward 2, + 1 recomputed forward: Assumptions.layer_overhead_ms), the first
    stage's ends ``first_f``/``first_b``, the last stage's ``last_f``/``last_b``, FSDP2's hooks
    per unit ``unit`` (forward and backward, ZeRO-2/3); per step one parameter tensor's update
    and clip ``tensor`` and the clip's scalar all-reduces ``clip`` (:func:`clip_allreduce_time`);
    the parameter tensors of a block ``tensors_block``, of the first stage's ends
    ``tensors_first`` and of the last stage's ``tensors_last``. Host terms are 0 on hardware
    without the figures (GPU presets)."""
    hw, cfg = spec.hardware, spec.model
    op = (getattr(hw, "op_overhead_us", 0.0) or 0.0) * 1e-6
    dt = (getattr(hw, "dtensor_op_overhead_us", 0.0) or 0.0) * 1e-6
    f, b = block_ops(cfg)
    tp_f, tp_b = tp_split((getattr(hw, "tp_block_overhead_us", 0.0) or 0.0) * 1e-6
                          or (6 + (cfg.activation == "swiglu")) * sum(LINEAR_OPS) * dt) if spec.tp > 1 else (0.0, 0.0)
    block_f = f * op + tp_f
    policy, share = spec_recompute(spec)
    block_b = b * op + tp_b + (block_f * share if policy == "full" else 0.0)
    rerun = share if policy == "full" else 0.0
    block_f, block_b = block_f + layer_overhead_s / (3 + rerun), block_b + layer_overhead_s * (2 + rerun) / (3 + rerun)
    ends = {k: v * op for k, v in end_ops(cfg).items()}
    if spec.tp > 1:
        for end in ("first", "last"):
            extra_f, extra_b = tp_split((getattr(hw, f"tp_{end}_overhead_us", 0.0) or 0.0) * 1e-6)
            ends[f"{end}_f"] += extra_f
            ends[f"{end}_b"] += extra_b
    dtensor_params = spec.tp > 1 or spec.layout.zero_stage >= 2
    unit = (getattr(hw, "fsdp_unit_overhead_us", 0.0) or 0.0) * 1e-6 if spec.layout.zero_stage >= 2 else 0.0
    block, end = tensor_counts(cfg, spec.tp)
    head = 1 + (cfg.position == "learned")
    return {"f": block_f, "b": block_b, **ends, "unit": unit,
            "tensor": STEP_OPS_PER_TENSOR * (op + (dt if dtensor_params else 0.0)),
            "clip": clip_allreduce_time(spec) if op else 0.0,
            "tensors_block": block, "tensors_first": head, "tensors_last": end - head}


def tp_split(seconds: float) -> tuple[float, float]:
    """(forward, backward) shares of a tp host overhead, as a linear's operators split (4 : 9)."""
    return seconds * LINEAR_OPS[0] / sum(LINEAR_OPS), seconds * LINEAR_OPS[1] / sum(LINEAR_OPS)


def clip_allreduce_time(spec: RunSpec) -> float:
    """Seconds of the gradient-norm clip's scalar (8-byte) all-reduces per step
    (xpar.parallel.optim.global_grad_norm): over dp for FSDP2's sharded gradients (ZeRO-2/3), over tp
    for tp-split ones, over pp for the stages' sums."""
    hw = spec.hardware
    groups = [(spec.dp, spec.tp)] if spec.layout.zero_stage >= 2 else []
    groups += [(spec.tp, 1)] + [(spec.pp, spec.tp * spec.dp)]
    return sum(collective_time(hw, "allreduce", 8, group_of(hw, n, stride)) for n, stride in groups if n > 1)


def rank_host(h: dict, n: Any, first: Any, last: Any) -> Any:
    """Host seconds per micro-batch of a pipeline rank holding ``n`` blocks (and the first /
    last stage's ends when ``first`` / ``last``), FSDP2 units being its blocks and its root.
    ``h``: :func:`host_costs`."""
    ends = first * (h["first_f"] + h["first_b"]) + last * (h["last_f"] + h["last_b"])
    return n * (h["f"] + h["b"]) + ends + (n + 1) * h["unit"]


def host_step(h: dict, n: Any, first: Any, last: Any) -> Any:
    """Host seconds per step outside the micro-batches on a pipeline rank holding ``n`` blocks
    and the given ends: the optimizer update and the gradient clip of its parameter tensors,
    and the clip's all-reduces. ``h``: :func:`host_costs`."""
    tensors = n * h["tensors_block"] + first * h["tensors_first"] + last * h["tensors_last"]
    return tensors * h["tensor"] + h["clip"]


def oversubscription(cpu_cores: Any, world: Any, threads: int) -> Any:
    """Factor by which a step stretches when ``world`` workers of ``threads`` torch threads share
    ``cpu_cores`` cores (the OS scheduler gives each thread cores / threads of the time):
    max(1, world x threads / cores); 1 when ``cpu_cores`` is unknown (None, GPU presets)."""
    if not cpu_cores:
        return 1.0
    return vmax(1.0, world * threads / cpu_cores)
