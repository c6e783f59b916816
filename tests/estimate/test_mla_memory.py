"""MLA's saved activations at its own widths and Megatron-Core's module recompute policies (xpar.estimate.memory.mla,
xpar.config.remat.MODULE_POLICIES): DeepSeek-V3's block by hand, what each module discards and reruns, the policies
refused where the model lacks the module and in execute mode, the planner equal to the estimate."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import compose, spec_for
from tests.plan.test_plan_five import _sample, assert_equal_to_scalar, context, space_of
from xpar.config.checks import ConfigError
from xpar.config.remat import extra_forward_flops_per_layer, model_policies
from xpar.config.validate import validate
from xpar.estimate.compute.kernel_costs import rerun_shares
from xpar.estimate.cost import estimate
from xpar.estimate.memory.activations import layer_bytes
from xpar.estimate.step_parts import assumptions_for
from xpar.plan.space import Constraints

N, H, S = 128, 7168, 4096  # DeepSeek-V3: heads, hidden, sequence


def dsv3(*overrides: str):
    """Validated, not memory-checked (64 H100 hold no DeepSeek-V3: only the block is compared)."""
    return validate(compose("tracking=off", "model=deepseek_v3", "run.mode=estimate", "hardware=h100_80gb_64gpu",
                            "framework=megatron_core", "train.dtype=bf16", "parallel.tp=1", "parallel.pp=8",
                            "parallel.dp=8", "parallel.ep=8", "parallel.zero_stage=1", "train.micro_batch_size=1",
                            "train.global_batch_size=64", "run.dry_run=false", *overrides), 64)


def block(spec) -> dict:
    return layer_bytes(spec, assumptions_for(spec), 1.0)  # Assumptions: the MemoryOptions the estimate uses


def test_mla_block_keeps_q_k_at_192_v_and_context_at_128_and_its_latents():
    """Against the same model as MHA at h (128 heads of 56): the attention's Q, K, V and context are
    128 x (192 + 192 + 128 + 128) wide, not 4 h, and the q and kv latents (1536 + 512) are kept twice (norm
    input, up projection's input); bf16, tp 1. Bytes per token."""
    mla = block(dsv3())["none"] / S
    mha = block(dsv3("model.kv_lora_rank=null", "model.q_lora_rank=null", "model.qk_nope_head_dim=null",
                     "model.qk_rope_head_dim=null", "model.v_head_dim=null"))["none"] / S
    assert mla - mha == 2 * (N * (192 + 192 + 128 + 128) - 4 * H) + 2 * 2 * (1536 + 512)


def test_mla_up_proj_discards_q_k_v_and_layernorm_the_two_norm_outputs():
    """--recompute-modules mla_up_proj: q, k (192 each) and v (128) per head gone, the context kept; layernorm:
    the two norms' outputs (h each); moe_act: the routed experts' SwiGLU output (8 x 2048, 58 of 61 blocks).
    Each reruns its forward: the up projections' FLOPs; the norms and the activation none (element-wise)."""
    none = block(dsv3())["none"] / S
    up = block(dsv3("parallel.recompute=mla_up_proj"))
    norm = block(dsv3("parallel.recompute=mla_up_proj_norm"))["kept"] / S
    act = block(dsv3("parallel.recompute=mla_up_proj_norm_moe_act"))["kept"] / S
    assert none - up["kept"] / S == 2 * N * (192 + 192 + 128)
    assert up["workspace"] == 2 * N * (192 + 192 + 128) * S
    assert up["kept"] / S - norm == 2 * 2 * H
    assert norm - act == pytest.approx(2 * 8 * 2048 * 58 / 61, rel=1e-12)
    cfg = dsv3().model
    up_flops = 2 * (1536 * N * 192 + 512 * N * (128 + 128))
    for policy in ("mla_up_proj", "mla_up_proj_norm", "mla_up_proj_norm_moe_act"):
        assert extra_forward_flops_per_layer(cfg, S, policy) == up_flops
    share = rerun_shares("mla_up_proj", True, cfg)
    assert 0.25 < share["projections"] < 0.35 and share["mlp"] == 0 and share["attention"] == 0


def test_the_up_projection_recompute_fits_deepseek_v3_as_its_report_ran_it():
    """DeepSeek-V3 on 2048 H800 (conf/parallel/deepseek_v3_2048gpu.yaml) recomputes RMSNorm and the MLA
    up-projections (its report Sec. 3.2.3): it fits; without them its MLA activations do not; the step pays
    the up projections' rerun."""
    fits = spec_for("parallel=deepseek_v3_2048gpu", "run.mode=estimate", "run.dry_run=false", local_devices=2048)
    assert fits.layout.recompute == "mla_up_proj_norm"
    with pytest.raises(ConfigError) as e:
        spec_for("parallel=deepseek_v3_2048gpu", "run.mode=estimate", "run.dry_run=false", "parallel.recompute=none",
                 local_devices=2048)
    assert "does not fit device memory" in str(e.value)
    up = spec_for("parallel=deepseek_v3_2048gpu", "run.mode=estimate", "run.dry_run=false",
                  "parallel.recompute=mla_up_proj", local_devices=2048)
    a, b = estimate(fits), estimate(up)
    assert a.memory.total < b.memory.total and a.time_per_step_s == pytest.approx(b.time_per_step_s, rel=1e-9)


def test_module_policies_need_their_modules_and_are_not_executed():
    """Without MLA (or experts, for moe_act) the module is not in the model: refused in one line naming the
    policies that work; the planner offers them to MLA models only; execute mode refuses them (xpar runs no MLA)."""
    with pytest.raises(ConfigError) as e:
        spec_for("model=tiny", "run.mode=estimate", "parallel.recompute=mla_up_proj")
    assert "model.kv_lora_rank" in str(e.value) and "parallel.recompute=selective" in str(e.value)
    with pytest.raises(ConfigError) as e:
        spec_for("model=deepseek_v3", "model.n_experts=0", "model.first_dense_layers=0", "run.mode=estimate",
                 "parallel.recompute=mla_up_proj_norm_moe_act")
    assert "routed experts" in str(e.value)
    with pytest.raises(ConfigError) as e:
        spec_for("model=tiny", "run.mode=execute", "parallel.recompute=mla_up_proj_norm")
    assert "estimated, not executed" in str(e.value)
    policies = ["none", "full", "moe", "mla_up_proj", "mla_up_proj_norm_moe_act"]
    assert model_policies(policies, 0) == ["none", "full"]
    assert model_policies(policies, 0, mla=True) == ["none", "full", "mla_up_proj"]
    assert model_policies(policies, 256, mla=True) == policies


def test_mla_recompute_candidates_equal_the_scalar_estimate():
    """The planner (xpar.estimate.columns) prices MLA's widths and the module policies as estimate() does."""
    ctx = context("deepseek_v3", "h100_80gb_64gpu", 4096, "megatron_core")
    c = Constraints(global_batch=(1024, 1024), pp=16, ep=(4,), zero_stages=(1,), pp_zero_stages=(0, 1),
                    schedules=("1f1b",), max_micro_batch_size=1, max_tp=2,
                    recompute=("none", "mla_up_proj_norm", "mla_up_proj_norm_moe_act"))
    space = space_of(ctx, c)
    pick = np.isin(space.cols["recompute"], ("mla_up_proj_norm", "mla_up_proj_norm_moe_act"))
    res = assert_equal_to_scalar(ctx, _sample(space.cols, pick, 4, 7))
    assert (np.asarray(res["memory_total"]) > 0).all()
