"""fsdp2_bf16 (NeMo AutoModel) prices its element-wise kernels as fused (Transformer Engine RMSNorm and RoPE, a
compiled SwiGLU, TE's fused MoE permutation: conf/framework/fsdp2_bf16.yaml), not at torchtitan's eager 3x traffic
(issue 43, refusal_hunt2.md rows 9-12, 18-19)."""
from __future__ import annotations

import pytest

from tests.conftest import compose, spec_for
from xpar.config.validate import validate
from xpar.estimate.cost import estimate
from xpar.estimate.step_parts import assumptions_for


def qwen3(framework: str, *overrides: str):
    return spec_for("model=qwen3_30b_a3b", "run.mode=estimate", "hardware=h100_80gb_8gpu", f"framework={framework}",
                    "parallel.ep=8", "parallel.dp=8", "parallel.zero_stage=3", "parallel.recompute=full",
                    "train.dtype=bf16", "train.micro_batch_size=4", "train.global_batch_size=512", "run.dry_run=false", *overrides,
                    local_devices=8)


def test_automodel_profile_fuses_what_torchtitan_runs_eagerly():
    assert assumptions_for(qwen3("fsdp2_bf16")).elementwise_passes == 1.0
    titan = validate(compose("model=7b", "hardware=h100_80gb_8gpu", "framework=torchtitan", "tracking=off"))
    assert assumptions_for(titan).elementwise_passes == 3.0


def test_qwen3_moe_memory_bound_work_is_the_fused_traffic():
    """Qwen3-30B-A3B EP8 at micro-batch 4 (AutoModel's benchmark row): the blocks' memory-bound seconds are a third of
    what the eager count gives (the logits' fp32 cross-entropy passes, not an element-wise chain, stay); the GEMMs
    and all-to-alls do not change, and the step is shorter by the difference."""
    fused, eager = estimate(qwen3("fsdp2_bf16")), estimate(qwen3("fsdp2_bf16", "framework.elementwise_passes=3"))
    a, b = fused.time_breakdown, eager.time_breakdown
    assert a["matmul"] == b["matmul"] and a["ep_comm"] == pytest.approx(b["ep_comm"])
    assert 2.5 * a["memory_bound"] < b["memory_bound"] < 3 * a["memory_bound"]
    assert fused.time_per_step_s == pytest.approx(
        eager.time_per_step_s - (b["memory_bound"] - a["memory_bound"]), rel=0.02)
