"""model.mtp_layers: multi-token prediction modules on the last pipeline stage (DeepSeek-V3 Sec. 2.2; Megatron-Core
--mtp-num-layers, which NeMo 25.04's DeepSeek-V3 recipe sets to 1): one more block and output-head pass each there
(xpar.estimate.columns.mtp); estimate and planner alike, refused in execute mode."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import spec_for
from tests.plan.test_plan_five import _sample, assert_equal_to_scalar, context, space_of
from xpar.config.checks import ConfigError
from xpar.estimate.compute.kernel_costs import kernel_layer_costs
from xpar.estimate.cost import estimate
from xpar.estimate.step_parts import assumptions_for
from xpar.plan.space import Constraints


def mixtral(*overrides: str):
    return spec_for("model=mixtral_8x7b", "model.seq_len=4096", "run.mode=estimate", "hardware=h100_80gb_64gpu",
                    "framework=megatron_core", "train.dtype=bf16", "parallel.tp=2", "parallel.dp=32", "parallel.ep=8",
                    "parallel.etp=1", "parallel.sequence_parallel=true", "parallel.zero_stage=1",
                    "train.micro_batch_size=1", "train.global_batch_size=256", "run.dry_run=false", *overrides,
                    local_devices=64)


def test_one_mtp_module_is_one_more_block_and_head_pass_on_the_one_stage():
    """pp 1, m 8: the GEMM seconds grow by m x (one block's forward and backward + the output head's), the
    all-to-alls by one MoE block's in 32 (Mixtral: every block MoE)."""
    base, mtp = mixtral(), mixtral("model.mtp_layers=1")
    c = kernel_layer_costs(base, assumptions_for(base))
    m = base.micro_batches
    added = m * (c["mm_f"] + c["mm_b"] + c["logits_mm_f"] + c["logits_mm_b"])
    a, b = estimate(base).time_breakdown, estimate(mtp).time_breakdown
    assert b["matmul"] - a["matmul"] == pytest.approx(added, rel=1e-9) and added > 0
    assert b["ep_comm"] == pytest.approx(a["ep_comm"] * 33 / 32, rel=1e-9)


def test_mtp_weighs_on_the_last_stage_only():
    """pp 4 (8 blocks a rank): the last rank computes 9 blocks and 2 head passes and sets the step; the first rank's
    work is unchanged."""
    a, b = estimate(mixtral("parallel.pp=4", "parallel.dp=8")), estimate(mixtral("parallel.pp=4", "parallel.dp=8",
                                                                                  "model.mtp_layers=1"))
    assert b.time_per_step_s > a.time_per_step_s
    assert b.time_breakdown["ep_comm"] == pytest.approx(a.time_breakdown["ep_comm"] * 9 / 8, rel=1e-9)


def test_mtp_candidates_equal_the_scalar_estimate():
    ctx = context("deepseek_v3", "h100_80gb_64gpu", 4096, "megatron_core")
    ctx.model["mtp_layers"] = 1
    c = Constraints(global_batch=(1024, 1024), pp=16, ep=(4,), zero_stages=(1,), pp_zero_stages=(0, 1),
                    schedules=("1f1b",), max_micro_batch_size=1, max_tp=2)
    space = space_of(ctx, c)
    res = assert_equal_to_scalar(ctx, _sample(space.cols, space.cols["ep"] == 4, 3, 5))
    assert (np.asarray(res["time_ep_comm"]) > 0).all()


def test_mtp_is_estimated_not_executed():
    with pytest.raises(ConfigError) as e:
        spec_for("model=tiny", "run.mode=execute", "model.mtp_layers=1")
    assert "model.mtp_layers=0" in str(e.value) and "run.mode=estimate" in str(e.value)
    with pytest.raises(ConfigError):
        spec_for("model=tiny", "run.mode=estimate", "model.mtp_layers=-1")
