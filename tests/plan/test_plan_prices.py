"""Prices the planner can trust (issue 44): a tp group across nodes hides none of its collectives behind the
GEMMs (framework.tp_overlap_across_nodes, 0: the profile's tp_overlap is an NVLink figure), pp_overlap only
under the schedules the framework overlaps p2p in (framework.pp_overlap_schedules), and an overlapped send
still costs its fixed part once per chunk boundary; the planner's columns equal the scalar estimate."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import compose
from tests.plan.test_plan_five import _sample, assert_equal_to_scalar, context, space_of
from xpar.config.validate import validate
from xpar.estimate.cost import Assumptions, ep_a2a_overlap_of, estimate, pp_overlap_of, pp_send_latency, rank_compute
from xpar.estimate.comm.volume import pp_sends
from xpar.plan.space import Constraints

MCORE = ["framework=megatron_core", "model=175b", "run.mode=estimate", "train.dtype=bf16", "train.micro_batch_size=1",
         "parallel.micro_batches=auto"]


def _tp(cross: float) -> dict:
    return {"f": 1.0, "b": 2.0, "end": 0.5, "b_async": 0.4, "cross": cross}


def test_tp_overlap_applies_inside_a_node_only():
    c = {k: 10.0 for k in ("mm_f", "mm_b", "mem_f", "mem_b", "logits_mm_f", "logits_mm_b", "logits_mem_f",
                           "logits_mem_b")}  # GEMMs long enough to hide any share
    c.update(ovh_f=0.0, ovh_b=0.0)  # no kernel overhead
    a = Assumptions(tp_overlap=0.8, tp_async_backward=True)
    inside, across = rank_compute(c, _tp(0.0), 4, 0, 0, a), rank_compute(c, _tp(1.0), 4, 0, 0, a)
    assert inside["tp_issued"] == across["tp_issued"] == 12.0
    assert inside["tp_comm"] == pytest.approx(12.0 * 0.2)
    assert across["tp_comm"] == pytest.approx(12.0 - 4 * 0.4)  # only the async dgrad stays hidden


def test_megatron_core_tp16_across_two_nodes_exposes_its_collectives():
    """175B on 16 H100 under megatron_core: tp 16 spans two nodes; its exposed tp time is the issued time
    less the async backward share, not 20 % of it (the profile's userbuffer overlap)."""
    spec = validate(compose(*MCORE, "hardware=h100_80gb_16gpu", "parallel.tp=16", "parallel.dp=1",
                            "parallel.sequence_parallel=true", "train.global_batch_size=8"))
    est = estimate(spec)
    issued = est.comm_time["tp"]
    assert est.time_breakdown["tp_comm"] > 0.5 * issued
    inside = estimate(validate(compose(*MCORE, "hardware=h100_80gb_16gpu", "parallel.tp=8", "parallel.dp=2",
                                       "parallel.sequence_parallel=true", "train.global_batch_size=8")))
    assert inside.time_breakdown["tp_comm"] < 0.25 * inside.comm_time["tp"]


def test_pp_overlap_per_schedule_family_and_the_per_chunk_cost():
    """megatron_core overlaps p2p under interleaved 1F1B only: 1F1B's sends are exposed whole; interleaved's
    exposed part is each send's fixed cost, 2 v sends per micro-batch on a middle rank."""
    a = Assumptions.from_config(validate(compose(*MCORE, "hardware=h100_80gb_64gpu")).framework)
    assert pp_overlap_of(a, "interleaved_1f1b") == 1.0 and pp_overlap_of(a, "1f1b") == 0.0
    assert pp_overlap_of(Assumptions(pp_overlap=0.5), "1f1b") == 0.5  # null: every schedule (xpar's figures)
    common = [*MCORE, "hardware=h100_80gb_64gpu", "parallel.tp=8", "parallel.pp=4", "parallel.dp=2",
              "parallel.micro_batches=8", "train.global_batch_size=16"]
    one = estimate(validate(compose(*common, "parallel.schedule=1f1b")))
    assert one.time_breakdown["pp_comm"] == pytest.approx(one.comm_time["pp"], rel=1e-9)
    spec = validate(compose(*common, "parallel.schedule=interleaved_1f1b", "parallel.virtual_stages=4"))
    inter = estimate(spec)
    assert 0 < inter.time_breakdown["pp_comm"] < 0.2 * inter.comm_time["pp"]
    worst = max(pp_sends(spec.layout, r) for r in range(spec.pp))
    assert worst == 8  # a middle rank: 4 chunks, a send each way per chunk
    assert inter.time_breakdown["pp_comm"] <= 8 * worst * pp_send_latency(spec) * 1.0000001


@pytest.mark.slow  # integration-sized (conftest.INTEGRATION): runs in the full suite, not the fast loop
@pytest.mark.parametrize("framework", ["megatron_core", "hai_llm"])
def test_planner_columns_equal_the_scalar_estimate_with_cross_node_tp_and_pp_families(framework):
    ctx = context("175b", "h100_80gb_64gpu", 2048, framework)
    c = space_of(ctx, Constraints(global_batch=(64, 64), schedules=tuple(ctx.framework["schedules"]),
                                  zero_stages=(0, 1), pp_zero_stages=(0, 1), max_micro_batch_size=2,
                                  microbatch_rule="megatron", interleaved_m_per_pp=True)).cols
    pick = (c["tp"] == 16) | ((c["pp"] > 1) & (c["v"] > 1)) | ((c["pp"] > 1) & (c["schedule"] == "1f1b"))
    assert (c["tp"] == 16).any()
    assert_equal_to_scalar(ctx, _sample(c, pick, 16, 21))


def test_cp_and_ep_groups_across_nodes_are_priced_on_the_nics():
    """A cp group strided by tp 8 spans nodes (rank order pp, dp, cp, tp): its all-gather runs over the NICs,
    slower than the same group inside a node (tp 4), per byte; an ep group of 16 (etp 1) spans two nodes."""
    from dataclasses import replace

    from xpar.estimate.comm.collectives import group_of
    from xpar.estimate.context_parallel import cp_layer_times, cp_payload_bytes
    from xpar.estimate.expert_parallel import ep_layer_times

    base = ["model=70b", "run.mode=estimate", "hardware=h100_80gb_64gpu", "train.micro_batch_size=1",
            "parallel.micro_batches=auto", "train.seq_len=16384"]
    per_byte = {}
    for tp in (4, 8):
        spec = validate(compose(*base, f"parallel.tp={tp}", "parallel.cp=2", "parallel.dp=auto"))
        assert group_of(spec.hardware, 2, tp).nodes == (2 if tp == 8 else 1)
        per_byte[tp] = cp_layer_times(spec)["f"] / cp_payload_bytes(spec)
    assert per_byte[8] > 3 * per_byte[4]
    moe = validate(compose("model=mixtral_8x7b", "run.mode=estimate", "hardware=h100_80gb_64gpu",
                           "train.micro_batch_size=1", "parallel.micro_batches=auto", "parallel.ep=8", "parallel.dp=auto"))
    inside = ep_layer_times(moe)["f"]
    across = ep_layer_times(replace(moe, layout=replace(moe.layout, ep=16, etp=1, tp=1)))["f"]
    assert group_of(moe.hardware, 16, 1).nodes == 2 and across > 2 * inside


HAI = ["framework=hai_llm", "model=mixtral_8x7b", "run.mode=estimate", "hardware=h100_80gb_64gpu", "train.dtype=bf16",
       "train.micro_batch_size=1", "parallel.ep=8", "parallel.tp=1", "parallel.dp=auto", "parallel.pp=2",
       "parallel.micro_batches=8", "train.global_batch_size=256"]


def test_hai_llm_hides_the_all_to_alls_under_dualpipe_only():
    """framework.ep_a2a_overlap_schedules: hai_llm's ep_a2a_overlap 1.0 is DualPipe's pairing of one micro-batch's
    forward with another's backward (DeepSeek-AI 2024 Sec. 3.2.1); under 1F1B, or without pp, the all-to-alls are
    exposed whole. Before, every schedule hid them, and the plan's MoE winners took 1F1B with free all-to-alls."""
    dual = estimate(validate(compose(*HAI, "parallel.schedule=dualpipev", "parallel.virtual_stages=2")))
    one = estimate(validate(compose(*HAI, "parallel.schedule=1f1b")))
    flat = estimate(validate(compose(*HAI[:-3], "parallel.pp=1", "parallel.micro_batches=4",
                                     "train.global_batch_size=256")))
    assert dual.comm_time["ep"] > 0 and dual.time_breakdown["ep_comm"] == 0.0
    assert one.time_breakdown["ep_comm"] == pytest.approx(one.comm_time["ep"], rel=1e-12)
    assert flat.time_breakdown["ep_comm"] == pytest.approx(flat.comm_time["ep"], rel=1e-12)
    a = Assumptions(ep_a2a_overlap=0.5)  # null: every layout, as before (profiles that set no list)
    assert ep_a2a_overlap_of(a, "1f1b", 1) == 0.5 == ep_a2a_overlap_of(a, "gpipe", 4)


def test_an_overlapped_all_to_all_hides_behind_the_gemms_at_most():
    """DualPipe hides one micro-batch's all-to-alls behind another's GEMMs (DeepSeek-AI 2024 Sec. 3.2.1): on a
    slow link, where they take longer than the step's matmuls, the rest is exposed. Before, ep_a2a_overlap 1.0 hid
    them whole however long they took."""
    dual = ["parallel.schedule=dualpipev", "parallel.virtual_stages=2"]
    fast = estimate(validate(compose(*HAI, *dual)))
    slow = estimate(validate(compose(*HAI, *dual, "hardware.intra_node_gb_per_s=2")))
    matmul, issued = slow.time_breakdown["matmul"], slow.comm_time["ep"]
    assert issued > matmul and fast.comm_time["ep"] < fast.time_breakdown["matmul"]
    assert fast.time_breakdown["ep_comm"] == 0.0
    assert slow.time_breakdown["ep_comm"] == pytest.approx(issued - matmul, rel=1e-9)


def test_planner_ep_columns_equal_the_scalar_estimate_under_each_schedule_of_hai_llm():
    ctx = context("mixtral_8x7b", "h100_80gb_64gpu", 4096, "hai_llm")
    c = space_of(ctx, Constraints(global_batch=(128, 128), schedules=("1f1b", "dualpipev"), zero_stages=(1,),
                                  pp_zero_stages=(1,), max_micro_batch_size=1, ep=(8,), recompute=("none",),
                                  sequence_parallel=(False,))).cols
    pick = (c["tp"] == 1) & (c["pp"] <= 4)
    assert {"1f1b", "dualpipev"} <= set(c["schedule"][pick].tolist())
    sub = _sample(c, pick & (c["pp"] > 1), 4, 3)
    sub = {k: np.concatenate([sub[k], v[np.flatnonzero(pick & (c["pp"] == 1))[:1]]]) for k, v in c.items()}
    res = assert_equal_to_scalar(ctx, sub)
    dual = sub["schedule"] == "dualpipev"
    assert dual.any() and (~dual).any()
    assert (res["time_ep_comm"][dual & (sub["pp"] > 1)] == 0).all() and (res["time_ep_comm"][~dual] > 0).all()


def test_a_bad_ep_a2a_overlap_schedule_is_one_line():
    from xpar.config.checks.framework import check_framework
    from xpar.config.profile import FrameworkConfig
    lines = check_framework(FrameworkConfig(ep_a2a_overlap_schedules=["dualpipe"]))
    assert len(lines) == 1 and "framework.ep_a2a_overlap_schedules=[dualpipe]" in lines[0] and "dualpipev" in lines[0]
