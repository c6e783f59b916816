"""model.moe_routing: NeMo AutoModel's round-robin benchmark gate (FakeBalancedGate) sends a token's k consecutive
experts to 1-2 ranks and nodes, so DeepEP moves fewer copies than under learned routing; estimate and planner agree,
execute mode refuses it."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import spec_for
from tests.plan.test_plan_five import _sample, assert_equal_to_scalar, context, space_of
from xpar.estimate.comm.collectives import Group
from xpar.estimate.cost import estimate
from xpar.estimate.expert_parallel import ep_shares, expert_hit, round_robin_reach
from xpar.plan.space import Constraints


def test_round_robin_reach_counts_the_distinct_ranks_of_consecutive_experts():
    """Qwen3-30B-A3B at ep 8 (16 experts a rank, 8 consecutive from a multiple of 8): 1 rank; DeepSeek-V3 at ep 64
    (4 a rank): 2 ranks, 1 node of 8; Kimi K2 at ep 32 (12 a rank, starts 0, 8, 4 mod 12): 4/3; learned routing
    reaches 8 (1 - (7/8)^8) = 5.25 of 8."""
    assert round_robin_reach(128, 8, 8) == 1.0 and round_robin_reach(256, 8, 64) == 2.0
    assert round_robin_reach(256, 8, 8) == 1.0 and round_robin_reach(384, 8, 32) == pytest.approx(4 / 3)
    assert round_robin_reach(128, 8, 1) == 1.0 and 8 * expert_hit(8, 8) == pytest.approx(5.2511, abs=1e-4)
    with pytest.raises(ValueError):
        round_robin_reach(100, 8, 8)


def test_deepep_shares_under_the_round_robin_gate():
    """One node of 8 ranks: 1 copy a token over NVLink (1/k of the T k copies), none across; 8 nodes (ep 64,
    DeepSeek-V3): 2 ranks, 1 node a token, 7/8 of it remote. The plain all-to-all sends every copy either way."""
    assert ep_shares("deepep", 8, Group(8, 8), round_robin_experts=128) == (0.125, 0.0)
    intra, inter = ep_shares("deepep", 8, Group(64, 8), 8, 4, round_robin_experts=256)
    assert intra == pytest.approx(2 / 8) and inter == pytest.approx(7 / 8 / 8)
    learned = ep_shares("deepep", 8, Group(64, 8), 8, 4)
    assert intra < learned[0] and inter < learned[1]
    assert ep_shares("alltoall", 8, Group(8, 8), round_robin_experts=128) == (None, None)


def qwen3(*overrides: str):
    return spec_for("model=qwen3_30b_a3b", "run.mode=estimate", "hardware=h100_80gb_8gpu", "framework=fsdp2_bf16",
                    "parallel.ep=8", "parallel.dp=8", "parallel.zero_stage=3", "parallel.recompute=full",
                    "train.micro_batch_size=1", "train.global_batch_size=64", "run.dry_run=false", *overrides,
                    local_devices=8)


def test_round_robin_gate_cuts_the_all_to_alls_only():
    """Qwen3-30B-A3B EP8 FSDP8 as AutoModel's benchmark ran it: the all-to-alls carry 1 copy a token, not 5.25
    (their seconds fall about 5x: latency stays), the GEMMs and memory-bound work are the same."""
    learned, rr = estimate(qwen3()), estimate(qwen3("model.moe_routing=round_robin"))
    a, b = learned.time_breakdown, rr.time_breakdown
    assert b["ep_comm"] < a["ep_comm"] / 4 and b["ep_comm"] > a["ep_comm"] / 5.3
    assert b["matmul"] == a["matmul"] and b["memory_bound"] == a["memory_bound"]
    assert rr.memory.total == learned.memory.total


AUTOMODEL = dict(max_tp=1, zero_stages=(3,), pp_zero_stages=(2, 3))
"""What fsdp2_bf16 runs for a MoE model (conf/framework/fsdp2_bf16.yaml: moe_max_tp, zero_stages, pp_zero_stages)."""


def test_round_robin_candidates_equal_the_scalar_estimate():
    """The planner prices the gate as the estimate does (relative 1e-9) on sampled ep candidates."""
    ctx = context("qwen3_30b_a3b", "h100_80gb_8gpu", 4096, "fsdp2_bf16")
    ctx.model["moe_routing"] = "round_robin"
    space = space_of(ctx, Constraints(global_batch=(512, 512), ep=(2, 8), **AUTOMODEL))
    res = assert_equal_to_scalar(ctx, _sample(space.cols, space.cols["ep"] > 1, 4, 3))
    assert (np.asarray(res["time_ep_comm"]) > 0).all()


def test_round_robin_gate_is_estimated_not_executed():
    from xpar.config.checks import ConfigError
    with pytest.raises(ConfigError) as e:
        spec_for("model=moe_tiny", "run.mode=execute", "model.moe_routing=round_robin")
    assert "model.moe_routing=learned" in str(e.value)
    with pytest.raises(ConfigError) as e:
        spec_for("model=moe_tiny", "run.mode=estimate", "model.moe_routing=random")
    assert "model.moe_routing must be one of" in str(e.value)


def v2_lite(*overrides: str):
    return spec_for("model=deepseek_v2_lite", "run.mode=estimate", "hardware=h100_80gb_8gpu", "framework=fsdp2_bf16",
                    "parallel.ep=8", "parallel.dp=8", "parallel.zero_stage=3", "train.micro_batch_size=1",
                    "train.global_batch_size=64", "run.dry_run=false", *overrides, local_devices=8)


def test_shared_experts_on_their_own_stream_hide_the_all_to_alls():
    """fsdp2_bf16 (AutoModel's MoE.forward: shared experts on a second stream): DeepSeek-V2-Lite's 2 shared of 6
    routed experts hide min(issued, their share of the matmul seconds) of the all-to-alls; without the overlap
    every issued second is exposed. A model without shared experts (Qwen3) is unchanged."""
    from xpar.estimate.expert_parallel import routed_share, shared_expert_share
    spec = v2_lite()
    assert shared_expert_share(spec) == pytest.approx(routed_share(spec) * 2 / 6)
    on, off = estimate(spec), estimate(v2_lite("framework.ep_shared_expert_overlap=false"))
    issued, mm = on.comm_time["ep"], on.time_breakdown["matmul"]
    assert off.time_breakdown["ep_comm"] == pytest.approx(issued, rel=1e-12) and issued == off.comm_time["ep"]
    hidden = min(issued, mm * shared_expert_share(spec))
    assert hidden > 0 and on.time_breakdown["ep_comm"] == pytest.approx(issued - hidden, rel=1e-9)
    assert on.time_per_step_s == pytest.approx(off.time_per_step_s - hidden, rel=1e-9)
    assert "shared experts' GEMMs hide" in " ".join(on.notes)
    q_on, q_off = estimate(qwen3()), estimate(qwen3("framework.ep_shared_expert_overlap=false"))
    assert shared_expert_share(qwen3()) == 0.0 and q_on.time_per_step_s == q_off.time_per_step_s


def test_shared_expert_overlap_candidates_equal_the_scalar_estimate():
    """The planner hides the same seconds as the estimate (relative 1e-9) on sampled ep candidates of
    DeepSeek-V2-Lite under fsdp2_bf16 with the round-robin gate."""
    ctx = context("deepseek_v2_lite", "h100_80gb_8gpu", 4096, "fsdp2_bf16")
    ctx.model["moe_routing"] = "round_robin"
    space = space_of(ctx, Constraints(global_batch=(64, 64), ep=(2, 8), **AUTOMODEL))
    assert_equal_to_scalar(ctx, _sample(space.cols, space.cols["ep"] > 1, 4, 5))
