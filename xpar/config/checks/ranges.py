"""The range of every numeric key of the schema (:mod:`xpar.config.schema`, :mod:`xpar.config.profile`):
degrees >= 1, counts >= 0, fractions in [0, 1], figures finite. :data:`RANGES` holds one
:class:`Range` per numeric field (int, float, their Optional, and the ``Any`` fields that take a
number or 'auto'); tests/config/test_input_checks.py walks the schema and fails on a field without one, so
a new key cannot be added unchecked. :func:`range_problems` gives one refusal line per key out of
range: the key, the value given, the valid range and a value that works. Cross-field rules (top k
<= E, warm-up < steps, degrees dividing each other) stay in the other checks; the static bound is here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from xpar.config.schema import XparConfig


@dataclass(frozen=True)
class Range:
    """Valid values of one key: ``lo``/``hi`` bounds (open where ``lo_open``/``hi_open``), whole
    numbers only (``integer``), null or 'auto' allowed, or a list of such values (``lists``);
    ``fix``: a value that works (default: the schema's default where it is in range); ``what``: the
    kind of value in words (default: 'an integer' or 'a finite number')."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    null: bool = False
    auto: bool = False
    lists: bool = False
    fix: object = None
    what: str = ""

    def holds(self, value) -> bool:
        """Whether ``value`` (from the composed config) is in range."""
        if value is None:
            return self.null
        if isinstance(value, str):
            return self.auto and value == "auto"
        if isinstance(value, (list, tuple)):
            return self.lists and len(value) > 0 and all(self.holds(v) for v in value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if not math.isfinite(value) or (self.integer and int(value) != value):
            return False
        low = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        high = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return low and high

    def text(self) -> str:
        """The range in words, e.g. 'an integer >= 1 or null', 'a finite number in (0, 1]'."""
        kind = self.what or ("an integer" if self.integer else "a finite number")
        if self.lo is not None and self.hi is not None:
            bounds = f" in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            bounds = f" {'>' if self.lo_open else '>='} {_num(self.lo)}"
        else:
            bounds = f" {'<' if self.hi_open else '<='} {_num(self.hi)}" if self.hi is not None else ""
        extra = [w for w, on in (("null", self.null), ("'auto'", self.auto), ("a list of them", self.lists)) if on]
        return kind + bounds + (", or " + " or ".join(extra) if extra else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _i(lo=None, hi=None, **kw) -> Range:
    return Range(lo=lo, hi=hi, integer=True, **kw)


DEGREE, COUNT = _i(1), _i(0)
POSITIVE, NON_NEGATIVE = Range(0, lo_open=True), Range(0)
FRACTION = Range(0, 1)
EFFICIENCY = Range(0, 1, lo_open=True)
HEADROOM = Range(0, 1, hi_open=True, what="a fraction of device memory")

RANGES: dict[str, Range] = {
    # model (cross-field rules in xpar.config.checks.config.check_model / check_experts)
    **{f"model.{k}": DEGREE for k in ("n_layers", "hidden", "n_heads", "ffn_hidden", "vocab_size", "seq_len",
                                      "moe_top_k")},
    "model.n_kv_heads": _i(1, null=True), "model.expert_ffn_hidden": _i(1, null=True),
    "model.rope_theta": POSITIVE, "model.norm_eps": POSITIVE,
    "model.n_experts": COUNT, "model.n_shared_experts": COUNT, "model.first_dense_layers": COUNT,
    "model.mtp_layers": COUNT,
    "model.moe_layer_freq": DEGREE,
    "model.capacity_factor": Range(0, lo_open=True, null=True), "model.moe_imbalance": Range(1),
    **{f"model.{k}": _i(1, null=True) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                 "v_head_dim")},
    "model.moe_router_groups": COUNT, "model.moe_router_group_topk": COUNT,
    "model.sliding_window": COUNT, "model.sliding_window_pattern": COUNT,
    # parallel (divisibility in xpar.config.checks.layout)
    **{f"parallel.{k}": DEGREE for k in ("tp", "pp", "cp", "ep")},
    **{f"parallel.{k}": _i(1, auto=True) for k in ("dp", "micro_batches", "virtual_stages")},
    "parallel.etp": _i(1, null=True), "parallel.zero_stage": _i(0, 3),
    "parallel.first_stage_layers": _i(0, null=True), "parallel.last_stage_layers": _i(0, null=True),
    "parallel.recompute_layers": _i(0, null=True), "parallel.activation_offload_layers": _i(0, null=True),
    "parallel.pipeline_micro_batches": _i(1, null=True),
    # hardware (null's meaning per hardware in xpar.config.checks.hardware)
    "hardware.devices_per_node": _i(1, auto=True, fix="auto"), "hardware.nodes": DEGREE,
    **{f"hardware.{k}": Range(0, lo_open=True, null=True)
       for k in ("device_memory_gb", "peak_tflops", "peak_tflops_fp8", "peak_tflops_fp32", "hbm_tb_per_s",
                 "intra_node_gb_per_s", "inter_node_gb_per_s", "optimizer_ns_per_element", "pcie_gb_per_s",
                 "host_memory_gb", "host_mem_gb_per_s", "deepep_nvl_gb_per_s")},
    "hardware.fp8_matmul_efficiency": EFFICIENCY, "hardware.matmul_efficiency": EFFICIENCY,
    "hardware.link_efficiency": EFFICIENCY,
    "hardware.nics_per_node": _i(1, null=True), "hardware.cpu_cores": _i(1, null=True),
    **{f"hardware.{k}": NON_NEGATIVE for k in ("collective_latency_us", "intra_node_latency_us", "inter_node_latency_us",
                                               "op_overhead_us", "dtensor_op_overhead_us", "fsdp_unit_overhead_us",
                                               "tp_block_overhead_us", "tp_first_overhead_us", "tp_last_overhead_us",
                                               "sync_wait_us", "framework_overhead_gb")},
    "hardware.p2p_latency_us": Range(0, null=True), "hardware.memory_headroom": HEADROOM,
    # train
    "train.steps": DEGREE, "train.warmup_steps": COUNT, "train.log_every": DEGREE,
    "train.global_batch_size": _i(1, auto=True), "train.micro_batch_size": DEGREE, "train.seq_len": _i(1, null=True),
    "train.lr": POSITIVE, "train.weight_decay": NON_NEGATIVE, "train.seed": _i(0, 2**63 - 1),
    "train.threads_per_worker": _i(1, null=True), "train.max_grad_norm": Range(0, lo_open=True, null=True),
    "train.lr_warmup_steps": COUNT, "train.min_lr_ratio": FRACTION,
    "train.checkpoint_every": _i(0, null=True), "train.checkpoint_keep": _i(1, null=True),
    # run, sweep
    "run.fail_rank": _i(0, null=True), "run.hang_rank": _i(0, null=True), "run.collective_timeout_s": POSITIVE, "run.heartbeat_timeout_s": POSITIVE,
    "sweep.max_failure_rate": FRACTION,
    # framework (choices and byte widths also in xpar.config.checks.framework)
    **{f"framework.{k}": NON_NEGATIVE for k in ("passes_forward", "passes_backward", "zero3_host_ops_per_rank",
                                                "zero3_reduce_host_ops_per_rank", "zero3_persist_host_ops_per_rank",
                                                "host_op_us", "layer_overhead_ms", "grad_accumulation_passes",
                                                "expert_gemm_call_us")},
    **{f"framework.{k}": FRACTION for k in ("tp_overlap", "pp_overlap", "ep_a2a_overlap", "overlap_slowdown",
                                            "recompute_layer_fraction")},
    "framework.moe_routed_copies_kept": _i(0, 2),  # xpar.estimate.memory.activations.routed_copy_bytes
    "framework.grad_reduce_bytes": _i(2, 4), "framework.grad_bytes": _i(2, 6), "framework.optimizer_bytes": _i(0, 16),
    "framework.bucket_mb": NON_NEGATIVE,  # 0: one buffer (xpar.estimate.comm.dp)
    "framework.zero3_persist_numel": COUNT, "framework.grad_buckets": COUNT,
    "framework.zero3_reuse_distance": Range(0, null=True),
    "framework.adamw_bytes_per_element": Range(0, lo_open=True, null=True), "framework.interleaved_min_pp": DEGREE,
    # plan (xpar plan's space; ranges [lo, hi] of global batch and devices in xpar.plan)
    "plan.global_batch_size": _i(1, auto=True, lists=True), "plan.devices": _i(1, null=True, lists=True),
    "plan.min_tokens_per_s": Range(0, lo_open=True, null=True), "plan.max_tp": _i(1, null=True),
    "plan.pp": _i(1, null=True), "plan.max_micro_batch_size": DEGREE,
    "plan.memory_headroom": Range(0, 1, hi_open=True, null=True), "plan.top_k": DEGREE, "plan.execute_top": COUNT,
    "plan.tie_within": Range(0, 1, hi_open=True), "framework.tp_overlap_across_nodes": FRACTION,
    "model.head_dim": _i(1, null=True), "parallel.zero_shard_size": _i(1, null=True),
    "framework.make_vocab_size_divisible_by": _i(1, null=True),
    "hardware.sm_count": _i(1, null=True), "hardware.gemm_tile_m": _i(16, 512), "hardware.gemm_tile_n": _i(16, 512),
    **{f"hardware.{k}": Range(0, 1, lo_open=True, null=True) for k in ("gemm_efficiency", "gemm_efficiency_fp8",
                                                                      "attention_efficiency", "attention_bwd_efficiency",
                                                                      "attention_efficiency_fa2",
                                                                      "attention_bwd_efficiency_fa2",
                                                                      "attention_efficiency_cudnn_2024",
                                                                      "attention_bwd_efficiency_cudnn_2024")},
    "hardware.kernel_launch_us": NON_NEGATIVE, "hardware.gemm_tile_fixed_us_fp8": NON_NEGATIVE,
    "hardware.attention_half_seq": POSITIVE,
    "hardware.sustained_efficiency": EFFICIENCY,
    "framework.elementwise_passes": Range(1, 20),
    "framework.max_pp": _i(1, null=True), "framework.max_tp": _i(1, null=True),
    "framework.max_cp": _i(1, null=True), "framework.max_ep": _i(1, null=True),
    "framework.moe_max_tp": _i(1, null=True),
    "framework.grad_reduce_cast_bytes": _i(0, 4), "framework.grad_accum_cast_bytes": _i(0, 4),
}


def _fix(rng: Range, default):
    """A value that works: the range's own, else the schema's default where in range, else the low bound or null."""
    if rng.fix is not None:
        return rng.fix
    if default is not None and rng.holds(default):
        return str(default).lower() if isinstance(default, bool) else default
    if rng.null:
        return "null"
    low = rng.lo if rng.lo is not None else 0
    return _num(low + (1 if rng.integer and rng.lo_open else 0.5 if rng.lo_open else 0))


def _defaults() -> dict:
    root = XparConfig()
    return {f"{g.name}.{f.name}": getattr(getattr(root, g.name), f.name)
            for g in fields(XparConfig) for f in fields(getattr(root, g.name))}


def range_problems(c) -> dict[str, str]:
    """Every numeric key of the composed :class:`~xpar.config.schema.XparConfig` ``c`` outside its
    :data:`RANGES` entry: key -> one line (constraint, value given, a value that works). Raises nothing."""
    out, defaults = {}, None
    for key, rng in RANGES.items():
        group, name = key.split(".")
        value = getattr(getattr(c, group), name)
        if rng.holds(value):
            continue
        defaults = defaults or _defaults()
        shown = "null" if value is None else value
        out[key] = f"{key} must be {rng.text()}, got {shown}; e.g. {key}={_fix(rng, defaults[key])}."
    return out
